#include "reuse/records.h"

#include <algorithm>

#include <xxhash.h>

#include <cstring>
#include <stdexcept>

#include "model/kv_cache.h"

namespace moeline::reuse {
namespace {

// Distinct key spaces for the three kinds of entry.
uint64_t tagged(uint64_t key, uint64_t tag) {
  const uint64_t parts[2] = {key, tag};
  return XXH3_64bits(parts, sizeof parts);
}

void append_u32(std::string& out, uint32_t value) {
  out.append(reinterpret_cast<const char*>(&value), 4);
}

uint32_t read_u32(const std::string& in, size_t offset) {
  uint32_t value;
  std::memcpy(&value, in.data() + offset, 4);
  return value;
}

}  // namespace

const char* level_name(uint32_t level) {
  switch (level) {
    case kPrefix:
      return "prefix";
    case kFull:
      return "full";
    case kResult:
      return "result";
    case kResponse:
      return "response";
    case kBlend:
      return "blend";
    default:
      return "none";
  }
}

uint32_t parse_levels(const std::string& text) {
  uint32_t mask = 0;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(start, comma - start);
    if (item == "prefix")
      mask |= kPrefix;
    else if (item == "full")
      mask |= kFull;
    else if (item == "result")
      mask |= kResult;
    else if (item == "response")
      mask |= kResponse;
    else if (item == "blend")
      mask |= kBlend;
    else if (item == "exact")
      mask |= kExactLevels;
    else if (item == "approximate")
      mask |= kApproximateLevels;
    else if (item == "all")
      mask |= kAllLevels;
    else if (item != "none" && !item.empty())
      throw std::invalid_argument(
          "unknown reuse level '" + item +
          "' (known: prefix, full, result, response, blend, exact, approximate, all, none)");
    start = comma + 1;
  }
  return mask;
}

std::string levels_text(uint32_t mask) {
  std::string out;
  for (uint32_t level : {kPrefix, kFull, kResult, kResponse, kBlend}) {
    if (!(mask & level)) continue;
    if (!out.empty()) out += ',';
    out += level_name(level);
  }
  return out.empty() ? "none" : out;
}

std::vector<uint64_t> block_chain(std::span<const int32_t> tokens, uint64_t model_id,
                                  uint64_t cache_namespace) {
  std::vector<uint64_t> chain;
  const size_t blocks = tokens.size() / model::kBlockTokens;
  chain.reserve(blocks);
  for (size_t b = 0; b < blocks; ++b)
    chain.push_back(model::block_key(chain.empty() ? 0 : chain.back(),
                                     tokens.subspan(b * model::kBlockTokens, model::kBlockTokens),
                                     model_id, cache_namespace));
  return chain;
}

uint64_t prompt_key(std::span<const int32_t> tokens, const std::vector<uint64_t>& chain,
                    uint64_t model_id, uint64_t cache_namespace) {
  const size_t covered = chain.size() * model::kBlockTokens;
  const uint64_t parent = chain.empty() ? 0 : chain.back();
  // The partial block is hashed with its length (an empty tail hashes differently from none).
  return model::block_key(
      parent, tokens.subspan(covered), model_id,
      cache_namespace ^ (0x9e3779b97f4a7c15ULL * (tokens.size() - covered + 1)));
}

uint64_t block_entry(uint64_t block_key) {
  return tagged(block_key, 'B');
}
uint64_t prompt_entry(uint64_t key) {
  return tagged(key, 'P');
}

