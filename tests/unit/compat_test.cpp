// Golden wire buffers (tests/compat/README.md): today's reader must still read the bytes of every
// released schema version. The expected values are hard-coded on purpose — they are the values
// tests/compat/make_golden.cpp wrote when the version was released, not whatever it writes now.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "schemas/vocabulary.h"
#include "schemas/wire.h"

namespace moeline::wire {
namespace {

namespace fs = std::filesystem;

const fs::path kCompatDir = MOELINE_COMPAT_DIR;

struct Expectation {
  MessageType type;
  uint16_t minor;
  std::function<void(const Message&)> check;
};

std::vector<int32_t> ints(const flatbuffers::Vector<int32_t>* v) {
  return v == nullptr ? std::vector<int32_t>{} : std::vector<int32_t>(v->begin(), v->end());
}

std::string str(const flatbuffers::String* s) {
  return s == nullptr ? "<absent>" : s->str();
}

void check_pipeline_sampling(const SamplingParams* s) {
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->temperature(), 1.0);
  EXPECT_EQ(s->top_k(), 50);
  EXPECT_EQ(s->top_p(), 0.95);
  EXPECT_EQ(s->seed(), 7u);
  EXPECT_TRUE(s->has_seed());
  EXPECT_EQ(s->max_tokens(), 32);
  EXPECT_EQ(ints(s->stop_token_ids()), (std::vector<int32_t>{2}));
  EXPECT_FALSE(s->ignore_eos());
}

// Schema 1.0, written by make_golden at the release of 1.0.
std::map<std::string, Expectation> v1_0() {
  std::map<std::string, Expectation> e;
  e["Hello"] = {MessageType::Hello, 0, [](const Message& m) {
                  const auto* t = m.as<Hello>();
                  EXPECT_EQ(t->stage(), StageKind::Prefill);
                  EXPECT_EQ(str(t->replica()), "prefill-0");
                  EXPECT_EQ(t->schema_major(), 1);
                  EXPECT_EQ(t->schema_minor(), 0);
                  EXPECT_EQ(str(t->build()), "golden-1.0");
                  EXPECT_EQ(t->settings_hash(), 0x0123456789abcdefULL);
                  EXPECT_EQ(t->credits(), 4u);
                  EXPECT_EQ(t->pid(), 4242u);
                  EXPECT_EQ(t->http_port(), 9102);
                }};
  e["HelloReply"] = {MessageType::HelloReply, 0, [](const Message& m) {
                       const auto* t = m.as<HelloReply>();
                       EXPECT_TRUE(t->accepted());
                       EXPECT_EQ(str(t->reason()), "welcome");
                       EXPECT_EQ(t->settings_hash(), 0xfedcba9876543210ULL);
                     }};
  e["Heartbeat"] = {MessageType::Heartbeat, 0, [](const Message& m) {
                      const auto* t = m.as<Heartbeat>();
                      EXPECT_EQ(t->sent_unix_ns(), 1700000000123456789ULL);
                      EXPECT_EQ(t->queue_depth(), 3u);
                      EXPECT_EQ(t->active(), 2u);
                      EXPECT_EQ(str(t->peer()), "decode-1");
                      EXPECT_EQ(t->kv_blocks_used(), 120u);
                      EXPECT_EQ(t->kv_blocks_free(), 904u);
                    }};
  e["Credit"] = {MessageType::Credit, 0,
                 [](const Message& m) { EXPECT_EQ(m.as<Credit>()->credits(), 8u); }};
  e["ErrorReply"] = {MessageType::ErrorReply, 0, [](const Message& m) {
                       const auto* t = m.as<ErrorReply>();
                       EXPECT_EQ(t->code(), ErrorCode::PromptTooLong);
                       EXPECT_EQ(str(t->message()), "prompt of 9000 tokens exceeds 8192");
                       EXPECT_EQ(t->client_request_id(), 77u);
                     }};
  e["GenerateRequest"] = {MessageType::GenerateRequest, 0, [](const Message& m) {
                            const auto* t = m.as<GenerateRequest>();
                            EXPECT_EQ(t->client_request_id(), 1001u);
                            EXPECT_EQ(str(t->prompt()), "Hello, world");
                            EXPECT_EQ(ints(t->tokens()), (std::vector<int32_t>{1, 2, 3, 4}));
                            EXPECT_EQ(str(t->tenant()), "acme");
                            EXPECT_EQ(t->deadline_ms(), 30000u);
                            EXPECT_FALSE(t->add_special_tokens());
                            const SamplingParams* s = t->sampling();
                            ASSERT_NE(s, nullptr);
                            EXPECT_EQ(s->temperature(), 0.7);
                            EXPECT_EQ(s->top_k(), 40);
                            EXPECT_EQ(s->top_p(), 0.9);
                            EXPECT_EQ(s->seed(), 1234u);
                            EXPECT_TRUE(s->has_seed());
                            EXPECT_EQ(s->max_tokens(), 64);
                            EXPECT_EQ(ints(s->stop_token_ids()), (std::vector<int32_t>{2, 32000}));
                            EXPECT_TRUE(s->ignore_eos());
                          }};
  e["CancelRequest"] = {MessageType::CancelRequest, 0, [](const Message& m) {
                          EXPECT_EQ(m.as<CancelRequest>()->client_request_id(), 1001u);
                        }};
  e["Feedback"] = {MessageType::Feedback, 0, [](const Message& m) {
                     const auto* t = m.as<Feedback>();
                     EXPECT_EQ(t->client_request_id(), 1001u);
                     EXPECT_EQ(t->score(), -0.5f);
                     EXPECT_EQ(str(t->comment()), "too long");
                   }};
  e["StreamEvent"] = {MessageType::StreamEvent, 0, [](const Message& m) {
                        const auto* t = m.as<StreamEvent>();
                        EXPECT_EQ(t->client_request_id(), 1001u);
                        EXPECT_EQ(t->request_id(), 555u);
                        EXPECT_EQ(t->kind(), EventKind::Finished);
                        EXPECT_EQ(str(t->text()), "!");
                        EXPECT_EQ(ints(t->token_ids()), (std::vector<int32_t>{0, 13}));
                        EXPECT_EQ(str(t->finish_reason()), "stop");
                        EXPECT_EQ(t->error_code(), ErrorCode::Cancelled);
                        EXPECT_EQ(str(t->error_message()), "cancelled by the client");
                        ASSERT_NE(t->usage(), nullptr);
                        EXPECT_EQ(t->usage()->prompt_tokens(), 12u);
                        EXPECT_EQ(t->usage()->completion_tokens(), 5u);
                        EXPECT_EQ(t->usage()->reused_tokens(), 8u);
                        EXPECT_EQ(str(t->usage()->reuse_level()), "prefix");
                        ASSERT_NE(t->timings(), nullptr);
                        EXPECT_EQ(t->timings()->queue_ms(), 1.5);
                        EXPECT_EQ(t->timings()->prefill_ms(), 20.25);
                        EXPECT_EQ(t->timings()->ttft_ms(), 22.0);
                        EXPECT_EQ(t->timings()->total_ms(), 80.125);
                      }};
  e["ProbeJob"] = {MessageType::ProbeJob, 0, [](const Message& m) {
                     const auto* t = m.as<ProbeJob>();
                     EXPECT_EQ(t->request_id(), 555u);
                     EXPECT_EQ(t->attempt(), 2u);
                     EXPECT_EQ(ints(t->tokens()), (std::vector<int32_t>{1, 15043, 29892}));
                     EXPECT_EQ(str(t->cache_namespace()), "acme/ns");
                   }};
  e["ProbePlan"] = {MessageType::ProbePlan, 0, [](const Message& m) {
                      const auto* t = m.as<ProbePlan>();
                      EXPECT_EQ(t->request_id(), 555u);
                      EXPECT_EQ(t->attempt(), 2u);
                      EXPECT_EQ(str(t->reuse_level()), "prefix");
                      EXPECT_EQ(t->reused_tokens(), 16u);
                      EXPECT_EQ(t->probe_us(), 350u);
                    }};
  e["PrefillJob"] = {MessageType::PrefillJob, 0, [](const Message& m) {
                       const auto* t = m.as<PrefillJob>();
                       EXPECT_EQ(t->request_id(), 555u);
                       EXPECT_EQ(t->attempt(), 2u);
                       EXPECT_EQ(ints(t->tokens()), (std::vector<int32_t>{1, 15043, 29892}));
                       check_pipeline_sampling(t->sampling());
                       EXPECT_EQ(str(t->cache_namespace()), "acme/ns");
                       EXPECT_EQ(str(t->reuse_level()), "none");
                     }};
  e["PrefillDone"] = {MessageType::PrefillDone, 0, [](const Message& m) {
                        const auto* t = m.as<PrefillDone>();
                        EXPECT_EQ(t->request_id(), 555u);
                        EXPECT_EQ(t->attempt(), 2u);
                        EXPECT_EQ(ints(t->tokens()), (std::vector<int32_t>{1, 15043, 29892}));
                        EXPECT_EQ(t->first_token(), 306);
                        EXPECT_EQ(str(t->finish_reason()), "");
                        check_pipeline_sampling(t->sampling());
                        EXPECT_EQ(str(t->cache_namespace()), "acme/ns");
                        EXPECT_EQ(t->prefill_us(), 12345u);
                        EXPECT_EQ(str(t->replica()), "prefill-0");
                        const KvLayout* layout = t->layout();
                        ASSERT_NE(layout, nullptr);
                        EXPECT_EQ(layout->layers(), 1u);
                        EXPECT_EQ(layout->kv_heads(), 1u);
                        EXPECT_EQ(layout->head_dim(), 4u);
                        EXPECT_EQ(layout->block_tokens(), 2u);
                        EXPECT_EQ(str(layout->dtype()), "f32");
                        EXPECT_EQ(layout->blocks(), 1u);
                        ASSERT_NE(t->frames(), nullptr);
                        ASSERT_EQ(t->frames()->size(), 1u);
                        EXPECT_EQ(t->frames()->Get(0)->bytes(), 64u);
                        EXPECT_EQ(check_bulk(t->frames(), m.bulk), std::nullopt);
                        ASSERT_EQ(m.bulk.size(), 1u);
                        ASSERT_EQ(m.bulk[0].size(), 64u);
                        for (size_t i = 0; i < 64; ++i)
                          EXPECT_EQ(m.bulk[0].data()[i], static_cast<uint8_t>(i * 7 + 3)) << i;
                      }};
  e["TokenBatch"] = {MessageType::TokenBatch, 0, [](const Message& m) {
                       const auto* t = m.as<TokenBatch>();
                       EXPECT_EQ(t->batch_size(), 2u);
                       EXPECT_EQ(t->step_us(), 850u);
                       ASSERT_NE(t->updates(), nullptr);
                       ASSERT_EQ(t->updates()->size(), 2u);
                       const TokenUpdate* a = t->updates()->Get(0);
                       const TokenUpdate* b = t->updates()->Get(1);
                       EXPECT_EQ(a->request_id(), 555u);
                       EXPECT_EQ(a->attempt(), 2u);
                       EXPECT_EQ(a->token(), 306);
                       EXPECT_EQ(str(a->finish_reason()), "");
                       EXPECT_EQ(b->request_id(), 556u);
                       EXPECT_EQ(b->attempt(), 1u);
                       EXPECT_EQ(b->token(), 2);
                       EXPECT_EQ(str(b->finish_reason()), "stop");
                     }};
  e["JobFailed"] = {MessageType::JobFailed, 0, [](const Message& m) {
                      const auto* t = m.as<JobFailed>();
                      EXPECT_EQ(t->request_id(), 555u);
                      EXPECT_EQ(t->attempt(), 2u);
                      EXPECT_EQ(t->code(), ErrorCode::StageFailed);
                      EXPECT_EQ(str(t->message()), "decode replica died");
                    }};
  e["CancelJob"] = {MessageType::CancelJob, 0, [](const Message& m) {
                      EXPECT_EQ(m.as<CancelJob>()->request_id(), 555u);
                      EXPECT_EQ(m.as<CancelJob>()->attempt(), 3u);
                    }};
  e["ExpertPlanRequest"] = {MessageType::ExpertPlanRequest, 0, [](const Message& m) {
                              const auto* t = m.as<ExpertPlanRequest>();
                              EXPECT_EQ(t->model_id(), 0x1122334455667788ULL);
                              EXPECT_EQ(str(t->replica()), "decode-1");
                            }};
  e["ExpertPlan"] = {MessageType::ExpertPlan, 0, [](const Message& m) {
                       const auto* t = m.as<ExpertPlan>();
                       EXPECT_EQ(t->model_id(), 0x1122334455667788ULL);
                       EXPECT_TRUE(t->all_resident());
                       EXPECT_EQ(t->layers(), 2u);
                       EXPECT_EQ(t->experts_per_layer(), 8u);
                       EXPECT_EQ(t->expert_bytes(), uint64_t{1} << 20);
                       EXPECT_EQ(str(t->tier()), "resident");
                       EXPECT_EQ(str(t->requester()), "decode-1");
                     }};
  e["ExpertUsage"] = {MessageType::ExpertUsage, 0, [](const Message& m) {
                        const auto* t = m.as<ExpertUsage>();
                        EXPECT_EQ(t->layers(), 2u);
                        EXPECT_EQ(t->experts(), 4u);
                        ASSERT_NE(t->counts(), nullptr);
                        EXPECT_EQ(std::vector<uint64_t>(t->counts()->begin(), t->counts()->end()),
                                  (std::vector<uint64_t>{5, 0, 3, 8, 2, 7, 1, 6}));
                        EXPECT_EQ(t->tokens(), 16u);
                        EXPECT_EQ(str(t->replica()), "decode-1");
                      }};
  e["ControlCommand"] = {MessageType::ControlCommand, 0, [](const Message& m) {
                           const auto* t = m.as<ControlCommand>();
                           EXPECT_EQ(str(t->command()), "drain");
                           EXPECT_EQ(str(t->arguments()), "{\"stage\":\"decode\"}");
                         }};
  e["ControlReply"] = {MessageType::ControlReply, 0, [](const Message& m) {
                         const auto* t = m.as<ControlReply>();
                         EXPECT_TRUE(t->ok());
                         EXPECT_EQ(str(t->message()), "draining");
                         EXPECT_EQ(str(t->json()), "{\"draining\":true}");
                       }};
  return e;
}

// Schema 1.1 (reuse): every 1.0 type again, with minor 1, the new fields of ProbeJob, ProbePlan,
// PrefillJob and PrefillDone, and SnapshotPut.
std::map<std::string, Expectation> v1_1() {
  std::map<std::string, Expectation> e = v1_0();
  for (auto& [stem, expectation] : e) expectation.minor = 1;
  auto also = [&e](const std::string& stem, std::function<void(const Message&)> more) {
    auto before = e.at(stem).check;
    e.at(stem).check = [before, more](const Message& m) {
      before(m);
      more(m);
    };
  };
  auto check_kv = [](const Message& m, const KvLayout* layout,
                     const flatbuffers::Vector<flatbuffers::Offset<BulkFrame>>* frames) {
    ASSERT_NE(layout, nullptr);
    EXPECT_EQ(layout->blocks(), 1u);
    EXPECT_EQ(check_bulk(frames, m.bulk), std::nullopt);
    ASSERT_EQ(m.bulk.size(), 1u);
    EXPECT_EQ(m.bulk[0].size(), 64u);
  };
  also("ProbeJob", [](const Message& m) {
    const auto* t = m.as<ProbeJob>();
    check_pipeline_sampling(t->sampling());
    EXPECT_EQ(t->allowed_levels(), 5u);
  });
  also("ProbePlan", [check_kv](const Message& m) {
    const auto* t = m.as<ProbePlan>();
    check_kv(m, t->layout(), t->frames());
    EXPECT_EQ(ints(t->completion()), (std::vector<int32_t>{306, 2}));
    EXPECT_EQ(str(t->finish_reason()), "stop");
    EXPECT_EQ(t->prefix_key(), 0x0badc0ffee0ddf00ULL);
  });
  e["PrefillJob"] = {MessageType::PrefillJob, 1, [check_kv](const Message& m) {
                       const auto* t = m.as<PrefillJob>();
                       EXPECT_EQ(t->request_id(), 555u);
                       EXPECT_EQ(t->attempt(), 2u);
                       EXPECT_EQ(ints(t->tokens()), (std::vector<int32_t>{1, 15043, 29892}));
                       check_pipeline_sampling(t->sampling());
                       EXPECT_EQ(str(t->cache_namespace()), "acme/ns");
                       EXPECT_EQ(str(t->reuse_level()), "prefix");
                       EXPECT_EQ(t->reused_tokens(), 2u);
                       check_kv(m, t->layout(), t->frames());
                       EXPECT_EQ(t->store_levels(), 3u);
                       EXPECT_EQ(t->prefix_key(), 0x0badc0ffee0ddf00ULL);
                     }};
  also("PrefillDone", [](const Message& m) {
    const auto* t = m.as<PrefillDone>();
    EXPECT_EQ(str(t->reuse_level()), "prefix");
    EXPECT_EQ(t->reused_tokens(), 2u);
  });
  e["SnapshotPut"] = {MessageType::SnapshotPut, 1, [](const Message& m) {
                        const auto* t = m.as<SnapshotPut>();
                        ASSERT_NE(t->entries(), nullptr);
                        ASSERT_EQ(t->entries()->size(), 1u);
                        EXPECT_EQ(t->entries()->Get(0)->key(), 0x1111222233334444ULL);
                        EXPECT_EQ(t->entries()->Get(0)->kind(), SnapshotKind::Block);
                        EXPECT_EQ(static_cast<char>(t->entries()->Get(0)->kind()), 'B');
                        EXPECT_EQ(check_bulk(t->frames(), m.bulk), std::nullopt);
                      }};
  return e;
}

// Schema 1.2 (approximate reuse): every 1.1 type again, with minor 2, and the new fields of
// GenerateRequest, Usage (in StreamEvent), ProbePlan, PrefillJob and PrefillDone.
std::map<std::string, Expectation> v1_2() {
  std::map<std::string, Expectation> e = v1_1();
  for (auto& [stem, expectation] : e) expectation.minor = 2;
  auto also = [&e](const std::string& stem, std::function<void(const Message&)> more) {
    auto before = e.at(stem).check;
    e.at(stem).check = [before, more](const Message& m) {
      before(m);
      more(m);
    };
  };
  auto bytes = [](const flatbuffers::Vector<uint8_t>* v) {
    return v ? std::vector<uint8_t>(v->begin(), v->end()) : std::vector<uint8_t>{};
  };
  also("GenerateRequest",
       [](const Message& m) { EXPECT_EQ(str(m.as<GenerateRequest>()->reuse()), "approximate"); });
  also("StreamEvent", [](const Message& m) {
    const auto* usage = m.as<StreamEvent>()->usage();
    ASSERT_NE(usage, nullptr);
    EXPECT_EQ(str(usage->approximate()), "shadow");
    EXPECT_EQ(usage->similarity(), 0.96875f);
  });
  also("ProbePlan", [bytes](const Message& m) {
    const auto* t = m.as<ProbePlan>();
    EXPECT_EQ(str(t->approximate()), "blend");
    EXPECT_EQ(t->donor_key(), 0x00d0d0d0d0d0d0d0ULL);
    EXPECT_EQ(t->similarity(), 0.9375f);
    EXPECT_EQ(t->cell(), 5003);
    EXPECT_EQ(bytes(t->blend_mask()), (std::vector<uint8_t>{1, 0, 1}));
    EXPECT_EQ(t->recompute_fraction(), 0.15f);
    EXPECT_EQ(str(t->shadow_mode()), "blend");
    EXPECT_TRUE(t->shadow_sampled());
  });
  also("PrefillJob", [bytes](const Message& m) {
    const auto* t = m.as<PrefillJob>();
    EXPECT_EQ(bytes(t->blend_mask()), (std::vector<uint8_t>{1, 0, 1}));
    EXPECT_EQ(t->recompute_fraction(), 0.15f);
    EXPECT_TRUE(t->shadow());
  });
  also("PrefillDone", [](const Message& m) {
    const auto* t = m.as<PrefillDone>();
    EXPECT_EQ(t->recomputed_tokens(), 1u);
    EXPECT_TRUE(t->shadow_checked());
    EXPECT_EQ(t->shadow_kl(), 0.125f);
    EXPECT_TRUE(t->shadow_top1());
  });
  return e;
}

// Schema 1.3 (expert offload): every 1.2 type again, with minor 3, and ExpertPlan's pool.
std::map<std::string, Expectation> v1_3() {
  std::map<std::string, Expectation> e = v1_2();
  for (auto& [stem, expectation] : e) expectation.minor = 3;
  e["ExpertPlan"].check = [](const Message& m) {
    const auto* t = m.as<ExpertPlan>();
    EXPECT_EQ(t->model_id(), 0x1122334455667788ULL);
    EXPECT_FALSE(t->all_resident());
    EXPECT_EQ(t->layers(), 2u);
    EXPECT_EQ(t->experts_per_layer(), 8u);
    EXPECT_EQ(t->expert_bytes(), uint64_t{1} << 20);
    EXPECT_EQ(str(t->tier()), "host_pool");
    EXPECT_EQ(str(t->requester()), "decode-1");
    EXPECT_EQ(str(t->pool_name()), "/moeline-pool-golden");
    EXPECT_EQ(t->pool_bytes(), uint64_t{1} << 19);
    EXPECT_EQ(t->prefetch_depth(), 2u);
  };
  auto before = e.at("ExpertUsage").check;
  e["ExpertUsage"].check = [before](const Message& m) {
    before(m);
    const auto* t = m.as<ExpertUsage>();
    ASSERT_NE(t->layer_tokens(), nullptr);
    ASSERT_NE(t->confidence_sum(), nullptr);
    ASSERT_NE(t->router_seconds(), nullptr);
    EXPECT_EQ(std::vector<uint64_t>(t->layer_tokens()->begin(), t->layer_tokens()->end()),
              (std::vector<uint64_t>{8, 8}));
    EXPECT_EQ(std::vector<double>(t->confidence_sum()->begin(), t->confidence_sum()->end()),
              (std::vector<double>{12.5, 3.25}));
    EXPECT_EQ(std::vector<double>(t->router_seconds()->begin(), t->router_seconds()->end()),
              (std::vector<double>{0.5, 0.25}));
  };
  return e;
}

// Schema 1.4 (DeepSeek's latent KV): every 1.3 type again, with minor 4; PrefillJob's KV layout
// is keys only, the others keep the default (keys and values), as every earlier file reads.
std::map<std::string, Expectation> v1_4() {
  std::map<std::string, Expectation> e = v1_3();
  for (auto& [stem, expectation] : e) expectation.minor = 4;
  auto values_are = [&e](const std::string& stem, bool values, auto layout_of) {
    auto before = e.at(stem).check;
    e.at(stem).check = [before, values, layout_of](const Message& m) {
      before(m);
      const KvLayout* layout = layout_of(m);
      ASSERT_NE(layout, nullptr);
      EXPECT_EQ(layout->values(), values);
    };
  };
  values_are("PrefillJob", false, [](const Message& m) { return m.as<PrefillJob>()->layout(); });
  values_are("PrefillDone", true, [](const Message& m) { return m.as<PrefillDone>()->layout(); });
  values_are("ProbePlan", true, [](const Message& m) { return m.as<ProbePlan>()->layout(); });
  return e;
}

// Schema 1.5 (trust boundaries): every 1.4 type again, with minor 5; GenerateRequest and
// ControlCommand carry an API key.
std::map<std::string, Expectation> v1_5() {
  std::map<std::string, Expectation> e = v1_4();
  for (auto& [stem, expectation] : e) expectation.minor = 5;
  auto before = e.at("GenerateRequest").check;
  e["GenerateRequest"].check = [before](const Message& m) {
    before(m);
    EXPECT_EQ(str(m.as<GenerateRequest>()->api_key()), "ml_0123abcd_secret");
  };
  // What a reader of 1.6 and later sees in a request of 1.5: no penalty, no log-probabilities.
  auto keyed = e.at("GenerateRequest").check;
  e["GenerateRequest"].check = [keyed](const Message& m) {
    keyed(m);
    const SamplingParams* s = m.as<GenerateRequest>()->sampling();
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->repetition_penalty(), 1.0);
    EXPECT_EQ(s->presence_penalty(), 0.0);
    EXPECT_FALSE(s->logprobs());
  };
  auto control = e.at("ControlCommand").check;
  e["ControlCommand"].check = [control](const Message& m) {
    control(m);
    EXPECT_EQ(str(m.as<ControlCommand>()->api_key()), "ml_op_key");
  };
  return e;
}

