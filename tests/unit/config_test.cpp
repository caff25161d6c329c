// config.json parsing: hyper-parameters resolved as the Hugging Face implementations do, and clear
// errors naming the key for what moeline cannot honour.
#include "model/config.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/status.h"

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
  } catch (const ModelError& e) {
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
