#pragma once
// Turns tokens into the statement tree, with jinja2's grammar and operator precedence. Tags outside
// what chat templates use (extends, include, import, block, ...) are refused by name and line.

#include <string_view>

#include "tokenizer/jinja/ast.h"

namespace moeline::tokenizer::jinja {

// Throws RenderError naming the construct and its line. Nesting deeper than kMaxParseDepth
// (expressions or blocks) is refused so a hostile template cannot exhaust the stack.
constexpr int kMaxParseDepth = 200;
Body parse_template(std::string_view source);

}  // namespace moeline::tokenizer::jinja