// The log-probabilities make_golden writes wherever a version has them (1.6 on).
void expect_golden_logprobs(const TokenLogprobs* lp) {
  ASSERT_NE(lp, nullptr);
  EXPECT_EQ(lp->logprob(), -0.25f);
  ASSERT_NE(lp->top_ids(), nullptr);
  ASSERT_NE(lp->top_logprobs(), nullptr);
  EXPECT_EQ(std::vector<int32_t>(lp->top_ids()->begin(), lp->top_ids()->end()),
            (std::vector<int32_t>{13, 7}));
  EXPECT_EQ(std::vector<float>(lp->top_logprobs()->begin(), lp->top_logprobs()->end()),
            (std::vector<float>{-0.25f, -1.5f}));
}

// Schema 1.6 (the OpenAI front's sampling): every 1.5 type again, with minor 6; GenerateRequest
// sets min-p, the penalties and log-probabilities, and StreamEvent, PrefillDone and TokenBatch
// carry log-probabilities. (Files before 1.6 read the neutral values: repetition_penalty 1.)
std::map<std::string, Expectation> v1_6() {
  std::map<std::string, Expectation> e = v1_5();
  for (auto& [stem, expectation] : e) expectation.minor = 6;
  auto request = v1_4().at("GenerateRequest").check;
  e["GenerateRequest"].check = [request](const Message& m) {
    request(m);
    EXPECT_EQ(str(m.as<GenerateRequest>()->api_key()), "ml_0123abcd_secret");
    const SamplingParams* s = m.as<GenerateRequest>()->sampling();
    ASSERT_NE(s, nullptr);
    EXPECT_EQ(s->min_p(), 0.05);
    EXPECT_EQ(s->presence_penalty(), 0.5);
    EXPECT_EQ(s->frequency_penalty(), -0.25);
    EXPECT_EQ(s->repetition_penalty(), 1.1);
    EXPECT_TRUE(s->logprobs());
    EXPECT_EQ(s->top_logprobs(), 3);
  };
  auto golden = expect_golden_logprobs;
  auto event = e.at("StreamEvent").check;
  e["StreamEvent"].check = [event, golden](const Message& m) {
    event(m);
    const auto* logprobs = m.as<StreamEvent>()->logprobs();
    ASSERT_NE(logprobs, nullptr);
    ASSERT_EQ(logprobs->size(), 2u);
    for (const TokenLogprobs* lp : *logprobs) golden(lp);
  };
  auto done = e.at("PrefillDone").check;
  e["PrefillDone"].check = [done, golden](const Message& m) {
    done(m);
    golden(m.as<PrefillDone>()->first_logprobs());
  };
  auto batch = e.at("TokenBatch").check;
  e["TokenBatch"].check = [batch, golden](const Message& m) {
    batch(m);
    const auto* updates = m.as<TokenBatch>()->updates();
    ASSERT_NE(updates, nullptr);
    golden(updates->Get(0)->logprobs());
    EXPECT_EQ(updates->Get(1)->logprobs(), nullptr);
  };
  return e;
}

