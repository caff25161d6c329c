#include "tokenizer/jinja/lexer.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {
namespace {

bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         (static_cast<unsigned char>(c) >= 0x80);
}
bool is_name_char(char c) {
  return is_name_start(c) || (c >= '0' && c <= '9');
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

bool all_space(std::string_view s) {
  if (s.empty()) return false;  // jinja2 matches \s+, so nothing to strip is no match
  for (char32_t c : text::decode(s))
    if (!text::is_space(c)) return false;
  return true;
}

std::string rstrip_space(std::string_view s) {
  return text::strip(s, std::nullopt, false, true);
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) lex_root();
    push(TokenKind::kEnd, "");
    return std::move(tokens_);
  }

 private:
  void push(TokenKind kind, std::string text) {
    tokens_.push_back(Token{kind, std::move(text), line_});
  }
  int count_lines(std::string_view s) {
    int n = 0;
    for (char c : s) n += c == '\n';
    return n;
  }

  // Emits the text before a tag after the tag's whitespace control; `sign` is '-', '+' or 0.
  void emit_text(std::string_view text, char sign, bool lstrip_allowed) {
    std::string kept(text);
    if (sign == '-') {
      kept = rstrip_space(text);
    } else if (sign != '+' && lstrip_allowed) {
      size_t line_start = text.rfind('\n');
      line_start = line_start == std::string_view::npos ? 0 : line_start + 1;
      if ((line_start > 0 || line_starting_) && all_space(text.substr(line_start)))
        kept = std::string(text.substr(0, line_start));
    }
    if (!kept.empty()) push(TokenKind::kText, kept);
    line_ += count_lines(text);
  }

  // Consumes a tag end at pos_: "-X" strips all following whitespace, "+X" keeps it, and with
  // trim_blocks a block or comment end eats one newline.
  void end_tag(std::string_view close, bool trim_newline) {
    char sign = src_[pos_] == '-' || src_[pos_] == '+' ? src_[pos_] : 0;
    pos_ += (sign ? 1 : 0) + close.size();
    size_t start = pos_;
    if (sign == '-') {
      pos_ = skip_space(pos_);
    } else if (trim_newline && sign != '+' && pos_ < src_.size() && src_[pos_] == '\n') {
      ++pos_;
    }
    line_ += count_lines(std::string_view(src_).substr(start, pos_ - start));
    line_starting_ = pos_ > 0 && src_[pos_ - 1] == '\n';
  }

  // Past Python's \s* at p, multi-byte spaces included.
  size_t skip_space(size_t p) const {
    while (p < src_.size()) {
      auto b = static_cast<unsigned char>(src_[p]);
      size_t n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 1;
      std::u32string cp = text::decode(std::string_view(src_).substr(p, n));
      if (cp.size() != 1 || !text::is_space(cp[0])) break;
      p += n;
    }
    return p;
  }

  void lex_root() {
    size_t at = pos_;
    while (true) {
      at = src_.find('{', at);
      if (at == std::string::npos || at + 1 >= src_.size()) {
        emit_text(std::string_view(src_).substr(pos_), 0, false);
        pos_ = src_.size();
        return;
      }
      char kind = src_[at + 1];
      if (kind == '{' || kind == '%' || kind == '#') break;
      ++at;
    }
    char kind = src_[at + 1];
    char sign =
        at + 2 < src_.size() && (src_[at + 2] == '-' || src_[at + 2] == '+') ? src_[at + 2] : 0;
    std::string_view before = std::string_view(src_).substr(pos_, at - pos_);
    emit_text(before, sign, kind != '{');
    pos_ = at + 2 + (sign ? 1 : 0);
    line_starting_ = false;
    if (kind == '#') return lex_comment();
    if (kind == '%' && lex_raw()) return;
    push(kind == '{' ? TokenKind::kVariableBegin : TokenKind::kBlockBegin, "");
    lex_tag(kind == '{' ? "}}" : "%}", kind == '%');
  }

  void lex_comment() {
    int start_line = line_;
    size_t close = src_.find("#}", pos_);
    if (close == std::string::npos) throw RenderError("missing end of comment tag", start_line);
    size_t body_end = close;
    if (close > pos_ && (src_[close - 1] == '-' || src_[close - 1] == '+')) body_end = close - 1;
    line_ += count_lines(std::string_view(src_).substr(pos_, body_end - pos_));
    pos_ = body_end;
    end_tag("#}", true);
  }

  // `{% raw %}...{% endraw %}`: everything between is text.
  bool lex_raw() {
    size_t p = pos_;
    while (p < src_.size() && text::is_space(static_cast<unsigned char>(src_[p]))) ++p;
    if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && is_name_char(src_[p + 3])))
      return false;
    p += 3;
    while (p < src_.size() && text::is_space(static_cast<unsigned char>(src_[p]))) ++p;
    bool minus = src_.compare(p, 3, "-%}") == 0;
    if (!minus && src_.compare(p, 2, "%}") != 0) return false;
    line_ += count_lines(std::string_view(src_).substr(pos_, p - pos_));
    pos_ = p + (minus ? 3 : 2);
    if (minus) {
      size_t start = pos_;
      pos_ = skip_space(pos_);
      line_ += count_lines(std::string_view(src_).substr(start, pos_ - start));
    }
    line_starting_ = pos_ > 0 && src_[pos_ - 1] == '\n';
    // Find `{%[-+]? endraw [-+]?%}`.
    size_t search = pos_;
    while (true) {
      size_t open = src_.find("{%", search);
      if (open == std::string::npos) throw RenderError("missing end of raw directive", line_);
      size_t q = open + 2;
      char sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      if (sign) ++q;
      while (q < src_.size() && text::is_space(static_cast<unsigned char>(src_[q]))) ++q;
      if (src_.compare(q, 6, "endraw") != 0) {
        search = open + 2;
        continue;
      }
      q += 6;
      while (q < src_.size() && text::is_space(static_cast<unsigned char>(src_[q]))) ++q;
      bool close_sign = src_.compare(q, 3, "-%}") == 0 || src_.compare(q, 3, "+%}") == 0;
      if (!close_sign && src_.compare(q, 2, "%}") != 0) {
        search = open + 2;
        continue;
      }
      emit_text(std::string_view(src_).substr(pos_, open - pos_), sign, true);
      line_ += count_lines(std::string_view(src_).substr(open, q - open));
      pos_ = q;
      end_tag("%}", true);
      return true;
    }
  }

  void lex_tag(std::string_view close, bool block) {
    std::vector<char> brackets;
    while (true) {
      if (pos_ >= src_.size())
        throw RenderError(
            std::string("unexpected end of template, expected '") + std::string(close) + "'",
            line_);
      if (brackets.empty()) {
        bool minus_close = src_[pos_] == '-' && src_.compare(pos_ + 1, close.size(), close) == 0;
        bool plus_close =
            block && src_[pos_] == '+' && src_.compare(pos_ + 1, close.size(), close) == 0;
        if (minus_close || plus_close || src_.compare(pos_, close.size(), close) == 0) {
          push(block ? TokenKind::kBlockEnd : TokenKind::kVariableEnd, "");
          end_tag(close, block);
          return;
        }
      }
      char c = src_[pos_];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') {
        line_ += c == '\n';
        ++pos_;
      } else if (is_digit(c)) {
        lex_number();
      } else if (is_name_start(c)) {
        size_t start = pos_;
        while (pos_ < src_.size() && is_name_char(src_[pos_])) ++pos_;
        push(TokenKind::kName, src_.substr(start, pos_ - start));
      } else if (c == '\'' || c == '"') {
        lex_string();
      } else {
        lex_operator(brackets);
      }
    }
  }

  void lex_number() {
    size_t start = pos_;
    auto digits = [&] {
      while (pos_ < src_.size() &&
             (is_digit(src_[pos_]) ||
              (src_[pos_] == '_' && pos_ + 1 < src_.size() && is_digit(src_[pos_ + 1]))))
        ++pos_;
    };
    digits();
    bool is_float = false;
    if (pos_ + 1 < src_.size() && src_[pos_] == '.' && is_digit(src_[pos_ + 1])) {
      ++pos_;
      digits();
      is_float = true;
    }
    if (pos_ < src_.size() && (src_[pos_] == 'e' || src_[pos_] == 'E')) {
      size_t q = pos_ + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && is_digit(src_[q])) {
        pos_ = q;
        digits();
        is_float = true;
      }
    }
    std::string literal;
    for (size_t i = start; i < pos_; ++i)
      if (src_[i] != '_') literal.push_back(src_[i]);
    Token t{is_float ? TokenKind::kFloat : TokenKind::kInteger, literal, line_};
    if (is_float) {
      t.real = std::strtod(literal.c_str(), nullptr);
    } else {
      errno = 0;
      t.integer = std::strtoll(literal.c_str(), nullptr, 10);
      if (errno == ERANGE) throw RenderError("integer literal too large: " + literal, line_);
    }
    tokens_.push_back(std::move(t));
  }

  void lex_string() {
    int start_line = line_;
    std::string out;
    pos_ = decode_string_literal(src_, pos_, out, line_);
    tokens_.push_back(Token{TokenKind::kString, std::move(out), start_line});
  }

  void lex_operator(std::vector<char>& brackets) {
    static const char* kOperators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                       "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                       "=",  ">",  "<",  ".",  ":",  "|",  ",", ";"};
    for (const char* op : kOperators) {
      size_t n = std::char_traits<char>::length(op);
      if (src_.compare(pos_, n, op) != 0) continue;
      char c = op[0];
      if (n == 1 && (c == '(' || c == '[' || c == '{')) {
        brackets.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
      } else if (n == 1 && (c == ')' || c == ']' || c == '}')) {
        if (brackets.empty() || brackets.back() != c)
          throw RenderError(std::string("unexpected '") + c + "'", line_);
        brackets.pop_back();
      }
      push(TokenKind::kOperator, op);
      pos_ += n;
      return;
    }
    throw RenderError(std::string("unexpected char '") + src_[pos_] + "'", line_);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(std::string_view source) {
  // jinja2 normalises \r\n and \r to \n and drops one trailing newline (keep_trailing_newline is
  // off).
  std::string normalized;
  normalized.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      normalized.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      normalized.push_back(source[i]);
    }
  }
  if (!normalized.empty() && normalized.back() == '\n') normalized.pop_back();
  return Lexer(std::move(normalized)).run();
}

}  // namespace moeline::tokenizer::jinja
