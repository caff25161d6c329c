#pragma once
// Python str semantics over UTF-8: strings index, slice and count by code point, and whitespace,
// case and splitting follow CPython's rules. Bytes that are not valid UTF-8 (a template file may
// hold some) decode to U+DC80..U+DCFF and encode back unchanged, like Python's surrogateescape.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moeline::tokenizer::jinja::text {

std::u32string decode(std::string_view s);
std::string encode(std::u32string_view s);
int64_t length(std::string_view s);

bool is_space(char32_t c);  // str.isspace()
std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                  bool right);
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep,
                               int64_t maxsplit, bool from_right);
std::vector<std::string> splitlines(std::string_view s);
std::string replace(std::string_view s, std::string_view old, std::string_view with, int64_t count);
int64_t count(std::string_view s, std::string_view sub);

std::string upper(std::string_view s);
std::string lower(std::string_view s);
std::string capitalize(std::string_view s);    // str.capitalize()
std::string title(std::string_view s);         // str.title()
std::string title_filter(std::string_view s);  // jinja2's title filter (its own word split)
std::string center(std::string_view s, int64_t width);

// Python repr() of a str, quotes chosen as CPython does.
std::string repr(std::string_view s);

}  // namespace moeline::tokenizer::jinja::text