// 1.7: bulk data peer to peer (intakes, routes, tickets, HandoverAccepted).
std::vector<uint8_t> bytes_from(uint8_t first) {
  std::vector<uint8_t> out(32);
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<uint8_t>(first + i);
  return out;
}
template <class Vector>
std::vector<uint8_t> bytes_of(const Vector* v) {
  return v == nullptr ? std::vector<uint8_t>() : std::vector<uint8_t>(v->begin(), v->end());
}

std::map<std::string, Expectation> v1_7() {
  std::map<std::string, Expectation> e = v1_6();
  for (auto& [stem, expectation] : e) expectation.minor = 7;
  const std::string key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
  auto also = [&e](const std::string& stem, std::function<void(const Message&)> more) {
    auto before = e.at(stem).check;
    e.at(stem).check = [before, more](const Message& m) {
      before(m);
      more(m);
    };
  };
  also("Hello", [key](const Message& m) {
    EXPECT_EQ(str(m.as<Hello>()->intake()), "tcp://10.0.0.7:41234");
    EXPECT_EQ(str(m.as<Hello>()->intake_key()), key);
  });
  also("HelloReply", [](const Message& m) {
    EXPECT_EQ(bytes_of(m.as<HelloReply>()->handover_key()), bytes_from(0x40));
  });
  also("PrefillJob", [key](const Message& m) {
    const PeerRoute* decode = m.as<PrefillJob>()->decode_route();
    const PeerRoute* store = m.as<PrefillJob>()->store_route();
    ASSERT_NE(decode, nullptr);
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(str(decode->replica()), "decode-1");
    EXPECT_EQ(str(decode->endpoint()), "tcp://10.0.0.8:41000");
    EXPECT_EQ(str(decode->server_key()), key);
    EXPECT_EQ(bytes_of(decode->ticket()), bytes_from(0x10));
    EXPECT_EQ(str(store->replica()), "probe-0");
    EXPECT_EQ(str(store->endpoint()), "ipc:///run/moeline/probe-0.intake");
    EXPECT_EQ(str(store->server_key()), "");
    EXPECT_EQ(bytes_of(store->ticket()), bytes_from(0x20));
    EXPECT_EQ(bytes_of(m.as<PrefillJob>()->ticket()), bytes_from(0x30));
  });
  also("ProbeJob", [key](const Message& m) {
    const PeerRoute* prefill = m.as<ProbeJob>()->prefill_route();
    const PeerRoute* decode = m.as<ProbeJob>()->decode_route();
    ASSERT_NE(prefill, nullptr);
    ASSERT_NE(decode, nullptr);
    EXPECT_EQ(str(prefill->replica()), "prefill-0");
    EXPECT_EQ(str(prefill->endpoint()), "tcp://10.0.0.9:41100");
    EXPECT_EQ(str(prefill->server_key()), key);
    EXPECT_EQ(bytes_of(prefill->ticket()), bytes_from(0x30));
    EXPECT_EQ(str(decode->replica()), "decode-1");
    EXPECT_EQ(bytes_of(decode->ticket()), bytes_from(0x10));
    EXPECT_EQ(m.as<ProbeJob>()->store_levels(), 3u);
  });
  also("ProbePlan", [](const Message& m) { EXPECT_TRUE(m.as<ProbePlan>()->forwarded()); });
  also("PrefillDone", [](const Message& m) {
    EXPECT_EQ(bytes_of(m.as<PrefillDone>()->ticket()), bytes_from(0x10));
  });
  also("SnapshotPut", [](const Message& m) {
    EXPECT_EQ(m.as<SnapshotPut>()->request_id(), 555u);
    EXPECT_EQ(m.as<SnapshotPut>()->attempt(), 2u);
    EXPECT_EQ(bytes_of(m.as<SnapshotPut>()->ticket()), bytes_from(0x20));
  });
  e["HandoverAccepted"] = {MessageType::HandoverAccepted, 7, [](const Message& m) {
                             EXPECT_EQ(m.as<HandoverAccepted>()->request_id(), 42u);
                             EXPECT_EQ(m.as<HandoverAccepted>()->attempt(), 2u);
                           }};
  return e;
}

