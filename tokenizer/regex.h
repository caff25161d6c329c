#pragma once
// A compiled Unicode-aware regular expression (PCRE2 with JIT) that iterates matches the way the
// reference tokenizer library does (Oniguruma / Rust regex semantics: leftmost-first,
// non-overlapping, an empty match right after the previous match is skipped).

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace moeline::tokenizer::text {

struct MatchSpan {
  std::size_t begin;
  std::size_t end;
};

class Regex {
 public:
  // Throws StatusError naming the pattern and PCRE2's message when it does not compile.
  explicit Regex(std::string_view pattern);

  // Appends every match in `text` (valid UTF-8) to `out`.
  void find_all(std::string_view text, std::vector<MatchSpan>& out) const;
  // Whether the pattern matches anywhere in `text`.
  bool search(std::string_view text) const;

  const std::string& pattern() const { return pattern_; }

 private:
  struct Code;
  std::string pattern_;
  std::shared_ptr<Code> code_;
};

}  // namespace moeline::tokenizer::text
