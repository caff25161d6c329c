#include "tokenizer/jinja/text.h"

#include <utf8proc.h>

#include "tokenizer/jinja/utf8.h"
#include "tokenizer/jinja/value.h"

#include <algorithm>

namespace moeline::tokenizer::jinja::text {
namespace {

constexpr char32_t kEscapeBase = 0xDC00;

// Bytes that were not UTF-8 travel as lone surrogates U+DC80..U+DCFF (Python's surrogateescape)
// and go back out as those bytes.
void append_utf8(std::string& out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF)
    out.push_back(static_cast<char>(c - kEscapeBase));
  else
    utf8::append(out, c);
}

bool contains_cp(const std::u32string& set, char32_t c) {
  return set.find(c) != std::u32string::npos;
}

bool is_cased(char32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

char32_t to_upper(char32_t c) {
  return static_cast<char32_t>(utf8proc_toupper(static_cast<utf8proc_int32_t>(c)));
}
char32_t to_lower(char32_t c) {
  return static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
}
char32_t to_title(char32_t c) {
  return static_cast<char32_t>(utf8proc_totitle(static_cast<utf8proc_int32_t>(c)));
}

}  // namespace

std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    auto b = static_cast<unsigned char>(s[i]);
    int n = b < 0x80 ? 1 : (b >> 5) == 6 ? 2 : (b >> 4) == 14 ? 3 : (b >> 3) == 30 ? 4 : 0;
    char32_t c = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
    bool ok = n > 0 && i + n <= s.size();
    for (int k = 1; ok && k < n; ++k) {
      auto cont = static_cast<unsigned char>(s[i + k]);
      ok = (cont & 0xC0) == 0x80;
      c = (c << 6) | (cont & 0x3F);
    }
    if (ok && n > 1) {
      // Overlong forms and surrogates are not UTF-8; escape them byte by byte.
      static constexpr char32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
      ok = c >= kMin[n] && c <= 0x10FFFF && !(c >= 0xD800 && c <= 0xDFFF);
    }
    if (!ok) {
      out.push_back(kEscapeBase + b);
      ++i;
      continue;
    }
    out.push_back(c);
    i += n;
  }
  return out;
}

std::string encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

int64_t length(std::string_view s) {
  bool ascii = std::all_of(s.begin(), s.end(), [](char c) { return (c & 0x80) == 0; });
  return ascii ? static_cast<int64_t>(s.size()) : static_cast<int64_t>(decode(s).size());
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                  bool right) {
  std::u32string u = decode(s);
  std::u32string set = chars ? decode(*chars) : std::u32string();
  auto strippable = [&](char32_t c) { return chars ? contains_cp(set, c) : is_space(c); };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strippable(u[b])) ++b;
  if (right)
    while (e > b && strippable(u[e - 1])) --e;
  return encode(std::u32string_view(u).substr(b, e - b));
}

std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep,
                               int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (maxsplit < 0) maxsplit = INT64_MAX;
  if (sep) {
    if (sep->empty()) fail("empty separator");
    std::string_view rest = s;
    int64_t splits = 0;
    while (splits < maxsplit) {
      size_t at = from_right ? rest.rfind(*sep) : rest.find(*sep);
      if (at == std::string_view::npos) break;
      if (from_right) {
        parts.emplace_back(rest.substr(at + sep->size()));
        rest = rest.substr(0, at);
      } else {
        parts.emplace_back(rest.substr(0, at));
        rest = rest.substr(at + sep->size());
      }
      ++splits;
    }
    parts.emplace_back(rest);
    if (from_right) std::reverse(parts.begin(), parts.end());
    return parts;
  }
  // Runs of whitespace separate; leading and trailing whitespace yield no empty parts.
  std::u32string u = decode(s);
  if (from_right) std::reverse(u.begin(), u.end());
  size_t i = 0;
  int64_t splits = 0;
  while (i < u.size()) {
    while (i < u.size() && is_space(u[i])) ++i;
    if (i == u.size()) break;
    if (splits == maxsplit) {
      size_t e = u.size();
      while (e > i && is_space(u[e - 1])) --e;
      parts.push_back(encode(u.substr(i, e - i)));
      break;
    }
    size_t j = i;
    while (j < u.size() && !is_space(u[j])) ++j;
    parts.push_back(encode(u.substr(i, j - i)));
    ++splits;
    i = j;
  }
  if (from_right) {
    for (auto& p : parts) {
      std::u32string r = decode(p);
      std::reverse(r.begin(), r.end());
      p = encode(r);
    }
    std::reverse(parts.begin(), parts.end());
  }
  return parts;
}