// 1.8: usage reports straight to the offload manager (the plan's usage route, the report's
// reporter and ticket).
std::map<std::string, Expectation> v1_8() {
  std::map<std::string, Expectation> e = v1_7();
  for (auto& [stem, expectation] : e) expectation.minor = 8;
  const std::string key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7";
  auto also = [&e](const std::string& stem, std::function<void(const Message&)> more) {
    auto before = e.at(stem).check;
    e.at(stem).check = [before, more](const Message& m) {
      before(m);
      more(m);
    };
  };
  also("ExpertPlan", [key](const Message& m) {
    const PeerRoute* route = m.as<ExpertPlan>()->usage_route();
    ASSERT_NE(route, nullptr);
    EXPECT_EQ(str(route->replica()), "offload");
    EXPECT_EQ(str(route->endpoint()), "tcp://10.0.0.7:41300");
    EXPECT_EQ(str(route->server_key()), key);
    EXPECT_EQ(bytes_of(route->ticket()), bytes_from(0x50));
  });
  also("ExpertUsage", [](const Message& m) {
    EXPECT_EQ(str(m.as<ExpertUsage>()->reporter()), "decode-1#a1b2c3");
    EXPECT_EQ(bytes_of(m.as<ExpertUsage>()->ticket()), bytes_from(0x50));
  });
  return e;
}