uint64_t result_entry(uint64_t key, const model::SamplingParams& s) {
  // Greedy ignores the sampling knobs; a seeded draw depends on all of them.
  const bool greedy = s.temperature == 0.0;
  std::string material;
  material.append(reinterpret_cast<const char*>(&key), 8);
  const double temperature = greedy ? 0.0 : s.temperature;
  const int64_t top_k = greedy ? 0 : s.top_k;
  const double top_p = greedy ? 1.0 : s.top_p;
  const uint64_t seed = greedy ? 0 : s.seed.value_or(0);
  material.append(reinterpret_cast<const char*>(&temperature), 8);
  material.append(reinterpret_cast<const char*>(&top_k), 8);
  material.append(reinterpret_cast<const char*>(&top_p), 8);
  material.append(reinterpret_cast<const char*>(&seed), 8);
  material.append(reinterpret_cast<const char*>(&s.max_tokens), 8);
  material.push_back(s.ignore_eos ? 1 : 0);
  for (int32_t stop : s.stop_token_ids) material.append(reinterpret_cast<const char*>(&stop), 4);
  // Penalties change greedy tokens too; min-p only a draw. (Appended only where set, so that the
  // keys of results stored before these knobs existed stay the same.)
  if (s.penalized() || (!greedy && s.min_p > 0.0)) {
    material.push_back('p');
    const double knobs[] = {greedy ? 0.0 : s.min_p, s.presence_penalty, s.frequency_penalty,
                            s.repetition_penalty};
    material.append(reinterpret_cast<const char*>(knobs), sizeof(knobs));
  }
  // A logit bias changes greedy tokens too; its entries in token order, so that the same bias
  // given in another order finds the same result.
  if (!s.logit_bias.empty()) {
    std::vector<model::TokenBias> bias = s.logit_bias;
    std::sort(bias.begin(), bias.end(), [](const model::TokenBias& a, const model::TokenBias& b) {
      return a.token < b.token;
    });
    material.push_back('b');
    for (const model::TokenBias& entry : bias) {
      material.append(reinterpret_cast<const char*>(&entry.token), 4);
      material.append(reinterpret_cast<const char*>(&entry.bias), 4);
    }
  }
  // min_tokens masks the end tokens: an answer that would end earlier goes on differently.
  if (s.min_tokens > 0) {
    material.push_back('m');
    material.append(reinterpret_cast<const char*>(&s.min_tokens), 8);
  }
  // A grammar changes greedy tokens too.
  if (s.structured != model::StructuredOutput::kNone) {
    material.push_back('s');
    material.push_back(static_cast<char>(s.structured));
    material.push_back(static_cast<char>(s.reasoning));
    material += s.json_schema;
  }
  return tagged(XXH3_64bits(material.data(), material.size()), 'R');
}

std::string encode(const PromptRecord& record) {
  std::string out;
  append_u32(out, static_cast<uint32_t>(record.logits.size()));
  append_u32(out, static_cast<uint32_t>(record.tail_kv.size()));
  out.append(reinterpret_cast<const char*>(record.logits.data()), record.logits.size() * 4);
  out += record.tail_kv;
  return out;
}

std::optional<PromptRecord> decode_prompt(const std::string& bytes, size_t vocab,
                                          size_t block_bytes) {
  if (bytes.size() < 8) return std::nullopt;
  const uint32_t logits = read_u32(bytes, 0);
  const uint32_t tail = read_u32(bytes, 4);
  if (logits != vocab || (tail != 0 && tail != block_bytes) ||
      bytes.size() != 8 + static_cast<size_t>(logits) * 4 + tail)
    return std::nullopt;
  PromptRecord record;
  record.logits.resize(logits);
  if (logits > 0)  // memcpy from or to an empty vector's null data() is undefined
    std::memcpy(record.logits.data(), bytes.data() + 8, static_cast<size_t>(logits) * 4);
  record.tail_kv = bytes.substr(8 + static_cast<size_t>(logits) * 4);
  return record;
}

std::string encode(const ResultRecord& record) {
  std::string out;
  append_u32(out, static_cast<uint32_t>(record.tokens.size()));
  append_u32(out, static_cast<uint32_t>(record.finish_reason.size()));
  out.append(reinterpret_cast<const char*>(record.tokens.data()), record.tokens.size() * 4);
  out += record.finish_reason;
  return out;
}

std::optional<ResultRecord> decode_result(const std::string& bytes) {
  if (bytes.size() < 8) return std::nullopt;
  const uint32_t tokens = read_u32(bytes, 0);
  const uint32_t finish = read_u32(bytes, 4);
  if (bytes.size() != 8 + static_cast<size_t>(tokens) * 4 + finish) return std::nullopt;
  ResultRecord record;
  record.tokens.resize(tokens);
  if (tokens > 0)  // memcpy to an empty vector's null data() is undefined
    std::memcpy(record.tokens.data(), bytes.data() + 8, static_cast<size_t>(tokens) * 4);
  record.finish_reason = bytes.substr(8 + static_cast<size_t>(tokens) * 4);
  return record;
}

uint64_t signature_entry(uint64_t key) {
  return tagged(key, 'S');
}

namespace {
constexpr uint32_t kSignatureMagic = 0x4749534d;  // "MSIG"
}

