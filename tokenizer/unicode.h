#pragma once
// UTF-8 and Unicode helpers for the tokenizer. Normalisation forms, case mapping and general
// categories come from utf8proc; only the small, fixed sets that Rust's standard library hard-codes
// (White_Space, the GPT-2 byte alphabet) are spelled out here, because the reference library's
// behaviour is defined by them.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moeline::tokenizer::text {

// Length of the UTF-8 sequence that starts with `lead` (1 for anything that is not a lead byte).
inline std::size_t sequence_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

// Decodes the code point at s[i] of a string known to be valid UTF-8 and advances i past it.
inline char32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  if (p[0] < 0x80) {
    ++i;
    return p[0];
  }
  if (p[0] < 0xE0) {
    i += 2;
    return (char32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (p[0] < 0xF0) {
    i += 3;
    return (char32_t(p[0] & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  i += 4;
  return (char32_t(p[0] & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) |
         (char32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

// The code point that ends just before byte `end` of valid UTF-8.
char32_t last_code_point(std::string_view s);

void append_utf8(std::string& out, char32_t cp);

// Byte offset of the first byte that does not start or continue a valid UTF-8 sequence, or npos.
std::size_t find_invalid_utf8(std::string_view bytes);

// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
std::string from_utf8_lossy(std::string_view bytes);

// Unicode White_Space (what Rust's char::is_whitespace and regex \s test).
bool is_white_space(char32_t cp);
// Byte length of the run of White_Space that starts valid UTF-8 `s`.
std::size_t leading_white_space(std::string_view s);
// Byte offset where the run of White_Space that ends valid UTF-8 `s` begins (s.size() if none).
std::size_t trailing_white_space_start(std::string_view s);
// Rust regex's \w: alphabetic, marks, decimal digits, connector punctuation, joiners.
bool is_word_char(char32_t cp);
bool is_combining_mark(char32_t cp);
// char::is_numeric: general categories Nd, Nl, No.
bool is_numeric(char32_t cp);
// The BERT/`Punctuation` pre-tokenizer's test: ASCII punctuation or a P* category.
bool is_punctuation(char32_t cp);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
std::string normalize(std::string_view s, NormalForm form);
std::string to_lower(std::string_view s);

// GPT-2's reversible byte -> printable character map: byte b is spelled byte_level_char(b).
const std::array<std::string, 256>& byte_level_chars();
// The byte a byte-level character stands for, or -1 when the character is not in the alphabet.
int byte_level_byte(char32_t cp);

}  // namespace moeline::tokenizer::text