// 1.9: the typed reuse level, approximate outcome, shadow mode and finish reason, next to the
// strings (which stay, deprecated). The typed fields hold what the strings say.
std::map<std::string, Expectation> v1_9() {
  std::map<std::string, Expectation> e = v1_8();
  for (auto& [stem, expectation] : e) expectation.minor = 9;
  auto also = [&e](const std::string& stem, std::function<void(const Message&)> more) {
    auto before = e.at(stem).check;
    e.at(stem).check = [before, more](const Message& m) {
      before(m);
      more(m);
    };
  };
  also("StreamEvent", [](const Message& m) {
    const StreamEvent* t = m.as<StreamEvent>();
    EXPECT_EQ(t->finish(), FinishReason::Stop);
    ASSERT_NE(t->usage(), nullptr);
    EXPECT_EQ(t->usage()->level(), ReuseLevel::Prefix);
    EXPECT_EQ(t->usage()->outcome(), ApproximateOutcome::Shadow);
  });
  also("ProbePlan", [](const Message& m) {
    const ProbePlan* t = m.as<ProbePlan>();
    EXPECT_EQ(t->level(), ReuseLevel::Prefix);
    EXPECT_EQ(t->finish(), FinishReason::Stop);
    EXPECT_EQ(t->outcome(), ApproximateOutcome::Blend);
    EXPECT_EQ(t->shadow_of(), ShadowMode::Blend);
  });
  also("PrefillJob",
       [](const Message& m) { EXPECT_EQ(m.as<PrefillJob>()->level(), ReuseLevel::Prefix); });
  also("PrefillDone", [](const Message& m) {
    EXPECT_EQ(m.as<PrefillDone>()->level(), ReuseLevel::Prefix);
    EXPECT_FALSE(m.as<PrefillDone>()->finish().has_value());  // the sequence goes on
  });
  also("TokenBatch", [](const Message& m) {
    const auto* updates = m.as<TokenBatch>()->updates();
    ASSERT_NE(updates, nullptr);
    EXPECT_FALSE(updates->Get(0)->finish().has_value());
    EXPECT_EQ(updates->Get(1)->finish(), FinishReason::Stop);
  });
  return e;
}

