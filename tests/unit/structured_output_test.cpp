// Structured output at the level of tokens (model/token_constraint.h): the mask agrees with the
// byte grammar token by token, and sampled answers under random logits are complete documents.
// The byte grammar itself is checked against Python's jsonschema by tests/reference
// (test_json_grammar.py).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>

#include "model/json_grammar.h"
#include "model/sampling.h"
#include "model/token_constraint.h"
#include "tokenizer/tokenizer.h"

namespace moeline::model {
namespace {

namespace fs = std::filesystem;

const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a b", "ü", "x\"y"]}, "maxItems": 2},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "age", "ok"]
})";

struct Vocab {
  std::string name;
  fs::path tokenizer;
};

void PrintTo(const Vocab& vocab, std::ostream* out) {
  *out << vocab.name;
}

class StructuredOutput : public ::testing::TestWithParam<Vocab> {
 protected:
  void SetUp() override {
    if (!fs::exists(GetParam().tokenizer)) GTEST_SKIP() << GetParam().tokenizer << " is absent";
    auto tokenizer = tokenizer::Tokenizer::load(GetParam().tokenizer.string());
    ASSERT_TRUE(tokenizer) << tokenizer.error().message;
    tokenizer_ = std::make_unique<tokenizer::Tokenizer>(std::move(*tokenizer));
    vocab_ = static_cast<int64_t>(tokenizer_->vocab_size());
    vocabulary_ = TokenVocabulary::build(*tokenizer_, vocab_);
    for (int32_t id = 0; id < vocab_ && end_ < 0; ++id)
      if (tokenizer_->is_special(id)) end_ = id;
    ASSERT_GE(end_, 0) << "the tokenizer has no special token to end with";
    auto grammar = JsonGrammar::compile(kSchema);
    ASSERT_TRUE(grammar) << grammar.error().message;
    grammar_ = *grammar;
  }

  // The mask `logits` came out of allows exactly the tokens `matcher` takes next (each tried), and
  // the end token exactly where it can end; counts the allowed ones.
  void expect_mask_is_the_matcher(const std::vector<float>& logits, const JsonMatcher& matcher,
                                  int step, int* allowed_count) const {
    *allowed_count = 0;
    for (int32_t id = 0; id < vocab_; ++id) {
      const bool allowed = std::isfinite(logits[static_cast<size_t>(id)]);
      bool expected = false;
      if (id == end_) {
        expected = matcher.can_end();
      } else if (!vocabulary_->bytes(id).empty()) {
        JsonMatcher probe = matcher;
        expected = probe.advance(vocabulary_->bytes(id));
      }
      ASSERT_EQ(allowed, expected)
          << "token " << id << " '" << vocabulary_->bytes(id) << "' at step " << step;
      *allowed_count += allowed;
    }
  }

  std::unique_ptr<tokenizer::Tokenizer> tokenizer_;
  int64_t vocab_ = 0;
  int32_t end_ = -1;  // a special token, standing for end-of-sequence
  std::shared_ptr<const TokenVocabulary> vocabulary_;
  std::shared_ptr<const JsonGrammar> grammar_;
};

// A token's text is what it adds after other text: decoding the answer token by token gives the
// whole answer's text.
TEST_P(StructuredOutput, TokenTextsJoinToTheDecodedText) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int32_t> ids;
    std::string joined;
    while (ids.size() < 12) {
      const auto id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab_));
      const std::string& bytes = vocabulary_->bytes(id);
      if (bytes.empty()) continue;
      ids.insert(ids.begin(), id);
      joined = bytes + joined;
    }
    // Put a plain first token in front, as the answer follows the prompt.
    const int32_t anchor = *tokenizer_->token_to_id("a");
    ids.insert(ids.begin(), anchor);
    auto decoded = tokenizer_->decode(ids);
    ASSERT_TRUE(decoded);
    const std::string prefix = *tokenizer_->decode({anchor});
    ASSERT_TRUE(decoded->starts_with(prefix));
    if (decoded->find("\xEF\xBF\xBD") != std::string::npos) continue;  // a split character
    EXPECT_EQ(decoded->substr(prefix.size()), joined);
  }
}

