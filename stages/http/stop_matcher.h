#pragma once
// OpenAI `stop` strings on a streamed completion: a stop string may arrive split over several
// text deltas, so the tail of the text that could still begin one is held back until the next
// delta decides; the stop string itself is returned only where asked (vLLM's
// include_stop_str_in_output). And which of vLLM's stop_token_ids ended an answer. With vLLM's
// min_tokens, a stop string counts only where it ends after the first min_tokens tokens' text (it
// may begin within it), as vLLM checks them.

#include <cstdint>
#include <string>
#include <vector>

namespace moeline::stages::http {

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
  std::vector<std::string> stops_;
  std::vector<int32_t> stop_tokens_;
  bool include_stop_ = false;
  int64_t min_tokens_ = 0;
  std::string pending_;
  size_t shielded_ = 0;  // leading bytes of pending_ (min_tokens' text) no stop string ends in
  std::string matched_;
  bool stopped_ = false;
};

}  // namespace moeline::stages::http
