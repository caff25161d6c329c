// config.json parsing: hyper-parameters resolved as the Hugging Face implementations do, and clear
// errors naming the key for what moeline cannot honour.
#include "model/config.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "base/status.h"
#include "model/safetensors.h"

namespace moeline::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

json mixtral() {
  return {{"model_type", "mixtral"}, {"vocab_size", 256},        {"hidden_size", 64},
          {"num_hidden_layers", 2},  {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"num_local_experts", 4},  {"num_experts_per_tok", 2}, {"intermediate_size", 96}};
}

json qwen3() {
  json c = mixtral();
  c["model_type"] = "qwen3_moe";
  c.erase("num_local_experts");
  c["num_experts"] = 8;
  c["moe_intermediate_size"] = 48;
  c["intermediate_size"] = 128;
  return c;
}

// DeepSeek-V2-Lite's config.json, shrunk: no q_lora_rank, greedy routing, YaRN with mscale.
json deepseek_v2_lite() {
  return {{"model_type", "deepseek_v2"},
          {"vocab_size", 256},
          {"hidden_size", 64},
          {"intermediate_size", 128},
          {"moe_intermediate_size", 16},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 4},
          {"q_lora_rank", nullptr},
          {"kv_lora_rank", 32},
          {"qk_nope_head_dim", 16},
          {"qk_rope_head_dim", 8},
          {"v_head_dim", 16},
          {"n_routed_experts", 8},
          {"n_shared_experts", 2},
          {"num_experts_per_tok", 2},
          {"topk_method", "greedy"},
          {"n_group", 1},
          {"topk_group", 1},
          {"first_k_dense_replace", 1},
          {"moe_layer_freq", 1},
          {"norm_topk_prob", false},
          {"routed_scaling_factor", 1.0},
          {"scoring_func", "softmax"},
          {"rope_theta", 10000},
          {"rope_scaling",
           {{"type", "yarn"},
            {"factor", 40},
            {"original_max_position_embeddings", 4096},
            {"beta_fast", 32},
            {"beta_slow", 1},
            {"mscale", 0.707},
            {"mscale_all_dim", 0.707}}}};
}