// Along sampled answers, the mask allows exactly the tokens whose text the grammar takes next
// (every token checked one by one), and the end tokens exactly where the document can end.
TEST_P(StructuredOutput, TheMaskIsTheGrammarTokenByToken) {
  const std::vector<int32_t> end = {end_};
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(static_cast<size_t>(vocab_));
  int checked_steps = 0, string_steps = 0;
  for (int answer = 0; answer < 4; ++answer) {
    TokenConstraint constraint(vocabulary_, grammar_, end);
    JsonMatcher matcher(grammar_);
    for (int step = 0; step < 60; ++step) {
      for (float& logit : logits) logit = normal(rng);
      if (matcher.plain_string_room()) ++string_steps;
      constraint.mask(logits.data(), vocab_);
      int allowed_count = 0;
      ASSERT_NO_FATAL_FAILURE(expect_mask_is_the_matcher(logits, matcher, step, &allowed_count));
      ASSERT_GT(allowed_count, 0);
      ++checked_steps;
      // Draw among the allowed, avoiding the end so that the answer goes deep.
      std::vector<int32_t> choices;
      for (int32_t id = 0; id < vocab_; ++id)
        if (id != end_ && std::isfinite(logits[static_cast<size_t>(id)])) choices.push_back(id);
      if (choices.empty()) break;  // the document is complete and nothing more can come
      const int32_t chosen = choices[rng() % choices.size()];
      constraint.accept(chosen);
      ASSERT_TRUE(matcher.advance(vocabulary_->bytes(chosen)));
    }
  }
  EXPECT_GE(checked_steps, 100);
  EXPECT_GT(string_steps, 0) << "no step was inside a string: the plain-text path went unchecked";
}

// On a model that thinks: through a reasoning block (any text, '<' and JSON-looking text
// included) and then the document, the mask allows exactly the tokens the matcher takes next, the
// end tokens only once the document is complete; the reasoning is taken in the longest tokens
// that write it, the document drawn at random.
TEST_P(StructuredOutput, AfterTheReasoningTheMaskIsTheGrammar) {
  const std::vector<int32_t> end = {end_};
  std::mt19937_64 rng(17);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> logits(static_cast<size_t>(vocab_));
  int reasoning_steps = 0, document_steps = 0;
  for (const ReasoningBlock reasoning : {ReasoningBlock::kMayOpen, ReasoningBlock::kOpen}) {
    TokenConstraint constraint(vocabulary_, grammar_, end, reasoning);
    JsonMatcher matcher(grammar_, reasoning);
    std::string thought = "Let me see: a < b, </b> and {\"x\": 1} </thin k>.</think>\n";
    if (reasoning == ReasoningBlock::kMayOpen) thought = "\n<think>" + thought;
    for (int step = 0; step < 200; ++step) {
      for (float& logit : logits) logit = normal(rng);
      const bool in_reasoning = !thought.empty();
      constraint.mask(logits.data(), vocab_);
      int allowed_count = 0;
      ASSERT_NO_FATAL_FAILURE(expect_mask_is_the_matcher(logits, matcher, step, &allowed_count));
      int32_t chosen = -1;
      if (in_reasoning) {  // the longest token that writes the thought on
        ++reasoning_steps;
        EXPECT_FALSE(matcher.can_end()) << "the document cannot end inside the reasoning";
        size_t longest = 0;
        for (int32_t id = 0; id < vocab_; ++id) {
          const std::string& bytes = vocabulary_->bytes(id);
          if (!bytes.empty() && bytes.size() > longest && thought.starts_with(bytes))
            chosen = id, longest = bytes.size();
        }
        ASSERT_GE(chosen, 0) << "no token writes " << thought;
        ASSERT_TRUE(std::isfinite(logits[static_cast<size_t>(chosen)])) << thought;
        thought.erase(0, longest);
      } else {
        ++document_steps;
        std::vector<int32_t> choices;
        for (int32_t id = 0; id < vocab_; ++id)
          if (id != end_ && std::isfinite(logits[static_cast<size_t>(id)])) choices.push_back(id);
        if (choices.empty() || document_steps > 40) break;
        chosen = choices[rng() % choices.size()];
      }
      constraint.accept(chosen);
      ASSERT_TRUE(matcher.advance(vocabulary_->bytes(chosen)));
    }
  }
  EXPECT_GT(reasoning_steps, 10);
  EXPECT_GT(document_steps, 20);
}

