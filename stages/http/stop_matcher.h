#pragma once
// OpenAI `stop` strings on a streamed completion: a stop string may arrive split over several
// text deltas, so the tail of the text that could still begin one is held back until the next
// delta decides; the stop string itself is returned only where asked (vLLM's
// include_stop_str_in_output). And which of vLLM's stop_token_ids ended an answer. With vLLM's
// min_tokens, a stop string counts only where it ends after the first min_tokens tokens' text (it
// may begin within it), as vLLM checks them.
//
// The text is cut where the first stop string to complete begins (of several completing at the
// same byte, the longest), whatever the deltas: each stop string is followed by its own
// Knuth-Morris-Pratt automaton, a byte at a time, so a delta costs its bytes times the number of
// stop strings, however long they are.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace moeline::stages::http {

// What a request may ask for: stop strings are matched on every byte of the answer.
inline constexpr size_t kMaxStopStrings = 64;
inline constexpr size_t kMaxStopStringBytes = 4096;

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops, std::vector<int32_t> stop_tokens = {},
                       bool include_stop = false, int64_t min_tokens = 0);

  // Takes the next delta, the text of the answer's tokens up to the `tokens`-th; returns the text
  // that is now certain to be output. After a stop string is found, stopped() is true and nothing
  // more is returned.
  std::string feed(const std::string& delta, int64_t tokens = INT64_MAX);
  // The text still held back, when the stream ends without a stop string.
  std::string flush();
  bool stopped() const { return stopped_; }
  // The stop string that ended the text (empty before one did): vLLM's and Anthropic's
  // stop_reason / stop_sequence.
  const std::string& matched() const { return matched_; }
  // Whether `token`, the last of an answer the pipeline stopped, is one of the stop tokens.
  bool stop_token(int32_t token) const;

 private:
  struct Stop {
    std::string text;
    std::vector<uint32_t> border;  // border[i]: the longest proper border of text[0..i]
    size_t state = 0;  // the longest proper prefix of text that the answer now ends with
  };
  void advance(Stop& stop, char byte) const;

  std::vector<Stop> stops_;
  std::vector<int32_t> stop_tokens_;
  bool include_stop_ = false;
  int64_t min_tokens_ = 0;
  std::string pending_;      // fed, not yet let out
  size_t pending_from_ = 0;  // the answer's byte offset of pending_[0]
  size_t fed_ = 0;           // the answer's bytes fed so far
  size_t shielded_ = 0;      // no stop string ends within the answer's first bytes (min_tokens')
  std::string matched_;
  bool stopped_ = false;
};

}  // namespace moeline::stages::http