// Writes the files into a fresh folder, parses them, and removes the folder again.
ModelConfig load(const json& config, const json& generation = nullptr) {
  const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::temp_directory_path() /
                       ("moeline-config-" + std::to_string(::getpid()) + "-" + test->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump();
  if (!generation.is_null()) std::ofstream(dir / "generation_config.json") << generation.dump();
  struct Cleanup {
    fs::path dir;
    ~Cleanup() { fs::remove_all(dir); }
  } cleanup{dir};
  return ModelConfig::load(dir);
}

std::string error_of(const json& config) {
  try {
    load(config);
  } catch (const StatusError& e) {
    return e.what();
  }
  return "";
}

TEST(Config, FamilyDefaultsFollowTheReferenceImplementations) {
  const ModelConfig m = load(mixtral());
  EXPECT_EQ(m.family, Family::kMixtral);
  EXPECT_EQ(m.head_dim, 16);  // hidden / heads when head_dim is absent
  EXPECT_DOUBLE_EQ(m.rope_theta, 1e6);
  EXPECT_FLOAT_EQ(m.rms_norm_eps, 1e-5f);
  EXPECT_TRUE(m.norm_topk_prob);  // Mixtral always renormalises
  EXPECT_FALSE(m.qk_norm);
  EXPECT_EQ(m.sliding_window, 0);

  const ModelConfig q = load(qwen3());
  EXPECT_EQ(q.family, Family::kQwen3Moe);
  EXPECT_TRUE(q.qk_norm);
  EXPECT_FALSE(q.norm_topk_prob);  // Qwen3MoeConfig's default
  EXPECT_DOUBLE_EQ(q.rope_theta, 10000.0);
  EXPECT_FLOAT_EQ(q.rms_norm_eps, 1e-6f);
}

TEST(Config, ExplicitValuesWin) {
  json c = qwen3();
  c["head_dim"] = 32;
  c["norm_topk_prob"] = true;
  c["tie_word_embeddings"] = true;
  c["rope_theta"] = 5e5;
  c["sliding_window"] = 7;  // ignored: use_sliding_window is false
  const ModelConfig q = load(c);
  EXPECT_EQ(q.head_dim, 32);
  EXPECT_TRUE(q.norm_topk_prob);
  EXPECT_TRUE(q.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(q.rope_theta, 5e5);
  EXPECT_EQ(q.sliding_window, 0);
  c["use_sliding_window"] = true;
  EXPECT_EQ(load(c).sliding_window, 7);

  json m = mixtral();
  m["sliding_window"] = 9;
  EXPECT_EQ(load(m).sliding_window, 9);
  m["sliding_window"] = nullptr;
  EXPECT_EQ(load(m).sliding_window, 0);
}

TEST(Config, RopeParametersOfTransformers5) {
  json c = qwen3();
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e6}};
  EXPECT_DOUBLE_EQ(load(c).rope_theta, 1e6);  // not Qwen3's default of 10000
  json m = mixtral();
  m["rope_parameters"] = {{"rope_theta", 5e5}};
  m["rope_theta"] = 1e6;  // rope_parameters is the newer, authoritative form
  EXPECT_DOUBLE_EQ(load(m).rope_theta, 5e5);
  m["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 5e5}, {"factor", 4}};
  EXPECT_NE(error_of(m).find("rope_parameters"), std::string::npos);
  m["rope_parameters"] = {{"rope_theta", 5e5}, {"partial_rotary_factor", 0.5}};
  EXPECT_NE(error_of(m).find("partial_rotary_factor"), std::string::npos);
}

TEST(Config, DenseLayersOfQwen3) {
  json c = qwen3();
  c["num_hidden_layers"] = 4;
  c["decoder_sparse_step"] = 2;
  c["mlp_only_layers"] = {3};
  // Sparse iff not listed and (layer + 1) % step == 0: only layer 1.
  EXPECT_EQ(load(c).layer_is_moe, (std::vector<bool>{false, true, false, false}));
}

// Qwen1.5-MoE-A2.7B's config.json, shrunk: no head_dim, no qkv_bias (transformers' default: biases
// on q, k and v), one shared expert.
json qwen2() {
  json c = qwen3();
  c["model_type"] = "qwen2_moe";
  c["shared_expert_intermediate_size"] = 96;
  c["use_sliding_window"] = false;
  c["sliding_window"] = 32;
  c["max_window_layers"] = 1;
  return c;
}

TEST(Config, Qwen2MoeResolvesLikeTransformers) {
  const ModelConfig q = load(qwen2());
  EXPECT_EQ(q.family, Family::kQwen2Moe);
  EXPECT_EQ(q.head_dim, 16);
  EXPECT_TRUE(q.attention_bias);  // qkv_bias defaults to true
  EXPECT_FALSE(q.qk_norm);
  EXPECT_FALSE(q.norm_topk_prob);  // Qwen2MoeConfig's default
  EXPECT_EQ(q.shared_intermediate_size, 96);
  EXPECT_TRUE(q.shared_expert_gate);
  EXPECT_EQ(q.sliding_window, 0);  // use_sliding_window false: no layer slides
  EXPECT_DOUBLE_EQ(q.rope_theta, 10000.0);

  json c = qwen2();
  c["qkv_bias"] = false;
  EXPECT_FALSE(load(c).attention_bias);
  c["use_sliding_window"] = true;
  c["max_window_layers"] = 0;  // every layer slides
  EXPECT_EQ(load(c).sliding_window, 32);
  c["max_window_layers"] = 2;  // no layer slides (layers 2 and on, of 2)
  EXPECT_EQ(load(c).sliding_window, 0);
  c["layer_types"] =
      json::array({"sliding_attention", "sliding_attention"});  // what transformers 4.53+ writes
  EXPECT_EQ(load(c).sliding_window, 32);
}

TEST(Config, Qwen2MoeSettingsItCannotHonourAreNamed) {
  json c = qwen2();
  c["use_sliding_window"] = true;  // layer 1 slides, layer 0 does not
  EXPECT_NE(error_of(c).find("max_window_layers"), std::string::npos) << error_of(c);
  c = qwen2();
  c.erase("shared_expert_intermediate_size");
  EXPECT_NE(error_of(c).find("shared_expert_intermediate_size"), std::string::npos) << error_of(c);
  c["shared_expert_intermediate_size"] = 0;
  EXPECT_NE(error_of(c).find("shared_expert_intermediate_size"), std::string::npos) << error_of(c);
}

TEST(Config, OlmoeResolvesLikeTransformers) {
  json c = qwen3();
  c["model_type"] = "olmoe";
  c["intermediate_size"] = 32;  // each expert's width: OLMoE has no moe_intermediate_size
  c["clip_qkv"] = nullptr;
  const ModelConfig o = load(c);
  EXPECT_EQ(o.family, Family::kOlmoe);
  EXPECT_TRUE(o.qk_norm && o.qk_norm_whole);
  EXPECT_EQ(o.clip_qkv, 0.0f);
  EXPECT_EQ(o.expert_intermediate_size, 32);
  EXPECT_FALSE(o.norm_topk_prob);
  EXPECT_FLOAT_EQ(o.rms_norm_eps, 1e-5f);  // OlmoeConfig's default
  EXPECT_EQ(o.layer_is_moe, (std::vector<bool>{true, true}));
  c["clip_qkv"] = 8;
  EXPECT_EQ(load(c).clip_qkv, 8.0f);
  c["clip_qkv"] = -1;
  EXPECT_NE(error_of(c).find("clip_qkv"), std::string::npos) << error_of(c);
}

// GLM-4.5-Air's config.json, shrunk (the keys it sets; Glm4MoeConfig's defaults for the rest).
json glm4() {
  return {
      {"model_type", "glm4_moe"}, {"vocab_size", 256},           {"hidden_size", 64},
      {"intermediate_size", 128}, {"moe_intermediate_size", 16}, {"num_hidden_layers", 3},
      {"num_attention_heads", 4}, {"num_key_value_heads", 2},    {"head_dim", 32},
      {"n_routed_experts", 8},    {"num_experts_per_tok", 2},    {"num_nextn_predict_layers", 1}};
}

TEST(Config, Glm4MoeResolvesLikeTransformers) {
  const ModelConfig g = load(glm4());
  EXPECT_EQ(g.family, Family::kGlm4Moe);
  EXPECT_EQ(g.rotary_dim, 16);  // partial_rotary_factor 0.5 by default
  EXPECT_EQ(make_rope(g).dim(), 16);
  EXPECT_FALSE(make_rope(g).interleaved());
  EXPECT_FALSE(g.attention_bias);
  EXPECT_FALSE(g.qk_norm);
  EXPECT_FLOAT_EQ(g.rms_norm_eps, 1e-5f);
  EXPECT_DOUBLE_EQ(g.softmax_scale, 1.0 / std::sqrt(32.0));  // head_dim, rotated or not
  // DeepSeek-V3's routing with Glm4MoeConfig's defaults.
  EXPECT_EQ(g.router_scoring, RouterScoring::kSigmoid);
  EXPECT_EQ(g.group_limit, GroupLimit::kGroupTopTwo);
  EXPECT_TRUE(g.router_correction_bias);
  EXPECT_EQ(g.n_group, 1);
  EXPECT_EQ(g.topk_group, 1);
  EXPECT_TRUE(g.norm_topk_prob);
  EXPECT_TRUE(g.scale_normalised_weights);
  EXPECT_DOUBLE_EQ(g.routed_scaling_factor, 1.0);
  EXPECT_EQ(g.shared_intermediate_size, 16);                          // one shared expert
  EXPECT_EQ(g.layer_is_moe, (std::vector<bool>{false, true, true}));  // first_k_dense_replace 1
  EXPECT_EQ(g.num_layers, 3);  // the multi-token-prediction layer is not run

  json c = glm4();
  c["partial_rotary_factor"] = 1.0;
  EXPECT_EQ(load(c).rotary_dim, 0);  // whole heads
  EXPECT_EQ(make_rope(load(c)).dim(), 32);
  c["partial_rotary_factor"] = 0.25;
  EXPECT_EQ(load(c).rotary_dim, 8);
  c.erase("partial_rotary_factor");
  c["rope_parameters"] = {
      {"rope_type", "default"}, {"rope_theta", 1e6}, {"partial_rotary_factor", 0.25}};
  EXPECT_EQ(load(c).rotary_dim, 8);  // transformers 5 keeps it among the RoPE settings
  EXPECT_DOUBLE_EQ(load(c).rope_theta, 1e6);
  c = glm4();
  c["num_experts_per_tok"] = 1;  // GLM renormalises a single expert too (DeepSeek does not)
  EXPECT_TRUE(load(c).norm_topk_prob);
  c["attention_bias"] = true;
  c["use_qk_norm"] = true;
  c["routed_scaling_factor"] = 2.5;
  c["n_group"] = 4;
  c["topk_group"] = 2;
  const ModelConfig big = load(c);
  EXPECT_TRUE(big.attention_bias && big.qk_norm);
  EXPECT_DOUBLE_EQ(big.routed_scaling_factor, 2.5);
  EXPECT_EQ(big.n_group, 4);
}

TEST(Config, Glm4MoeSettingsItCannotHonourAreNamed) {
  json c = glm4();
  for (const double factor : {0.03, 0.3, 1.5, -0.5}) {  // 0.96, 9.6 dims, beyond the head
    c["partial_rotary_factor"] = factor;
    EXPECT_NE(error_of(c).find("partial_rotary_factor"), std::string::npos) << factor;
  }
  c = glm4();
  c["n_routed_experts"] = 1;  // a group's score is the sum of its best two experts
  c["num_experts_per_tok"] = 1;
  EXPECT_NE(error_of(c).find("n_group"), std::string::npos) << error_of(c);
  c = glm4();
  c["n_group"] = 3;  // does not divide 8 experts
  EXPECT_NE(error_of(c).find("n_group"), std::string::npos) << error_of(c);
  c = glm4();
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(error_of(c).find("rope_scaling"), std::string::npos) << error_of(c);
  // Families that rotate whole heads refuse a partial rotation rather than ignore it.
  c = qwen3();
  c["partial_rotary_factor"] = 0.5;
  EXPECT_NE(error_of(c).find("partial_rotary_factor"), std::string::npos) << error_of(c);
}

TEST(Config, StopTokensPreferGenerationConfig) {
  json c = mixtral();
  c["eos_token_id"] = 2;
  EXPECT_EQ(load(c).eos_token_ids, (std::vector<int64_t>{2}));
  EXPECT_EQ(load(c, {{"eos_token_id", {7, 9}}}).eos_token_ids, (std::vector<int64_t>{7, 9}));
}

TEST(Config, UnsupportedSettingsAreNamed) {
  json c = mixtral();
  c["hidden_act"] = "gelu";
  EXPECT_NE(error_of(c).find("hidden_act"), std::string::npos);
  c = mixtral();
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(error_of(c).find("rope_scaling"), std::string::npos);
  c["rope_scaling"] = {{"rope_type", "default"}};
  EXPECT_EQ(error_of(c), "");
  c = mixtral();
  c.erase("num_local_experts");
  EXPECT_NE(error_of(c).find("num_local_experts"), std::string::npos);
  c = mixtral();
  c["num_attention_heads"] = 3;  // not a multiple of the 2 KV heads
  c["head_dim"] = 16;
  EXPECT_NE(error_of(c).find("num_key_value_heads"), std::string::npos);
  c = mixtral();
  c["num_experts_per_tok"] = 5;
  EXPECT_NE(error_of(c).find("num_experts_per_tok"), std::string::npos);
  c = mixtral();
  c["vocab_size"] = "many";
  EXPECT_NE(error_of(c).find("vocab_size"), std::string::npos);
  c = mixtral();
  c["model_type"] = "llama";
  EXPECT_NE(error_of(c).find("\"llama\" is not supported"), std::string::npos);
}

}  // namespace
}  // namespace moeline::model

