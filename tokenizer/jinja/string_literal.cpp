// String literals as jinja2 decodes them: Python's unicode-escape rules.
#include <cctype>
#include <cstdlib>

#include "tokenizer/jinja/lexer.h"
#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {
namespace {

// One escape at p (a backslash); unknown escapes stay as written.
size_t unescape(std::string_view src, size_t p, std::string& out, int& line) {
  char e = src[p + 1];
  auto hex = [&](size_t at, int n) -> long {
    if (at + n > src.size()) return -1;
    std::string h = std::string(src.substr(at, n));
    for (char c : h)
      if (!std::isxdigit(static_cast<unsigned char>(c))) return -1;
    return std::strtol(h.c_str(), nullptr, 16);
  };
  switch (e) {
    case '\n':
      ++line;
      return p + 2;
    case '\\':
    case '\'':
    case '"':
      out.push_back(e);
      return p + 2;
    case 'n':
      out.push_back('\n');
      return p + 2;
    case 't':
      out.push_back('\t');
      return p + 2;
    case 'r':
      out.push_back('\r');
      return p + 2;
    case 'a':
      out.push_back('\a');
      return p + 2;
    case 'b':
      out.push_back('\b');
      return p + 2;
    case 'f':
      out.push_back('\f');
      return p + 2;
    case 'v':
      out.push_back('\v');
      return p + 2;
    case 'x':
    case 'u':
    case 'U': {
      int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
      long cp = hex(p + 2, n);
      if (cp < 0 || cp > 0x10FFFF)
        throw RenderError(std::string("invalid \\") + e + " escape in string literal", line);
      out += text::encode(std::u32string(1, static_cast<char32_t>(cp)));
      return p + 2 + n;
    }
    default:
      if (e >= '0' && e <= '7') {
        size_t q = p + 1;
        int cp = 0;
        for (int k = 0; k < 3 && q < src.size() && src[q] >= '0' && src[q] <= '7'; ++k, ++q)
          cp = cp * 8 + (src[q] - '0');
        out += text::encode(std::u32string(1, static_cast<char32_t>(cp)));
        return q;
      }
      out.push_back('\\');
      return p + 1;
  }
}

}  // namespace

size_t decode_string_literal(std::string_view src, size_t pos, std::string& out, int& line) {
  int start_line = line;
  char quote = src[pos];
  size_t p = pos + 1;
  while (true) {
    if (p >= src.size()) throw RenderError("unterminated string literal", start_line);
    char c = src[p];
    if (c == quote) return p + 1;
    if (c == '\n') ++line;
    if (c != '\\' || p + 1 >= src.size()) {
      out.push_back(c);
      ++p;
      continue;
    }
    p = unescape(src, p, out, line);
  }
}

}  // namespace moeline::tokenizer::jinja
