#pragma once
// Markers in streamed text: how much of a text's end could still become a marker once more text
// arrives (held back by the streams that look for <tool_call> and </think>).

#include <algorithm>
#include <cstddef>
#include <string_view>

namespace moeline::stages::http {

// The length of the longest suffix of `text` that is a proper prefix of `marker`.
inline size_t partial_marker(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n)
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  return 0;
}

}  // namespace moeline::stages::http
