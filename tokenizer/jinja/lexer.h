#pragma once
// Splits a template into text and tag tokens the way jinja2's lexer does with trim_blocks and
// lstrip_blocks on: `{%-`/`-%}` whitespace control, `+` to keep whitespace, comments dropped,
// raw blocks as text, newlines normalised to "\n" and one trailing newline removed.

#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace moeline::tokenizer::jinja {

enum class TokenKind {
  kText,
  kVariableBegin,
  kVariableEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInteger,
  kFloat,
  kOperator,
  kEnd
};

struct Token {
  TokenKind kind;
  std::string text;  // text, name, operator, or a string literal's decoded value
  int line;
  int64_t integer = 0;
  double real = 0;
};

// Decodes the string literal whose opening quote is at `pos` into `out` and returns the position
// after its closing quote; `line` advances over the newlines inside.
size_t decode_string_literal(std::string_view src, size_t pos, std::string& out, int& line);

// Throws RenderError naming the line on a malformed template.
std::vector<Token> tokenize(std::string_view source);

}  // namespace moeline::tokenizer::jinja
