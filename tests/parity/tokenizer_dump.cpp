// moeline side of the tokenizer parity test: the same outputs as reference.js, from
// tokenizer/, plus the streaming detokenizer's pieces for every id sequence.
//   tokenizer_dump TOKENIZER_JSON|MODEL.gguf CASES_JSON REFERENCE_JSON > moeline.json
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "model/model_text.h"
#include "tokenizer/tokenizer.h"

using moeline::tokenizer::DecodeStream;
using moeline::tokenizer::Tokenizer;
using nlohmann::json;

namespace {

json read_json(const char* path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

std::string decode_or_error(const Tokenizer& t, const std::vector<int32_t>& ids, bool skip) {
  auto r = t.decode(ids, {.skip_special_tokens = skip});
  return r.ok() ? *r : "<error: " + r.error().message + ">";
}

json stream(const Tokenizer& t, const std::vector<int32_t>& ids, bool skip) {
  DecodeStream s(t, {.skip_special_tokens = skip});
  json pieces = json::array();
  for (int32_t id : ids) {
    auto p = s.step(id);
    pieces.push_back(p.ok() ? *p : "<error: " + p.error().message + ">");
  }
  auto rest = s.finish();
  pieces.push_back(rest.ok() ? *rest : "<error>");
  return pieces;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: tokenizer_dump TOKENIZER_JSON CASES_JSON REFERENCE_JSON\n";
    return 2;
  }
  // A GGUF's tokenizer is the one its metadata describes (model/model_text.h).
  const std::string path = argv[1];
  auto tokenizer =
      path.ends_with(".gguf") ? moeline::model::load_model_tokenizer(path) : Tokenizer::load(path);
  if (!tokenizer.ok()) {
    std::cerr << tokenizer.error().message << "\n";
    return 1;
  }
  const json cases = read_json(argv[2]);
  const json reference = read_json(argv[3]);
  json out = {{"encode", json::array()},        {"encode_no_special", json::array()},
              {"decode", json::array()},        {"decode_skip", json::array()},
              {"random_decode", json::array()}, {"random_decode_skip", json::array()},
              {"stream", json::array()}};
  for (const auto& text_json : cases["texts"]) {
    const std::string text = text_json.get<std::string>();
    auto with = tokenizer->encode(text, {.add_special_tokens = true});
    auto without = tokenizer->encode(text, {.add_special_tokens = false});
    if (!with.ok() || !without.ok()) {
      std::cerr << "encode failed: " << (with.ok() ? without.error() : with.error()).message
                << "\n";
      return 1;
    }
    out["encode"].push_back(*with);
    out["encode_no_special"].push_back(*without);
    out["decode"].push_back(decode_or_error(*tokenizer, *with, false));
    out["decode_skip"].push_back(decode_or_error(*tokenizer, *with, true));
    out["stream"].push_back(stream(*tokenizer, *with, false));
  }
  for (const auto& ids_json : reference["random_ids"]) {
    const auto ids = ids_json.get<std::vector<int32_t>>();
    out["random_decode"].push_back(decode_or_error(*tokenizer, ids, false));
    out["random_decode_skip"].push_back(decode_or_error(*tokenizer, ids, true));
    out["stream"].push_back(stream(*tokenizer, ids, false));
  }
  std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace);
  return 0;
}