// Sampling at a high temperature over random logits with the constraint: every answer that ends
// is a document the schema accepts (checked here on the parsed value), and greedy answers too.
TEST_P(StructuredOutput, SampledAnswersAreCompleteDocuments) {
  const std::vector<int32_t> eos = {end_};
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(vocab_));
  int ended = 0;
  for (int answer = 0; answer < 40; ++answer) {
    SamplingParams params;
    params.temperature = answer % 4 == 0 ? 0.0 : 1.5;
    params.seed = static_cast<uint64_t>(answer);
    params.structured = model::StructuredOutput::kJsonSchema;
    params.json_schema = kSchema;
    Sampler sampler(params);
    sampler.constrain(std::make_shared<TokenConstraint>(vocabulary_, grammar_, eos));
    std::vector<int32_t> ids;
    bool stopped = false;
    for (int step = 0; step < 400 && !stopped; ++step) {
      for (float& logit : logits) logit = normal(rng);
      // Lean towards ending, as a model that has said what it had to would.
      logits[static_cast<size_t>(end_)] += 4.0f;
      const int32_t token = sampler.sample(logits.data(), vocab_);
      if (token == eos[0])
        stopped = true;
      else
        ids.push_back(token);
    }
    if (!stopped) continue;
    ++ended;
    std::string text;
    for (int32_t id : ids) text += vocabulary_->bytes(id);
    const auto value = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(value.is_discarded()) << text;
    ASSERT_TRUE(value.is_object()) << text;
    EXPECT_TRUE(value.contains("name") && value["name"].is_string()) << text;
    EXPECT_LE(value["name"].get<std::string>().size(), 8u * 4) << text;
    EXPECT_TRUE(value.contains("age") && value["age"].is_number_integer()) << text;
    EXPECT_TRUE(value.contains("ok") && value["ok"].is_boolean()) << text;
    if (value.contains("tags")) {
      ASSERT_TRUE(value["tags"].is_array()) << text;
      EXPECT_LE(value["tags"].size(), 2u) << text;
      for (const auto& tag : value["tags"])
        EXPECT_TRUE(tag == "a b" || tag == "ü" || tag == "x\"y") << text;
    }
    for (const auto& [key, unused] : value.items())
      EXPECT_TRUE(key == "name" || key == "age" || key == "tags" || key == "ok") << text;
  }
  EXPECT_GE(ended, 30) << "most answers should end within 400 tokens";
}

// A stop token that is also text ("}" here) would end the answer wherever it is drawn: it is
// offered only where the document is complete, though the grammar could take its text.
TEST_P(StructuredOutput, AStopTokenThatIsTextOnlyEndsACompleteDocument) {
  const std::optional<int32_t> brace = tokenizer_->token_to_id("}");
  if (!brace) GTEST_SKIP() << "no token for '}'";
  auto grammar = JsonGrammar::compile(R"({"type": "object", "properties": {"a": {"type": "object"}},
                                          "required": ["a"]})");
  ASSERT_TRUE(grammar) << grammar.error().message;
  TokenConstraint constraint(vocabulary_, *grammar, {*brace});
  JsonMatcher matcher(*grammar);
  tokenizer::EncodeOptions options;
  options.add_special_tokens = false;
  auto ids = tokenizer_->encode("{\"a\": {", options);
  ASSERT_TRUE(ids);
  std::vector<float> logits(static_cast<size_t>(vocab_));
  for (int32_t id : *ids) {
    std::fill(logits.begin(), logits.end(), 0.0f);
    constraint.mask(logits.data(), vocab_);
    ASSERT_TRUE(std::isfinite(logits[static_cast<size_t>(id)])) << vocabulary_->bytes(id);
    constraint.accept(id);
    ASSERT_TRUE(matcher.advance(vocabulary_->bytes(id)));
  }
  ASSERT_TRUE(JsonMatcher(matcher).advance("}")) << "the grammar takes '}' here";
  std::fill(logits.begin(), logits.end(), 0.0f);
  constraint.mask(logits.data(), vocab_);
  EXPECT_FALSE(std::isfinite(logits[static_cast<size_t>(*brace)]));
}