namespace moeline::model {
namespace {

TEST(Config, DeepseekV2LiteResolvesLikeTheHubCode) {
  const ModelConfig c = load(deepseek_v2_lite());
  EXPECT_EQ(c.family, Family::kDeepseekV2);
  EXPECT_TRUE(c.mla);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.head_dim, 24);  // qk_nope + qk_rope
  EXPECT_EQ(c.shared_intermediate_size, 32);
  EXPECT_EQ(c.router_scoring, RouterScoring::kSoftmax);
  EXPECT_EQ(c.group_limit, GroupLimit::kNone);
  EXPECT_FALSE(c.router_correction_bias);
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, true, true, true}));
  // softmax_scale = qk_head_dim^-0.5 * mscale(40, 0.707)^2, mscale = 0.1 * 0.707 * ln 40 + 1.
  const double mscale = 0.1 * 0.707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale, mscale * mscale / std::sqrt(24.0), 1e-12);
  EXPECT_DOUBLE_EQ(c.rope_attention_factor, 1.0);  // mscale / mscale_all_dim
  EXPECT_TRUE(c.rope_interleaved);
  EXPECT_EQ(c.rope_original_max_positions, 4096);
  // The compressed cache: one row of latent + rope key per layer and token.
  const KvShape kv = kv_shape(c);
  EXPECT_EQ(kv.kv_heads, 1);
  EXPECT_EQ(kv.key_dim, 40);
  EXPECT_EQ(kv.value_dim, 0);
}

