#include "model/generator.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <string_view>

#include "model/prompt_logprobs.h"
#include "model/token_constraint.h"

namespace moeline::model {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Returns the sequences' blocks to the pool however generation ends.
struct SequenceSet {
  BlockPool& pool;
  std::vector<std::unique_ptr<Sequence>> sequences;
  ~SequenceSet() {
    for (auto& sequence : sequences) sequence->release(pool);
  }
};

}  // namespace

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
  }
  return "?";
}

const char* finish_after(int32_t token, int64_t generated, int64_t prompt_tokens,
                         const SamplingParams& sampling, const std::vector<int32_t>& eos,
                         int64_t max_position) {
  // Up to min_tokens the sampler masks the end tokens (Sampler::hold_end_tokens), so none can be
  // drawn there unless every token was masked; the answer is not ended short then either.
  const bool may_end = generated > sampling.min_tokens;
  const auto& stops = sampling.stop_token_ids;
  if (may_end && std::find(stops.begin(), stops.end(), token) != stops.end()) return "stop";
  if (may_end && !sampling.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end())
    return "stop";
  // The next step would feed this token at position prompt + generated - 1.
  if (generated >= sampling.max_tokens ||
      (max_position > 0 && prompt_tokens + generated > max_position))
    return "length";
  return "";
}

Expected<std::vector<GenerationResult>> Generator::generate(
    const std::vector<GenerationRequest>& requests) {
  const ModelConfig& config = engine_.model().config();
  const int64_t vocab = config.vocab_size;
  for (const GenerationRequest& request : requests) {
    if (request.prompt.empty()) return Error{"the prompt is empty"};
    if (Status status = request.sampling.validate(vocab); !status.ok()) return status.error();
  }

  SequenceSet set{engine_.blocks(), {}};
  std::vector<Sampler> samplers;
  const std::vector<int32_t> eos(config.eos_token_ids.begin(), config.eos_token_ids.end());
  for (const GenerationRequest& request : requests) {
    set.sequences.push_back(std::make_unique<Sequence>(
        next_sequence_id_++, engine_.model().model_id(), namespace_id(request.cache_namespace)));
    samplers.emplace_back(request.sampling);
    samplers.back().set_prompt(request.prompt);
    if (Status constrained =
            constrain_sampler(samplers.back(), request.sampling, engine_.model().dir(), vocab, eos);
        !constrained.ok())
      return constrained.error();
  }

  std::vector<GenerationResult> results(requests.size());
  std::vector<SequenceInput> batch;
  std::vector<float> logits;
  auto start = std::chrono::steady_clock::now();
  // A request that scores its prompt runs alone, in chunks (model/prompt_logprobs.h); the others
  // are prefilled together, their logits rows in `logits` in request order.
  std::vector<PromptScore> scores(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (!requests[i].sampling.prompt_logprobs) {
      batch.push_back({set.sequences[i].get(), requests[i].prompt, true});
      continue;
    }
    if (Status status = score_prompt(engine_, *set.sequences[i], requests[i].prompt,
                                     requests[i].sampling.top_logprobs, scores[i]);
        !status.ok())
      return status.error();
    results[i].prompt_logprobs = std::move(scores[i].logprobs);
  }
  if (!batch.empty())
    if (Status status = engine_.forward(batch, logits); !status.ok()) return status.error();
  const double prefill_seconds = seconds_since(start);

  std::vector<size_t> active;
  std::vector<int32_t> next_tokens(requests.size());
  auto take = [&](size_t i, const float* row) {
    const int32_t token = samplers[i].sample(row, vocab);
    results[i].tokens.push_back(token);
    if (requests[i].sampling.logprobs)
      results[i].logprobs.push_back(
          token_logprobs(row, vocab, token, requests[i].sampling.top_logprobs));
    if (requests[i].keep_step_logits)
      results[i].step_logits.insert(results[i].step_logits.end(), row, row + vocab);
    next_tokens[i] = token;
    const std::string_view finish =
        finish_after(token, static_cast<int64_t>(results[i].tokens.size()),
                     static_cast<int64_t>(requests[i].prompt.size()), requests[i].sampling, eos,
                     config.max_position_embeddings);
    if (finish == "stop") results[i].finish_reason = FinishReason::kStop;
    return finish.empty();
  };
  for (size_t i = 0, batched = 0; i < requests.size(); ++i) {
    const float* row = requests[i].sampling.prompt_logprobs
                           ? scores[i].last_logits.data()
                           : logits.data() + static_cast<int64_t>(batched++) * vocab;
    results[i].prompt_logits.assign(row, row + vocab);
    results[i].prefill_seconds = prefill_seconds;
    if (take(i, row)) active.push_back(i);
  }

  start = std::chrono::steady_clock::now();
  while (!active.empty()) {
    batch.clear();
    for (size_t i : active)
      batch.push_back({set.sequences[i].get(), std::span(&next_tokens[i], 1), true});
    if (Status status = engine_.forward(batch, logits); !status.ok()) return status.error();
    std::vector<size_t> still_active;
    for (size_t slot = 0; slot < active.size(); ++slot) {
      const size_t i = active[slot];
      if (take(i, logits.data() + static_cast<int64_t>(slot) * vocab)) {
        still_active.push_back(i);
      } else {
        results[i].decode_seconds = seconds_since(start);
        set.sequences[i]->release(engine_.blocks());
      }
    }
    active.swap(still_active);
  }
  return results;
}

}  // namespace moeline::model
