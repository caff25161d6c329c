#pragma once
// Keys and records of exact reuse.
//
// Keys: a KV block is keyed by its hash chain (model::block_key: parent key, tokens, model id,
// cache namespace), so equal keys mean equal token prefixes of the same model and tenant. A
// prompt's key extends the chain over its last, partial block. A result's key is the prompt's key
// and every sampling parameter that decides the completion. Each kind of entry gets its own key
// space in the store.
//
// Records are what the store holds: a block's KV as the wire carries it (model::KvCache block
// layout), a prompt record (the first-token logits and the KV of the partial last block), a result
// record (the completion and its finish reason).

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "model/sampling.h"
#include "reuse/signature.h"

namespace moeline::reuse {

// Exact levels (prefix, full, result) and the approximate modes (response, blend).
enum ReuseLevel : uint32_t { kPrefix = 1, kFull = 2, kResult = 4, kResponse = 8, kBlend = 16 };
inline constexpr uint32_t kExactLevels = kPrefix | kFull | kResult;
inline constexpr uint32_t kApproximateLevels = kResponse | kBlend;
inline constexpr uint32_t kAllLevels = kExactLevels | kApproximateLevels;
const char* level_name(uint32_t level);
// "prefix,full,result,response,blend" <-> mask ("exact", "approximate", "all", "none" also
// parse); throws std::invalid_argument naming an unknown level.
uint32_t parse_levels(const std::string& text);
std::string levels_text(uint32_t mask);

// Keys of the prompt's full blocks, in order.
std::vector<uint64_t> block_chain(std::span<const int32_t> tokens, uint64_t model_id,
                                  uint64_t cache_namespace);
// The whole prompt's key: the chain extended over the partial last block (if any).
uint64_t prompt_key(std::span<const int32_t> tokens, const std::vector<uint64_t>& chain,
                    uint64_t model_id, uint64_t cache_namespace);

uint64_t block_entry(uint64_t block_key);
uint64_t prompt_entry(uint64_t prompt_key);
// Only for deterministic sampling (greedy, or a seed the client chose).
uint64_t result_entry(uint64_t prompt_key, const model::SamplingParams& sampling);

struct PromptRecord {
  std::vector<float> logits;
  std::string tail_kv;  // one KV block holding the partial last block's tokens; empty if none
};
std::string encode(const PromptRecord& record);
std::optional<PromptRecord> decode_prompt(const std::string& bytes, size_t vocab,
                                          size_t block_bytes);

struct ResultRecord {
  std::vector<int32_t> tokens;
  std::string finish_reason;
};
std::string encode(const ResultRecord& record);
std::optional<ResultRecord> decode_result(const std::string& bytes);

// A prompt's activation signature, stored for the approximate-reuse index (keyed by
// signature_entry(prompt key)): what the index needs to be rebuilt after a restart, and the
// donor's tokens (for the kind of difference and for aligning a blend).
struct SignatureRecord {
  std::string cache_namespace;
  std::vector<int32_t> tokens;
  std::vector<float> signature;
  // Per pooled layer, the experts chosen for any pooled token (the Jaccard metric's sets).
  std::vector<std::set<int32_t>> expert_sets;
  // The router sums of each full KV block the prefill computed (block index, sums): a later
  // lookup whose exact prefix covers those blocks imports them instead of recomputing them. The
  // probe keeps them in memory, not in its store.
  std::vector<std::pair<uint32_t, RouterSums>> block_sums;
};
uint64_t signature_entry(uint64_t prompt_key);
std::string encode(const SignatureRecord& record);
std::optional<SignatureRecord> decode_signature(const std::string& bytes);

// A shadow check's outcome, for the probe's decision rule (SnapshotPut kind 'Q', keyed by the
// donor's prompt key).
struct QualityRecord {
  int32_t cell = 0;
  bool correct = false;
  float kl = 0;  // KL(full || reused) of the first-token distributions, when measured
};
std::string encode(const QualityRecord& record);
std::optional<QualityRecord> decode_quality(const std::string& bytes);

}  // namespace moeline::reuse