TEST(Config, DeepseekV3GateAndDefaults) {
  json j = deepseek_v2_lite();
  j["model_type"] = "deepseek_v3";
  for (const char* key :
       {"topk_method", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
        "scoring_func", "n_shared_experts", "first_k_dense_replace", "rope_scaling"})
    j.erase(key);
  j["n_routed_experts"] = 16;
  const ModelConfig c = load(j);  // the hub's DeepseekV3Config defaults
  EXPECT_EQ(c.router_scoring, RouterScoring::kSigmoid);
  EXPECT_EQ(c.group_limit, GroupLimit::kGroupTopTwo);
  EXPECT_TRUE(c.router_correction_bias);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_TRUE(c.scale_normalised_weights);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_EQ(c.shared_intermediate_size, 16);
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, false, false, true}));
  EXPECT_NEAR(c.softmax_scale, 1.0 / std::sqrt(24.0), 1e-12);
  // One expert per token: nothing to renormalise (the hub gate's top_k > 1 condition).
  j["num_experts_per_tok"] = 1;
  EXPECT_FALSE(load(j).norm_topk_prob);
  // The V2 spelling "gready" is plain top-k; mscale alone scales cos/sin.
  json v2 = deepseek_v2_lite();
  v2["topk_method"] = "gready";
  v2["rope_scaling"]["mscale_all_dim"] = nullptr;
  const ModelConfig gready = load(v2);
  EXPECT_EQ(gready.group_limit, GroupLimit::kNone);
  EXPECT_NEAR(gready.rope_attention_factor, 0.1 * 0.707 * std::log(40.0) + 1.0, 1e-12);
  EXPECT_NEAR(gready.softmax_scale, 1.0 / std::sqrt(24.0), 1e-12);
}

