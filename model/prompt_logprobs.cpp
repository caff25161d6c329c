#include "model/prompt_logprobs.h"

#include <algorithm>
#include <string>

namespace moeline::model {

Status score_prompt(ForwardPass& forward, Sequence& sequence, std::span<const int32_t> tokens,
                    int64_t top, PromptScore& out) {
  out.logprobs.clear();
  out.last_logits.clear();
  if (tokens.empty()) return Error{"the prompt is empty"};
  if (sequence.length() != 0)
    return Error{"prompt log-probabilities need the whole prompt computed, but " +
                 std::to_string(sequence.length()) + " tokens were reused"};
  const int64_t vocab = forward.model().config().vocab_size;
  const int64_t chunk =
      std::clamp<int64_t>(kPromptScoreLogitBytes / (vocab * static_cast<int64_t>(sizeof(float))), 1,
                          kMaxPromptScoreChunk);
  out.logprobs.reserve(tokens.size() - 1);
  std::vector<float> logits;
  for (size_t begin = 0; begin < tokens.size(); begin += static_cast<size_t>(chunk)) {
    const size_t count = std::min(tokens.size() - begin, static_cast<size_t>(chunk));
    const SequenceInput input{&sequence, tokens.subspan(begin, count), true, true};
    if (Status status = forward.forward(std::span(&input, 1), logits); !status.ok()) return status;
    // Row i predicts the token at begin + i + 1.
    for (size_t i = 0; i < count; ++i) {
      const float* row = logits.data() + static_cast<int64_t>(i) * vocab;
      const size_t next = begin + i + 1;
      if (next < tokens.size()) {
        out.logprobs.push_back(token_logprobs(row, vocab, tokens[next], top));
      } else {
        out.last_logits.assign(row, row + vocab);
      }
    }
  }
  return Status::ok_status();
}

}  // namespace moeline::model
