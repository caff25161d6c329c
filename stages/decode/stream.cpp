#include "stages/decode/stream.h"

#include <algorithm>
#include <span>

#include "model/token_constraint.h"
#include "stages/common/common.h"

namespace moeline::stages::decode {

int64_t reserve_tokens(const Stream& stream, int64_t context) {
  // max_tokens is clamped before the sum: a request may ask for 2^63 - 1 tokens.
  return std::min<int64_t>(static_cast<int64_t>(stream.prompt.size()) +
                               std::min<int64_t>(stream.sampling.max_tokens, context),
                           context);
}

int32_t blocks_for(const Stream& stream, int64_t context) {
  return static_cast<int32_t>((reserve_tokens(stream, context) + model::kBlockTokens - 1) /
                              model::kBlockTokens);
}

std::variant<Stream, StreamRefusal> read_stream(wire::Message& message, const ComputeWorker& worker,
                                                int64_t context) {
  const auto* done = message.as<wire::PrefillDone>();
  const auto* layout = done->layout();
  const size_t prompt = done->tokens() ? done->tokens()->size() : 0;
  const size_t blocks = (prompt + model::kBlockTokens - 1) / model::kBlockTokens;
  std::string problem;
  if (auto bad = wire::check_bulk(done->frames(), message.bulk))
    problem = *bad;
  else if (!kv_layout_matches(layout, worker.model->config(), blocks))
    problem = "KV layout does not match this decode replica's cache";
  else if (message.bulk.size() != 1 ||
           message.bulk[0].size() != blocks * worker.forward->kv_block_bytes())
    problem = "KV frame has the wrong size";
  else if (prompt == 0 || static_cast<int64_t>(prompt) >= context)
    problem = "a prompt of " + std::to_string(prompt) + " tokens does not fit the context of " +
              std::to_string(context);
  else if (moeline::Status valid =
               from_wire(done->sampling()).validate(worker.model->config().vocab_size);
           !valid.ok())
    problem = valid.error().message;
  else if (done->first_token() < 0 || done->first_token() >= worker.model->config().vocab_size)
    problem = "first token " + std::to_string(done->first_token()) + " is outside the vocabulary";
  if (!problem.empty()) return StreamRefusal{wire::ErrorCode::MalformedMessage, problem};

  Stream stream;
  stream.request_id = done->request_id();
  stream.attempt = done->attempt();
  stream.prompt.assign(done->tokens()->begin(), done->tokens()->end());
  stream.next_token = done->first_token();
  stream.sampling = from_wire(done->sampling());
  stream.sequence = std::make_unique<model::Sequence>(
      stream.request_id, worker.model->model_id(),
      model::namespace_id(done->cache_namespace() ? done->cache_namespace()->str() : ""));
  stream.sampler = std::make_unique<model::Sampler>(stream.sampling);
  stream.sampler->set_prompt(stream.prompt);
  const model::ModelConfig& config = worker.model->config();
  const std::vector<int32_t> eos(config.eos_token_ids.begin(), config.eos_token_ids.end());
  if (moeline::Status constrained = model::constrain_sampler(
          *stream.sampler, stream.sampling, worker.model->dir(), config.vocab_size, eos);
      !constrained.ok())
    return StreamRefusal{wire::error_code_for(constrained.code()), constrained.error().message};
  // The first token was drawn by prefill from the same generator.
  stream.sampler->resume(std::span(&stream.next_token, 1));
  stream.joined = Clock::now();
  if (blocks_for(stream, context) > worker.forward->blocks().capacity())
    return StreamRefusal{wire::ErrorCode::Overloaded,
                         "sequence needs more KV blocks than this decode replica has"};
  stream.handoff = std::move(message);
  return stream;
}

}  // namespace moeline::stages::decode