// 1.10: the node token of an intake (Hello.intake_node) and of a route (PeerRoute.node): bulk
// through shared memory between processes of one node.
std::map<std::string, Expectation> v1_10() {
  std::map<std::string, Expectation> e = v1_9();
  for (auto& [stem, expectation] : e) expectation.minor = 10;
  const std::string node = "0123456789abcdef0123456789abcdef";
  auto also = [&e](const std::string& stem, std::function<void(const Message&)> more) {
    auto before = e.at(stem).check;
    e.at(stem).check = [before, more](const Message& m) {
      before(m);
      more(m);
    };
  };
  also("Hello", [node](const Message& m) { EXPECT_EQ(str(m.as<Hello>()->intake_node()), node); });
  also("ProbeJob", [node](const Message& m) {
    EXPECT_EQ(str(m.as<ProbeJob>()->prefill_route()->node()), node);
    EXPECT_EQ(str(m.as<ProbeJob>()->decode_route()->node()), node);
  });
  also("PrefillJob", [node](const Message& m) {
    EXPECT_EQ(str(m.as<PrefillJob>()->decode_route()->node()), node);
    EXPECT_EQ(str(m.as<PrefillJob>()->store_route()->node()), node);
  });
  also("ExpertPlan", [node](const Message& m) {
    EXPECT_EQ(str(m.as<ExpertPlan>()->usage_route()->node()), node);
  });
  return e;
}

// 1.11: StreamEventBatch (one connection's events in one message) and the request's opt-in,
// GenerateRequest.batch_events.
std::map<std::string, Expectation> v1_11() {
  std::map<std::string, Expectation> e = v1_10();
  for (auto& [stem, expectation] : e) expectation.minor = 11;
  auto before = e.at("GenerateRequest").check;
  e.at("GenerateRequest").check = [before](const Message& m) {
    before(m);
    EXPECT_TRUE(m.as<GenerateRequest>()->batch_events());
  };
  e["StreamEventBatch"] = {
      MessageType::StreamEventBatch, 11, [](const Message& m) {
        const auto* events = m.as<StreamEventBatch>()->events();
        ASSERT_NE(events, nullptr);
        ASSERT_EQ(events->size(), 3u);
        EXPECT_EQ(events->Get(0)->client_request_id(), 1001u);
        EXPECT_EQ(events->Get(0)->kind(), EventKind::Delta);
        EXPECT_EQ(str(events->Get(0)->text()), "Hi");
        EXPECT_EQ(ints(events->Get(0)->token_ids()), (std::vector<int32_t>{13}));
        EXPECT_EQ(events->Get(1)->client_request_id(), 1002u);
        EXPECT_EQ(events->Get(1)->request_id(), 556u);
        EXPECT_EQ(ints(events->Get(1)->token_ids()), (std::vector<int32_t>{7}));
        EXPECT_EQ(events->Get(2)->client_request_id(), 1001u);
        EXPECT_EQ(events->Get(2)->kind(), EventKind::Finished);
        EXPECT_EQ(events->Get(2)->finish(), FinishReason::Stop);
      }};
  return e;
}

// 1.12: OpenAI's logit_bias in SamplingParams.
std::map<std::string, Expectation> v1_12() {
  std::map<std::string, Expectation> e = v1_11();
  for (auto& [stem, expectation] : e) expectation.minor = 12;
  auto before = e.at("GenerateRequest").check;
  e.at("GenerateRequest").check = [before](const Message& m) {
    before(m);
    const auto* bias = m.as<GenerateRequest>()->sampling()->logit_bias();
    ASSERT_NE(bias, nullptr);
    ASSERT_EQ(bias->size(), 2u);
    EXPECT_EQ(bias->Get(0)->token(), 50256);
    EXPECT_EQ(bias->Get(0)->bias(), -100.0f);
    EXPECT_EQ(bias->Get(1)->token(), 7);
    EXPECT_EQ(bias->Get(1)->bias(), 2.5f);
  };
  return e;
}