std::vector<std::string> splitlines(std::string_view s) {
  std::u32string u = decode(s);
  std::vector<std::string> lines;
  size_t start = 0, i = 0;
  auto is_break = [](char32_t c) {
    return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D ||
           c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
  };
  while (i < u.size()) {
    if (is_break(u[i])) {
      lines.push_back(encode(u.substr(start, i - start)));
      if (u[i] == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ++i;
      start = ++i;
    } else {
      ++i;
    }
  }
  if (start < u.size()) lines.push_back(encode(u.substr(start)));
  return lines;
}

std::string replace(std::string_view s, std::string_view old, std::string_view with,
                    int64_t count) {
  if (count < 0) count = INT64_MAX;
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement before every character and at the end.
    std::u32string u = decode(s);
    int64_t done = 0;
    for (char32_t c : u) {
      if (done < count) {
        out += with;
        ++done;
      }
      append_utf8(out, c);
    }
    if (done < count) out += with;
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (done < count) {
    size_t at = s.find(old, pos);
    if (at == std::string_view::npos) break;
    out.append(s.substr(pos, at - pos));
    out.append(with);
    pos = at + old.size();
    ++done;
  }
  out.append(s.substr(pos));
  return out;
}

int64_t count(std::string_view s, std::string_view sub) {
  if (sub.empty()) return length(s) + 1;
  int64_t n = 0;
  for (size_t at = s.find(sub); at != std::string_view::npos; at = s.find(sub, at + sub.size()))
    ++n;
  return n;
}

std::string upper(std::string_view s) {
  std::u32string u = decode(s);
  for (auto& c : u) c = to_upper(c);
  return encode(u);
}

std::string lower(std::string_view s) {
  std::u32string u = decode(s);
  for (auto& c : u) c = to_lower(c);
  return encode(u);
}

std::string capitalize(std::string_view s) {
  std::u32string u = decode(s);
  for (size_t i = 0; i < u.size(); ++i) u[i] = i == 0 ? to_title(u[i]) : to_lower(u[i]);
  return encode(u);
}

std::string title(std::string_view s) {
  std::u32string u = decode(s);
  bool previous_cased = false;
  for (auto& c : u) {
    bool cased = is_cased(c);
    c = previous_cased ? to_lower(c) : to_title(c);
    previous_cased = cased;
  }
  return encode(u);
}

std::string title_filter(std::string_view s) {
  // jinja2 splits on runs of [-\s({[<] and upper-cases the first character of every piece.
  std::u32string u = decode(s);
  auto separator = [](char32_t c) {
    return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_space(c);
  };
  bool word_start = true;
  for (auto& c : u) {
    if (separator(c)) {
      word_start = true;
      continue;
    }
    c = word_start ? to_upper(c) : to_lower(c);
    word_start = false;
  }
  return encode(u);
}

std::string center(std::string_view s, int64_t width) {
  int64_t len = length(s);
  if (width <= len) return std::string(s);
  int64_t margin = width - len;
  int64_t left = margin / 2 + (margin & width & 1);
  return std::string(left, ' ') + std::string(s) + std::string(margin - left, ' ');
}

std::string repr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F || (c >= 0x80 && c < 0xA0) || (c >= 0xDC80 && c <= 0xDCFF)) {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out.push_back(kHex[(c >> 4) & 0xF]);
      out.push_back(kHex[c & 0xF]);
    } else {
      append_utf8(out, c);
    }
  }
  out.push_back(quote);
  return out;
}

}  // namespace moeline::tokenizer::jinja::text
