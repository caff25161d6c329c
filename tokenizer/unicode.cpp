#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "base/status.h"
#include "tokenizer/jinja/utf8.h"

namespace moeline::tokenizer::text {

char32_t last_code_point(std::string_view s) {
  std::size_t i = s.size();
  while (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i;
  if (i > 0) --i;
  return next_code_point(s, i);
}

void append_utf8(std::string& out, char32_t cp) {
  utf8::append(out, cp);
}

namespace {

// Length of the valid sequence at p (1..4), or 0 when invalid; `valid_prefix` receives how many
// bytes form the longest prefix of some valid sequence (Unicode's "maximal subpart"), at least 1.
std::size_t valid_sequence(const unsigned char* p, std::size_t avail, std::size_t& valid_prefix) {
  valid_prefix = 1;
  const unsigned char b0 = p[0];
  if (b0 < 0x80) return 1;
  std::size_t need;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (std::size_t k = 1; k < need; ++k) {
    if (k >= avail) return 0;
    const unsigned char b = p[k];
    const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return 0;
    valid_prefix = k + 1;
  }
  return need;
}

}  // namespace

std::size_t find_invalid_utf8(std::string_view bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t i = 0;
  const std::size_t n = bytes.size();
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    std::size_t prefix;
    const std::size_t len = valid_sequence(p + i, n - i, prefix);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string from_utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t i = 0;
  const std::size_t n = bytes.size();
  while (i < n) {
    if (p[i] < 0x80) {
      out.push_back(static_cast<char>(p[i++]));
      continue;
    }
    std::size_t prefix;
    const std::size_t len = valid_sequence(p + i, n - i, prefix);
    if (len == 0) {
      out += "\xEF\xBF\xBD";
      i += prefix;
    } else {
      out.append(bytes.substr(i, len));
      i += len;
    }
  }
  return out;
}

bool is_white_space(char32_t cp) {
  switch (cp) {
    case 0x09:
    case 0x0A:
    case 0x0B:
    case 0x0C:
    case 0x0D:
    case 0x20:
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

std::size_t leading_white_space(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    std::size_t next = i;
    if (!is_white_space(next_code_point(s, next))) break;
    i = next;
  }
  return i;
}

std::size_t trailing_white_space_start(std::string_view s) {
  std::size_t end = s.size();
  while (end > 0) {
    std::size_t back = end - 1;
    while (back > 0 && (static_cast<unsigned char>(s[back]) & 0xC0) == 0x80) --back;
    std::size_t i = back;
    if (!is_white_space(next_code_point(s, i))) break;
    end = back;
  }
  return end;
}

namespace {
utf8proc_category_t category(char32_t cp) {
  return static_cast<utf8proc_category_t>(utf8proc_category(static_cast<utf8proc_int32_t>(cp)));
}
}  // namespace

bool is_word_char(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') || (cp >= '0' && cp <= '9') ||
           cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (category(cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

bool is_combining_mark(char32_t cp) {
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_MN || c == UTF8PROC_CATEGORY_MC || c == UTF8PROC_CATEGORY_ME;
}

bool is_numeric(char32_t cp) {
  const auto c = category(cp);
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

bool is_punctuation(char32_t cp) {
  if (cp < 0x80) {
    return (cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) ||
           (cp >= 123 && cp <= 126);
  }
  switch (category(cp)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO:
      return true;
    default:
      return false;
  }
}

std::string normalize(std::string_view s, NormalForm form) {
  // Fast paths: ASCII is invariant under every form, and nothing below U+0300 changes under NFC.
  const char32_t stable_below = form == NormalForm::kNFC ? 0x300 : 0x80;
  bool invariant = true;
  for (std::size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    if (next_code_point(s, i) >= stable_below) {
      invariant = false;
      break;
    }
  }
  if (invariant) return std::string(s);

  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    throw StatusError(std::string("unicode normalisation failed: ") +
                      utf8proc_errmsg(static_cast<utf8proc_ssize_t>(n)));
  }
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
  return std::string(reinterpret_cast<const char*>(out), static_cast<std::size_t>(n));
}

std::string to_lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    const char32_t cp = next_code_point(s, i);
    if (cp == 0x130) {  // the one unconditional multi-character lower-case mapping
      out += "i\xCC\x87";
      continue;
    }
    append_utf8(out, static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(cp))));
  }
  return out;
}

namespace {
struct ByteLevelTables {
  std::array<std::string, 256> chars;
  std::array<int, 512> bytes{};  // every mapped code point is below 0x144
  ByteLevelTables() {
    bytes.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const char32_t cp =
          printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      append_utf8(chars[b], cp);
      bytes[cp] = b;
    }
  }
};
const ByteLevelTables& byte_level_tables() {
  static const ByteLevelTables tables;
  return tables;
}
}  // namespace

const std::array<std::string, 256>& byte_level_chars() {
  return byte_level_tables().chars;
}

int byte_level_byte(char32_t cp) {
  return cp < 512 ? byte_level_tables().bytes[cp] : -1;
}

}  // namespace moeline::tokenizer::text