TEST(Config, DeepseekSettingsItCannotHonourAreNamed) {
  auto with = [](const char* key, json value) {
    json j = deepseek_v2_lite();
    j[key] = std::move(value);
    return error_of(j);
  };
  EXPECT_NE(with("topk_method", "random").find("topk_method"), std::string::npos);
  EXPECT_NE(with("scoring_func", "relu").find("scoring_func"), std::string::npos);
  EXPECT_NE(with("n_group", 3).find("n_group"), std::string::npos);  // 8 experts
  EXPECT_NE(with("attention_bias", true).find("attention_bias"), std::string::npos);
  EXPECT_NE(with("qk_rope_head_dim", 7).find("qk_rope_head_dim"), std::string::npos);
  EXPECT_NE(with("rope_scaling", json{{"type", "linear"}, {"factor", 2}}).find("rope_scaling"),
            std::string::npos);
  json missing = deepseek_v2_lite();
  missing.erase("kv_lora_rank");
  EXPECT_NE(error_of(missing).find("kv_lora_rank"), std::string::npos);
  json grouped = deepseek_v2_lite();
  grouped["topk_method"] = "group_limited_greedy";
  grouped["n_group"] = 4;
  grouped["topk_group"] = 1;
  grouped["num_experts_per_tok"] = 3;  // only 2 experts in the one group kept
  EXPECT_NE(error_of(grouped).find("num_experts_per_tok"), std::string::npos);
}

// Opening a checkpoint maps it into a 2 MiB-aligned reservation; what is left of the reservation
// past the file must go back even when the file's size is not a multiple of the page size, or
// every load (and every refused file) leaks address space until mmap fails.
// The process's address space (VmSize), in KiB: leaked reservations merge into neighbouring
// mappings, so their count says nothing; their size does.
size_t address_space_kib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmSize:", 0) == 0) return std::stoul(line.substr(7));
  return 0;
}

TEST(Checkpoint, OpeningAndRefusingFilesLeavesNoMappingsBehind) {
  const fs::path dir = fs::temp_directory_path() / ("moeline-maps-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string header = R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})";
  std::string file(8, '\0');
  file[0] = static_cast<char>(header.size());
  file += header + std::string(12, '\0');  // 8 + 57 + 12 bytes: not a whole page
  std::ofstream(dir / "model.safetensors", std::ios::binary) << file;
  { Checkpoint warm = Checkpoint::open(dir); }
  const size_t before = address_space_kib();
  for (int i = 0; i < 200; ++i) {
    Checkpoint checkpoint = Checkpoint::open(dir);
    ASSERT_NE(checkpoint.find("w"), nullptr);
  }
  std::ofstream(dir / "model.safetensors", std::ios::binary) << file.substr(0, 70);  // truncated
  for (int i = 0; i < 200; ++i) EXPECT_THROW(Checkpoint::open(dir), StatusError);
  // 400 opens leaking up to 2 MiB each would add hundreds of MiB; allow allocator noise.
  EXPECT_LE(address_space_kib(), before + 32 * 1024);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moeline::model
