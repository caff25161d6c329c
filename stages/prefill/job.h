#pragma once
// A prefill job as this stage holds it: the prompt and its sampling, what it reuses (a cached
// prefix's KV, or a blend: a donor's KV where the mask says so), and where its KV and store
// entries go (the routes the gateway or the probe named).

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "model/sampling.h"
#include "schemas/vocabulary.h"
#include "schemas/wire.h"
#include "stages/runtime/intake.h"

namespace moeline::stages::prefill {

// Where a job's bulk data goes (from the job's PeerRoute): empty endpoint, no route.
struct Route {
  std::string replica;
  runtime::PeerAddress to;
  std::vector<uint8_t> ticket;
  static Route from(const wire::PeerRoute* route);
  bool empty() const { return to.empty(); }
};

struct Job {
  uint64_t request_id = 0;
  uint32_t attempt = 0;
  std::vector<int32_t> tokens;
  model::SamplingParams sampling;
  std::string cache_namespace;
  std::chrono::steady_clock::time_point received;
  // Prefix reuse: the first `reused` tokens' KV (whole blocks) came with the job.
  uint32_t reused = 0;
  wire::ReuseLevel reuse_level = wire::ReuseLevel::None;
  wire::AlignedFrame prefix_kv;
  uint32_t store_levels = 0;  // which entries to put back into the probe's store
  // Blended reuse: the prompt's blocks with a donor's KV where blend_mask is 1. A shadow job also
  // computes in full, serves that, and reports how the blend compared.
  bool blend = false, shadow = false;
  std::vector<uint8_t> blend_mask;
  float recompute_fraction = 0.15f;
  wire::AlignedFrame blend_kv;
  int64_t recomputed = 0;
  std::vector<float> blend_logits;  // a shadow job's blended first-token logits
  Route decode_route, store_route;  // empty decode route: the KV goes back in the PrefillDone
  int64_t computed() const { return static_cast<int64_t>(tokens.size()) - reused; }
};

}  // namespace moeline::stages::prefill