// 1.13: the prompt's log-probabilities (echo): asked for in SamplingParams, carried by the
// gateway's PrefillDone and the client's StreamEvent.
std::map<std::string, Expectation> v1_13() {
  std::map<std::string, Expectation> e = v1_12();
  for (auto& [stem, expectation] : e) expectation.minor = 13;
  auto request = e.at("GenerateRequest").check;
  e.at("GenerateRequest").check = [request](const Message& m) {
    request(m);
    EXPECT_TRUE(m.as<GenerateRequest>()->sampling()->prompt_logprobs());
  };
  auto prompt_entries = [](const flatbuffers::Vector<flatbuffers::Offset<TokenLogprobs>>* entries,
                           size_t count) {
    ASSERT_NE(entries, nullptr);
    ASSERT_EQ(entries->size(), count);
    for (const TokenLogprobs* lp : *entries) expect_golden_logprobs(lp);
  };
  auto event = e.at("StreamEvent").check;
  e.at("StreamEvent").check = [event, prompt_entries](const Message& m) {
    event(m);
    prompt_entries(m.as<StreamEvent>()->prompt_logprobs(), 3);
    const auto* ids = m.as<StreamEvent>()->prompt_token_ids();
    ASSERT_NE(ids, nullptr);
    EXPECT_EQ(std::vector<int32_t>(ids->begin(), ids->end()),
              (std::vector<int32_t>{1, 15043, 29892, 3186}));
  };
  auto done = e.at("PrefillDone").check;
  e.at("PrefillDone").check = [done, prompt_entries](const Message& m) {
    done(m);
    prompt_entries(m.as<PrefillDone>()->prompt_logprobs(), 2);
  };
  return e;
}

// 1.14: the credit a stage grants back rides in the envelope's flags of a message to the hub
// (TokenBatch here); only a hub reads it (Limits::accepts_credits).
std::map<std::string, Expectation> v1_14() {
  std::map<std::string, Expectation> e = v1_13();
  for (auto& [stem, expectation] : e) {
    expectation.minor = 14;
    const bool carries = stem == "TokenBatch";
    expectation.check = [before = expectation.check, carries](const Message& m) {
      before(m);
      EXPECT_EQ(m.credits, carries ? 3u : 0u);
      // Read once: the header no longer carries it (a forwarded message passes none on).
      uint16_t flags = 0;
      std::memcpy(&flags, m.header.data() + 10, 2);
      EXPECT_EQ(flags, 0);
    };
  }
  return e;
}

// 1.15: structured output, asked for in SamplingParams.
std::map<std::string, Expectation> v1_15() {
  std::map<std::string, Expectation> e = v1_14();
  for (auto& [stem, expectation] : e) expectation.minor = 15;
  auto request = e.at("GenerateRequest").check;
  e.at("GenerateRequest").check = [request](const Message& m) {
    request(m);
    const auto* sampling = m.as<GenerateRequest>()->sampling();
    EXPECT_EQ(sampling->structured(), wire::StructuredOutput::JsonSchema);
    ASSERT_NE(sampling->json_schema(), nullptr);
    EXPECT_EQ(sampling->json_schema()->str(),
              R"({"type":"object","properties":{"a":{"type":"integer"}}})");
  };
  return e;
}

// 1.16: where the grammar begins on a model that thinks, in SamplingParams.
std::map<std::string, Expectation> v1_16() {
  std::map<std::string, Expectation> e = v1_15();
  for (auto& [stem, expectation] : e) expectation.minor = 16;
  auto request = e.at("GenerateRequest").check;
  e.at("GenerateRequest").check = [request](const Message& m) {
    request(m);
    EXPECT_EQ(m.as<GenerateRequest>()->sampling()->reasoning(), wire::ReasoningBlock::Open);
  };
  return e;
}

// 1.17: special tokens kept in the events' text, asked for in GenerateRequest.
std::map<std::string, Expectation> v1_17() {
  std::map<std::string, Expectation> e = v1_16();
  for (auto& [stem, expectation] : e) expectation.minor = 17;
  auto request = e.at("GenerateRequest").check;
  e.at("GenerateRequest").check = [request](const Message& m) {
    request(m);
    EXPECT_FALSE(m.as<GenerateRequest>()->skip_special_tokens());
  };
  return e;
}

// 1.18: vLLM's min_tokens in SamplingParams (older files read 0: no hold on the end tokens).
std::map<std::string, Expectation> v1_18() {
  std::map<std::string, Expectation> e = v1_17();
  for (auto& [stem, expectation] : e) expectation.minor = 18;
  auto request = e.at("GenerateRequest").check;
  e.at("GenerateRequest").check = [request](const Message& m) {
    request(m);
    EXPECT_EQ(m.as<GenerateRequest>()->sampling()->min_tokens(), 8);
  };
  return e;
}

// As the hub reads them: the one reader of envelope credit (any other refuses it,
// WireDecode.EnvelopeCreditIsForTheHubOnly).
Decoded decode_as_hub(std::vector<zmq::message_t>&& frames) {
  return decode(std::move(frames), Limits{.accepts_credits = true});
}

// Every released version: directory name -> file stem -> expectation.
const std::map<std::string, std::map<std::string, Expectation>>& released() {
  static const std::map<std::string, std::map<std::string, Expectation>> versions = {
      {"v1.0", v1_0()},   {"v1.1", v1_1()},   {"v1.2", v1_2()},   {"v1.3", v1_3()},
      {"v1.4", v1_4()},   {"v1.5", v1_5()},   {"v1.6", v1_6()},   {"v1.7", v1_7()},
      {"v1.8", v1_8()},   {"v1.9", v1_9()},   {"v1.10", v1_10()}, {"v1.11", v1_11()},
      {"v1.12", v1_12()}, {"v1.13", v1_13()}, {"v1.14", v1_14()}, {"v1.15", v1_15()},
      {"v1.16", v1_16()}, {"v1.17", v1_17()}, {"v1.18", v1_18()}};
  return versions;
}

// The file format: frames, each a u32 little-endian length and that many bytes, nothing else.
std::optional<std::vector<zmq::message_t>> read_frames(const fs::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return std::nullopt;
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::vector<zmq::message_t> frames;
  size_t at = 0;
  while (at < bytes.size()) {
    if (bytes.size() - at < 4) return std::nullopt;
    uint32_t size = 0;
    for (int i = 0; i < 4; ++i)
      size |= uint32_t{static_cast<uint8_t>(bytes[at + static_cast<size_t>(i)])} << (8 * i);
    at += 4;
    if (bytes.size() - at < size) return std::nullopt;
    frames.emplace_back(bytes.data() + at, size);
    at += size;
  }
  return frames;
}