// Layout: magic, token count, dimension, namespace length, set count (u32 each), the tokens, the
// signature, the namespace, then each expert set as a u32 size and its ids.
std::string encode(const SignatureRecord& record) {
  std::string out;
  append_u32(out, kSignatureMagic);
  append_u32(out, static_cast<uint32_t>(record.tokens.size()));
  append_u32(out, static_cast<uint32_t>(record.signature.size()));
  append_u32(out, static_cast<uint32_t>(record.cache_namespace.size()));
  append_u32(out, static_cast<uint32_t>(record.expert_sets.size()));
  out.append(reinterpret_cast<const char*>(record.tokens.data()), record.tokens.size() * 4);
  out.append(reinterpret_cast<const char*>(record.signature.data()), record.signature.size() * 4);
  out += record.cache_namespace;
  for (const std::set<int32_t>& set : record.expert_sets) {
    append_u32(out, static_cast<uint32_t>(set.size()));
    for (int32_t expert : set) append_u32(out, static_cast<uint32_t>(expert));
  }
  // Block sums: count, then per block its index, layer count, value count, the sums (f32), the
  // token counts, and its expert sets.
  append_u32(out, static_cast<uint32_t>(record.block_sums.size()));
  for (const auto& [block, sums] : record.block_sums) {
    append_u32(out, block);
    append_u32(out, static_cast<uint32_t>(sums.tokens.size()));
    append_u32(out, static_cast<uint32_t>(sums.sums.size()));
    for (double v : sums.sums) {
      const auto f = static_cast<float>(v);
      out.append(reinterpret_cast<const char*>(&f), 4);
    }
    for (int64_t n : sums.tokens) append_u32(out, static_cast<uint32_t>(n));
    for (size_t l = 0; l < sums.tokens.size(); ++l) {
      const std::set<int32_t> none;
      const std::set<int32_t>& set = l < sums.chosen.size() ? sums.chosen[l] : none;
      append_u32(out, static_cast<uint32_t>(set.size()));
      for (int32_t expert : set) append_u32(out, static_cast<uint32_t>(expert));
    }
  }
  return out;
}

std::optional<SignatureRecord> decode_signature(const std::string& bytes) {
  if (bytes.size() < 20 || read_u32(bytes, 0) != kSignatureMagic) return std::nullopt;
  const size_t tokens = read_u32(bytes, 4), dims = read_u32(bytes, 8), name = read_u32(bytes, 12),
               sets = read_u32(bytes, 16);
  size_t at = 20 + tokens * 4 + dims * 4 + name;
  if (bytes.size() < at || tokens > bytes.size() || dims > bytes.size() || sets > bytes.size())
    return std::nullopt;
  SignatureRecord record;
  record.tokens.resize(tokens);
  record.signature.resize(dims);
  if (tokens > 0) std::memcpy(record.tokens.data(), bytes.data() + 20, tokens * 4);
  if (dims > 0) std::memcpy(record.signature.data(), bytes.data() + 20 + tokens * 4, dims * 4);
  record.cache_namespace = bytes.substr(20 + tokens * 4 + dims * 4, name);
  record.expert_sets.resize(sets);
  // A u32 at `at` (advancing it), or false when the bytes end first.
  auto next = [&](size_t& value) {
    if (bytes.size() < at + 4) return false;
    value = read_u32(bytes, at);
    at += 4;
    return true;
  };
  auto read_set = [&](std::set<int32_t>& set) {
    size_t size = 0;
    if (!next(size) || size > (bytes.size() - at) / 4) return false;
    for (size_t i = 0; i < size; ++i, at += 4)
      set.insert(static_cast<int32_t>(read_u32(bytes, at)));
    return true;
  };
  for (std::set<int32_t>& set : record.expert_sets)
    if (!read_set(set)) return std::nullopt;
  size_t blocks = 0;
  if (!next(blocks) || blocks > bytes.size()) return std::nullopt;
  record.block_sums.resize(blocks);
  for (auto& [block, sums] : record.block_sums) {
    size_t index = 0, layers = 0, values = 0;
    if (!next(index) || !next(layers) || !next(values) || layers > bytes.size() ||
        values > (bytes.size() - at) / 4)
      return std::nullopt;
    block = static_cast<uint32_t>(index);
    sums.sums.resize(values);
    for (double& v : sums.sums) {
      float f;
      std::memcpy(&f, bytes.data() + at, 4);
      v = f;
      at += 4;
    }
    sums.tokens.resize(layers);
    for (int64_t& n : sums.tokens) {
      size_t count = 0;
      if (!next(count)) return std::nullopt;
      n = static_cast<int64_t>(count);
    }
    sums.chosen.resize(layers);
    for (std::set<int32_t>& set : sums.chosen)
      if (!read_set(set)) return std::nullopt;
  }
  if (at != bytes.size()) return std::nullopt;
  return record;
}

std::string encode(const QualityRecord& record) {
  std::string out;
  append_u32(out, static_cast<uint32_t>(record.cell));
  out.push_back(record.correct ? 1 : 0);
  out.append(reinterpret_cast<const char*>(&record.kl), 4);
  return out;
}

std::optional<QualityRecord> decode_quality(const std::string& bytes) {
  if (bytes.size() != 9 || static_cast<uint8_t>(bytes[4]) > 1) return std::nullopt;
  QualityRecord record;
  record.cell = static_cast<int32_t>(read_u32(bytes, 0));
  record.correct = bytes[4] == 1;
  std::memcpy(&record.kl, bytes.data() + 5, 4);
  return record;
}

}  // namespace moeline::reuse