INSTANTIATE_TEST_SUITE_P(
    Tokenizers, StructuredOutput,
    ::testing::Values(Vocab{"byte_level_bpe", fs::path(MOELINE_DEMO_MODEL) / "tokenizer.json"},
                      Vocab{"sentencepiece_bpe",
                            fs::path(MOELINE_TEST_MODELS) / "mixtral-f32" / "tokenizer.json"}),
    [](const auto& param_info) { return param_info.param.name; });

// A forced tool call: the document between Qwen's tags, whitespace allowed inside them, and the
// end only after the closing tag.
TEST(JsonGrammarAround, TheDocumentBetweenTheTags) {
  auto grammar = JsonGrammar::compile(R"({"type": "object", "properties": {"name": {"const": "f"}},
                                          "required": ["name"]})",
                                      kHermesToolCallOpen, kHermesToolCallClose);
  ASSERT_TRUE(grammar) << grammar.error().message;
  auto accepts = [&](std::string_view text) {
    JsonMatcher matcher(*grammar);
    return matcher.advance(text) && matcher.can_end();
  };
  EXPECT_TRUE(accepts("<tool_call>\n{\"name\": \"f\"}\n</tool_call>"));
  EXPECT_TRUE(accepts("<tool_call>{\"name\":\"f\"}</tool_call>"));
  EXPECT_FALSE(accepts("{\"name\": \"f\"}"));
  EXPECT_FALSE(accepts("<tool_call>\n{\"name\": \"f\"}\n"));
  EXPECT_FALSE(accepts("<tool_call>\n{\"name\": \"g\"}\n</tool_call>"));
  EXPECT_FALSE(accepts("<tool_call>\n{\"name\": \"f\"}\n</tool_call> "));
  EXPECT_FALSE(accepts(" <tool_call>{\"name\": \"f\"}</tool_call>"));
  JsonMatcher matcher(*grammar);
  ASSERT_TRUE(matcher.advance("<tool_call>\n{\"name\": \"f\"}\n</tool_"));
  EXPECT_FALSE(matcher.can_end());
  EXPECT_FALSE(matcher.advance("x"));
  EXPECT_TRUE(matcher.advance("call>"));
  EXPECT_TRUE(matcher.can_end());
}

