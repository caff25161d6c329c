#pragma once
// A sequence decode holds: its prompt and sampling, its KV (in the hand-over until it joins the
// batch, then in the cache), the tokens so far. read_stream() checks a hand-over before anything
// of it is used: its KV frame against its layout and this replica's cache, the prompt against the
// context, the sampling, the first token against the vocabulary.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "model/kv_cache.h"
#include "model/sampling.h"
#include "schemas/wire.h"
#include "stages/common/worker.h"

namespace moeline::stages::decode {

using Clock = std::chrono::steady_clock;

struct Stream {
  uint64_t request_id = 0;
  uint32_t attempt = 0;
  std::vector<int32_t> prompt;
  int32_t next_token = 0;
  int64_t generated = 1;  // the first token came from prefill
  model::SamplingParams sampling;
  std::unique_ptr<model::Sequence> sequence;
  std::unique_ptr<model::Sampler> sampler;
  Clock::time_point joined, last_token;
  wire::Message handoff;  // kept until admitted (its bulk frame holds the KV)
};

// The tokens a stream may come to hold (its prompt and what it may generate, within the context)
// and the KV blocks they take.
int64_t reserve_tokens(const Stream& stream, int64_t context);
int32_t blocks_for(const Stream& stream, int64_t context);

struct StreamRefusal {
  wire::ErrorCode code;
  std::string text;
};

// A PrefillDone with the prompt's KV read into a Stream waiting to join the batch (the message
// moves into it), or why this replica cannot take it.
std::variant<Stream, StreamRefusal> read_stream(wire::Message& message, const ComputeWorker& worker,
                                                int64_t context);

}  // namespace moeline::stages::decode
