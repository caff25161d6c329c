// Structured output's cost per token: the time to mask a real vocabulary with a JSON Schema's
// grammar (model/token_constraint.h) at every step of a document, split by where the step is
// (inside a string, where plain text is taken without a walk, or between tokens of the
// structure), and the one-off cost of reading the vocabulary's bytes. Prints one JSON object.
//   moeline_structured_output_bench --tokenizer FILE [--repeat N] [--reasoning]
// The document is teacher-forced: its own tokens (the tokenizer's encoding) are accepted one by
// one after each mask, as a model that answered it would have them drawn. With --reasoning the
// answer first thinks in a <think> block (ReasoningBlock::kMayOpen, as a thinking model's
// structured output is asked), whose steps are reported apart: inside the block the mask takes
// text without '<' from a precomputed mask and walks only the tokens that could start or
// continue "</think>".
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/json_grammar.h"
#include "model/token_constraint.h"
#include "tokenizer/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

const char* kSchema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "email": {"type": ["string", "null"]},
    "address": {"type": "object", "properties": {"street": {"type": "string"},
                "city": {"enum": ["Paris", "Rome", "Oslo", "Lisbon"]}, "zip": {"type": "string"}},
                "required": ["street", "city"]},
    "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
    "summary": {"type": "string", "maxLength": 400}
  },
  "required": ["name", "age", "address", "summary"]
})";

// Reasoning with the byte the mask works hardest on there: '<' (a comparison, a tag, a partial
// "</th..."), each of which makes the next step walk the tokens that could go on with the marker.
const char* kReasoning =
    "<think>\nThe user wants a JSON record for Ada Lovelace. Her age at death was 36, so age < 40 "
    "holds; the address is 12 St James's Square, and the city must be one of the enum's values "
    "<Paris|Rome|Oslo|Lisbon>, so I pick Paris. Scores: at most 8 numbers, e.g. 9.5 and 7.25 "
    "(a <= b is not required). The summary stays under 400 characters; a </th is not the end "
    "of this block, only the whole marker is.\n</think>\n\n";

const char* kDocument =
    R"({"name": "Ada Lovelace", "age": 36, "email": null, "address": {"street": "12 St James's )"
    R"(Square", "city": "Paris", "zip": "SW1Y 4JH"}, "scores": [9.5, 7.25, -3e2], "summary": )"
    R"("Mathematician and writer, chiefly known for her work on Charles Babbage's proposed )"
    R"(mechanical general-purpose computer, the Analytical Engine. She was the first to )"
    R"(recognise that the machine had applications beyond pure calculation."})";

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  return values[static_cast<size_t>(p * static_cast<double>(values.size() - 1))];
}

nlohmann::json summary(const std::vector<double>& us) {
  double total = 0.0;
  for (double v : us) total += v;
  return {{"steps", us.size()},
          {"mean_us", us.empty() ? 0.0 : total / static_cast<double>(us.size())},
          {"p50_us", percentile(us, 0.5)},
          {"p99_us", percentile(us, 0.99)},
          {"max_us", percentile(us, 1.0)}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer_path;
  int repeat = 3;
  bool reasoning = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--reasoning")
      reasoning = true;
    else if (flag == "--tokenizer" && i + 1 < argc)
      tokenizer_path = argv[++i];
    else if (flag == "--repeat" && i + 1 < argc)
      repeat = std::max(1, std::stoi(argv[++i]));
    else {
      tokenizer_path.clear();  // an unknown flag: the usage below
      break;
    }
  }
  if (tokenizer_path.empty()) {
    std::cerr
        << "usage: moeline_structured_output_bench --tokenizer FILE [--repeat N] [--reasoning]\n";
    return 2;
  }
  auto tokenizer = moeline::tokenizer::Tokenizer::load(tokenizer_path);
  if (!tokenizer) {
    std::cerr << tokenizer.error().message << "\n";
    return 1;
  }
  const auto vocab = static_cast<int64_t>(tokenizer->vocab_size());
  const auto build_start = Clock::now();
  const auto vocabulary = moeline::model::TokenVocabulary::build(*tokenizer, vocab);
  const double build_ms =
      std::chrono::duration<double, std::milli>(Clock::now() - build_start).count();
  auto grammar = moeline::model::JsonGrammar::compile(kSchema);
  if (!grammar) {
    std::cerr << grammar.error().message << "\n";
    return 1;
  }
  moeline::tokenizer::EncodeOptions options;
  options.add_special_tokens = false;
  const std::string answer = reasoning ? std::string(kReasoning) + kDocument : kDocument;
  auto ids = tokenizer->encode(answer, options);
  if (!ids) {
    std::cerr << ids.error().message << "\n";
    return 1;
  }
  int32_t end_token = 0;
  for (int32_t id = 0; id < vocab; ++id)
    if (tokenizer->is_special(id)) {
      end_token = id;
      break;
    }

  const auto block =
      reasoning ? moeline::model::ReasoningBlock::kMayOpen : moeline::model::ReasoningBlock::kNone;
  std::vector<double> in_reasoning, in_string, structural, all;
  std::vector<float> logits(static_cast<size_t>(vocab));
  bool complete = false;
  for (int r = 0; r < repeat; ++r) {
    moeline::model::TokenConstraint constraint(vocabulary, *grammar, {end_token}, block);
    moeline::model::JsonMatcher matcher(*grammar, block);
    for (int32_t id : *ids) {
      std::fill(logits.begin(), logits.end(), 0.0f);
      const bool reasoning_step = matcher.reasoning_text().has_value();
      const bool string_step = matcher.plain_string_room().has_value();
      const auto start = Clock::now();
      constraint.mask(logits.data(), vocab);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      if (!std::isfinite(logits[static_cast<size_t>(id)])) {
        std::cerr << "the document's token " << id << " '" << vocabulary->bytes(id)
                  << "' was masked\n";
        return 1;
      }
      (reasoning_step ? in_reasoning : string_step ? in_string : structural).push_back(us);
      all.push_back(us);
      constraint.accept(id);
      matcher.advance(vocabulary->bytes(id));
    }
    complete = constraint.complete();
  }
  nlohmann::json out = {{"vocab", vocab},
                        {"vocabulary_build_ms", build_ms},
                        {"document_tokens", ids->size()},
                        {"repeat", repeat},
                        {"document_complete", complete},
                        {"all", summary(all)},
                        {"in_reasoning", summary(in_reasoning)},
                        {"in_string", summary(in_string)},
                        {"structural", summary(structural)}};
  std::cout << out.dump() << "\n";
  return complete ? 0 : 1;
}