// The reasoning block before the document: any text up to the first "</think>" (a '<', a
// partial marker, JSON-looking text are reasoning), then whitespace and the document; the block
// opened by the answer itself (kMayOpen, which also takes the document at once) or already open.
TEST(JsonGrammarAround, TheDocumentAfterTheReasoning) {
  auto grammar =
      JsonGrammar::compile(R"({"type": "object", "properties": {"a": {"type": "integer"}},
                                          "required": ["a"]})");
  ASSERT_TRUE(grammar) << grammar.error().message;
  auto accepts = [&](ReasoningBlock reasoning, std::string_view text) {
    JsonMatcher matcher(*grammar, reasoning);
    return matcher.advance(text) && matcher.can_end();
  };
  using enum ReasoningBlock;
  EXPECT_TRUE(accepts(kOpen, "a < b, {\"a\": 2} </thi </think>\n{\"a\": 1}"));
  EXPECT_TRUE(accepts(kOpen, "</think>{\"a\": 1}"));
  EXPECT_TRUE(accepts(kOpen, "a <</think>\n\n{\"a\": 1}")) << "a '<' before the marker's";
  EXPECT_FALSE(accepts(kOpen, "a</think>\n\n\n\n\n{\"a\": 1}")) << "at most 4 bytes between";
  EXPECT_FALSE(accepts(kOpen, "{\"a\": 1}")) << "still reasoning";
  EXPECT_FALSE(accepts(kOpen, "x</think>{\"a\": 1}</think>"));
  EXPECT_TRUE(accepts(kMayOpen, "<think>why</think>\n{\"a\": 1}"));
  EXPECT_TRUE(accepts(kMayOpen, "\n<think>why</think>\n{\"a\": 1}")) << "GLM-4.5's answer";
  EXPECT_FALSE(accepts(kMayOpen, "\n\n\n\n\n<think>why</think>{\"a\": 1}"));
  EXPECT_TRUE(accepts(kMayOpen, "{\"a\": 1}"));
  EXPECT_FALSE(accepts(kMayOpen, "why</think>{\"a\": 1}"));
  EXPECT_FALSE(accepts(kNone, "<think>why</think>{\"a\": 1}"));
  JsonMatcher matcher(*grammar, kOpen);
  ASSERT_TRUE(matcher.advance("a"));
  EXPECT_EQ(matcher.reasoning_text(), '\0');
  ASSERT_TRUE(matcher.advance("</th"));
  EXPECT_EQ(matcher.reasoning_text(), 'i') << "inside the marker";
  EXPECT_FALSE(matcher.can_end());
  ASSERT_TRUE(matcher.advance("ink>"));
  EXPECT_EQ(matcher.reasoning_text(), std::nullopt);
  EXPECT_FALSE(matcher.advance("x")) << "after the block, only the document";
  // A forced tool call after the reasoning: the tags around the document.
  auto call =
      JsonGrammar::compile(R"({"type": "object"})", kHermesToolCallOpen, kHermesToolCallClose);
  ASSERT_TRUE(call);
  JsonMatcher tool(*call, kMayOpen);
  EXPECT_TRUE(tool.advance("<think>ok</think>\n<tool_call>{}</tool_call>") && tool.can_end());
  JsonMatcher direct(*call, kMayOpen);
  EXPECT_TRUE(direct.advance("<tool_call>{}</tool_call>") && direct.can_end());
}

// What a request may ask for is checked where it enters: the gateway's validate() refuses a
// schema outside the subset by name, and a schema without the kind that uses it.
TEST(StructuredOutputParams, ValidateRefusesWhatCannotBeServed) {
  SamplingParams params;
  params.structured = model::StructuredOutput::kJsonSchema;
  params.json_schema = R"({"type": "string", "pattern": "^a+$"})";
  Status status = params.validate();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.error().message.find("pattern"), std::string::npos) << status.error().message;
  params.json_schema = "{not json";
  EXPECT_FALSE(params.validate().ok());
  params.json_schema = std::string(kMaxJsonSchemaBytes + 1, ' ');
  EXPECT_FALSE(params.validate().ok());
  params.json_schema = R"({"type": "integer"})";
  EXPECT_TRUE(params.validate().ok());
  params.structured = model::StructuredOutput::kNone;
  EXPECT_FALSE(params.validate().ok());
  params.structured = static_cast<model::StructuredOutput>(7);
  params.json_schema.clear();
  EXPECT_FALSE(params.validate().ok());
  params.structured = model::StructuredOutput::kJsonObject;
  EXPECT_TRUE(params.validate().ok());
  params.structured = model::StructuredOutput::kHermesToolCall;
  EXPECT_FALSE(params.validate().ok()) << "a tool call needs its schema";
  params.json_schema = R"({"type": "object"})";
  EXPECT_TRUE(params.validate().ok());
  params.reasoning = ReasoningBlock::kOpen;
  EXPECT_TRUE(params.validate().ok());
  params.reasoning = static_cast<ReasoningBlock>(3);
  EXPECT_FALSE(params.validate().ok());
  params.reasoning = ReasoningBlock::kMayOpen;
  params.structured = model::StructuredOutput::kNone;
  params.json_schema.clear();
  EXPECT_FALSE(params.validate().ok()) << "a reasoning block without a grammar";
}

}  // namespace
}  // namespace moeline::model
