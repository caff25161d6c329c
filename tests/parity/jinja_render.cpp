// Test driver for the Jinja engine (tokenizer/jinja): renders a template file over JSON contexts.
//   jinja_render TEMPLATE CONTEXT.json     prints the render, or the error on stderr (exit 1)
//   jinja_render --cases TEMPLATE CASES.json
//       CASES.json is a list of contexts; prints a JSON list of {"text": ...} or {"error": ...}
// A template that fails to parse fails every case with the parse error.
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "tokenizer/jinja/template.h"

namespace {

bool read_file(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  out = s.str();
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using moeline::tokenizer::jinja::RenderOptions;
  using moeline::tokenizer::jinja::Template;
  bool cases = argc == 4 && std::string(argv[1]) == "--cases";
  if (argc != 3 && !cases) {
    std::cerr << "usage: jinja_render [--cases] TEMPLATE CONTEXT.json\n";
    return 2;
  }
  std::string source, context_text;
  if (!read_file(argv[cases ? 2 : 1], source) || !read_file(argv[cases ? 3 : 2], context_text)) {
    std::cerr << "jinja_render: cannot read the input files\n";
    return 2;
  }
  auto contexts = nlohmann::ordered_json::parse(context_text, nullptr, false);
  if (contexts.is_discarded()) {
    std::cerr << "jinja_render: the context is not valid JSON\n";
    return 2;
  }
  auto parsed = Template::parse(source);
  RenderOptions options;
  if (!cases) {
    if (!parsed.ok()) {
      std::cerr << parsed.error().message << "\n";
      return 1;
    }
    auto text = parsed->render(contexts, options);
    if (!text.ok()) {
      std::cerr << text.error().message << "\n";
      return 1;
    }
    std::cout << *text;
    return 0;
  }
  auto results = nlohmann::ordered_json::array();
  for (const auto& context : contexts) {
    if (!parsed.ok()) {
      results.push_back({{"error", parsed.error().message}});
      continue;
    }
    auto text = parsed->render(context, options);
    if (text.ok())
      results.push_back({{"text", *text}});
    else
      results.push_back({{"error", text.error().message}});
  }
  std::cout << results.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  return 0;
}