TEST(WireCompat, EveryGoldenBufferDecodesToTheValuesItWasWrittenWith) {
  int checked = 0;
  for (const fs::directory_entry& dir : fs::directory_iterator(kCompatDir)) {
    const std::string version = dir.path().filename().string();
    if (!dir.is_directory() || version.rfind('v', 0) != 0) continue;
    const auto expectations = released().find(version);
    for (const fs::directory_entry& entry : fs::directory_iterator(dir.path())) {
      const std::string name = version + "/" + entry.path().filename().string();
      SCOPED_TRACE(name);
      // A golden buffer nobody checks proves nothing: every file needs its expectations.
      ASSERT_TRUE(expectations != released().end()) << "no expectations for version " << version;
      ASSERT_EQ(entry.path().extension(), ".bin");
      const auto expectation = expectations->second.find(entry.path().stem().string());
      ASSERT_TRUE(expectation != expectations->second.end()) << "no expectations for " << name;

      std::optional<std::vector<zmq::message_t>> frames = read_frames(entry.path());
      ASSERT_TRUE(frames.has_value()) << "not a sequence of length-prefixed frames";
      Decoded decoded = decode_as_hub(std::move(*frames));
      ASSERT_FALSE(decoded.error.has_value())
          << decoded.error->reason << ": " << decoded.error->detail;
      ASSERT_TRUE(decoded.message.has_value());
      EXPECT_EQ(decoded.message->type, expectation->second.type);
      EXPECT_EQ(decoded.message->minor, expectation->second.minor);
      // Bulk frames only where the schema describes them.
      const MessageType type = decoded.message->type;
      if (type != MessageType::PrefillDone && type != MessageType::ProbePlan &&
          type != MessageType::PrefillJob && type != MessageType::SnapshotPut) {
        EXPECT_TRUE(decoded.message->bulk.empty());
      }
      expectation->second.check(*decoded.message);
      ++checked;
    }
  }
  EXPECT_GE(checked, 21);
}

TEST(WireCompat, EveryExpectationHasItsGoldenBuffer) {
  for (const auto& [version, expectations] : released()) {
    for (const auto& [stem, expectation] : expectations) {
      EXPECT_EQ(stem, message_type_name(expectation.type));
      EXPECT_TRUE(fs::is_regular_file(kCompatDir / version / (stem + ".bin")))
          << version << "/" << stem << ".bin is missing";
    }
  }
}

TEST(WireCompat, Version1_0CoversEveryMessageTypeOfThatVersion) {
  // The 21 types of schema 1.0; types added later belong to a later version's directory.
  const std::vector<MessageType> v1_0_types = {
      MessageType::Hello,         MessageType::HelloReply,        MessageType::Heartbeat,
      MessageType::Credit,        MessageType::ErrorReply,        MessageType::GenerateRequest,
      MessageType::CancelRequest, MessageType::Feedback,          MessageType::StreamEvent,
      MessageType::ProbeJob,      MessageType::ProbePlan,         MessageType::PrefillJob,
      MessageType::PrefillDone,   MessageType::TokenBatch,        MessageType::JobFailed,
      MessageType::CancelJob,     MessageType::ExpertPlanRequest, MessageType::ExpertPlan,
      MessageType::ExpertUsage,   MessageType::ControlCommand,    MessageType::ControlReply};
  const auto& expectations = released().at("v1.0");
  EXPECT_EQ(expectations.size(), v1_0_types.size());
  for (const MessageType type : v1_0_types) {
    const std::string stem = message_type_name(type);
    EXPECT_TRUE(expectations.contains(stem)) << stem;
    EXPECT_TRUE(fs::is_regular_file(kCompatDir / "v1.0" / (stem + ".bin"))) << stem;
  }
}

// What the typed fields replace reads the same through wire/vocabulary.h from the strings of every
// version before 1.9 (no typed field in those files) and from the typed fields of 1.9.
TEST(WireCompat, TheStringsOfOlderVersionsReadAsTheTypedValues) {
  for (const std::string version : {"v1.2", "v1.8", "v1.9", "v1.10", "v1.11", "v1.12", "v1.13",
                                    "v1.14", "v1.15", "v1.16", "v1.17", "v1.18"}) {
    SCOPED_TRACE(version);
    auto read = [&](const std::string& stem) {
      auto frames = read_frames(kCompatDir / version / (stem + ".bin"));
      EXPECT_TRUE(frames.has_value()) << stem;
      Decoded decoded = decode_as_hub(std::move(*frames));
      EXPECT_TRUE(decoded.message.has_value())
          << stem << ": " << (decoded.error ? decoded.error->detail : "");
      return std::move(*decoded.message);
    };
    const bool typed = version == "v1.9" || version == "v1.10" || version == "v1.11" ||
                       version == "v1.12" || version == "v1.13" || version == "v1.14" ||
                       version == "v1.15" || version == "v1.16" || version == "v1.17" ||
                       version == "v1.18";
    const Message event = read("StreamEvent");
    const StreamEvent* e = event.as<StreamEvent>();
    EXPECT_EQ(e->finish().has_value(), typed);
    EXPECT_EQ(finish_reason_of(*e), FinishReason::Stop);
    EXPECT_EQ(reuse_level_of(*e->usage()), ReuseLevel::Prefix);
    EXPECT_EQ(approximate_outcome_of(*e->usage()), ApproximateOutcome::Shadow);
    const Message plan_message = read("ProbePlan");
    const ProbePlan* plan = plan_message.as<ProbePlan>();
    EXPECT_EQ(plan->level().has_value(), typed);
    EXPECT_EQ(reuse_level_of(*plan), ReuseLevel::Prefix);
    EXPECT_EQ(finish_reason_of(*plan), FinishReason::Stop);
    EXPECT_EQ(approximate_outcome_of(*plan), ApproximateOutcome::Blend);
    EXPECT_EQ(shadow_mode_of(*plan), ShadowMode::Blend);
    const Message job = read("PrefillJob");
    EXPECT_EQ(reuse_level_of(*job.as<PrefillJob>()), ReuseLevel::Prefix);
    const Message done = read("PrefillDone");
    EXPECT_EQ(reuse_level_of(*done.as<PrefillDone>()), ReuseLevel::Prefix);
    EXPECT_EQ(finish_reason_of(*done.as<PrefillDone>()), FinishReason::None);
    const Message batch = read("TokenBatch");
    EXPECT_EQ(finish_reason_of(*batch.as<TokenBatch>()->updates()->Get(0)), FinishReason::None);
    EXPECT_EQ(finish_reason_of(*batch.as<TokenBatch>()->updates()->Get(1)), FinishReason::Stop);
    const Message put = read("SnapshotPut");
    EXPECT_EQ(snapshot_kind_of(*put.as<SnapshotPut>()->entries()->Get(0)), SnapshotKind::Block);
  }
}

TEST(WireCompat, TheCurrentVersionCoversEveryMessageType) {
  std::string current = "v";
  current += std::to_string(kSchemaMajor);
  current += '.';
  current += std::to_string(kSchemaMinor);
  ASSERT_TRUE(released().contains(current)) << "no golden buffers for the current version";
  for (const MessageType type : EnumValuesMessageType()) {
    const std::string stem = message_type_name(type);
    EXPECT_TRUE(released().at(current).contains(stem)) << stem;
    EXPECT_TRUE(fs::is_regular_file(kCompatDir / current / (stem + ".bin"))) << stem;
  }
}

}  // namespace
}  // namespace moeline::wire
