#include "model/model_text.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "model/gguf.h"

namespace moeline::model {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// llama.cpp's llama_token_type.
enum TokenType : int64_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6
};

// The pre-tokenizer regexes of the families' tokenizer.json files, keyed by the name llama.cpp's
// converter writes as tokenizer.ggml.pre.
constexpr const char* kQwen2Split =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLlama3Split =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kDeepseekV3Splits[] = {
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./"
    ":;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| "
    "?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
};

json split(const char* regex) {
  return {{"type", "Split"},
          {"pattern", {{"Regex", regex}}},
          {"behavior", "Isolated"},
          {"invert", false}};
}

json byte_level(bool use_regex) {
  return {{"type", "ByteLevel"},
          {"add_prefix_space", false},
          {"trim_offsets", false},
          {"use_regex", use_regex}};
}

// (normalizer, pre_tokenizer) of a byte-level BPE family.
std::pair<json, json> byte_level_family(const std::string& pre, const std::string& file) {
  if (pre == "qwen2" || pre == "deepseek-r1-qwen")
    return {json{{"type", "NFC"}},
            json{{"type", "Sequence"},
                 {"pretokenizers", json::array({split(kQwen2Split), byte_level(false)})}}};
  // llama.cpp's chatglm4 expression ("glm4": GLM-4.5) is Llama 3's, its (?i:...) spelt out.
  if (pre == "llama-bpe" || pre == "llama3" || pre == "glm4" || pre == "chatglm-bpe")
    return {nullptr,
            json{{"type", "Sequence"},
                 {"pretokenizers", json::array({split(kLlama3Split), byte_level(false)})}}};
  if (pre == "deepseek-v3") {
    json steps = json::array();
    for (const char* regex : kDeepseekV3Splits) steps.push_back(split(regex));
    steps.push_back(byte_level(false));
    return {nullptr, json{{"type", "Sequence"}, {"pretokenizers", std::move(steps)}}};
  }
  // llama.cpp splits "olmo" (GPT-NeoX's vocabulary) with GPT-2's expression.
  if (pre == "gpt-2" || pre == "olmo" || pre == "default" || pre.empty())
    return {nullptr, byte_level(true)};
  throw StatusError(file + ": GGUF metadata 'tokenizer.ggml.pre' is \"" + pre +
                    "\", which moeline does not map to a pre-tokenizer (supported: qwen2, "
                    "deepseek-r1-qwen, deepseek-v3, llama-bpe, glm4, gpt-2, olmo, default)");
}

// The merges a SentencePiece vocabulary implies, as transformers' SentencePieceExtractor derives
// them: every split of a piece into two pieces of the vocabulary, those of one piece ordered by
// the pieces' ids, all ordered (stably) by the merged piece's score, highest first.
json merges_from_scores(const std::vector<std::string>& tokens, const std::vector<double>& scores,
                        const std::vector<int64_t>& types) {
  std::unordered_map<std::string_view, int64_t> ids;
  for (size_t i = 0; i < tokens.size(); ++i) ids.emplace(tokens[i], static_cast<int64_t>(i));
  struct Merge {
    int64_t left, right, merged;
  };
  std::vector<Merge> merges;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (types[i] != kNormal && types[i] != kUserDefined) continue;
    const std::string_view piece = tokens[i];
    std::vector<Merge> local;
    for (size_t at = 1; at < piece.size(); ++at) {
      if ((static_cast<unsigned char>(piece[at]) & 0xC0) == 0x80) continue;  // inside a character
      const auto left = ids.find(piece.substr(0, at));
      const auto right = ids.find(piece.substr(at));
      if (left != ids.end() && right != ids.end())
        local.push_back({left->second, right->second, static_cast<int64_t>(i)});
    }
    std::sort(local.begin(), local.end(), [](const Merge& a, const Merge& b) {
      return std::pair(a.left, a.right) < std::pair(b.left, b.right);
    });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  std::stable_sort(merges.begin(), merges.end(), [&](const Merge& a, const Merge& b) {
    return scores[static_cast<size_t>(a.merged)] > scores[static_cast<size_t>(b.merged)];
  });
  json out = json::array();
  for (const Merge& m : merges)
    out.push_back(tokens[static_cast<size_t>(m.left)] + " " + tokens[static_cast<size_t>(m.right)]);
  return out;
}

template <typename T>
std::vector<T> array_of(const GgufFile& gguf, const std::string& key, bool required) {
  const json& value = gguf.value(key);
  const std::string file = gguf.path().filename().string();
  if (value.is_null()) {
    if (required) throw StatusError(file + ": GGUF metadata '" + key + "' is missing");
    return {};
  }
  try {
    return value.get<std::vector<T>>();
  } catch (const json::exception&) {
    throw StatusError(file + ": GGUF metadata '" + key + "' is not an array of the expected type");
  }
}

std::optional<int64_t> id_of(const GgufFile& gguf, const char* key, size_t vocab) {
  const json& value = gguf.value(std::string("tokenizer.ggml.") + key);
  if (!value.is_number_integer()) return std::nullopt;
  const int64_t id = value.get<int64_t>();
  if (id < 0 || static_cast<size_t>(id) >= vocab)
    throw StatusError(gguf.path().filename().string() + ": GGUF metadata 'tokenizer.ggml." + key +
                      "' is " + std::to_string(id) + ", outside the vocabulary of " +
                      std::to_string(vocab));
  return id;
}

json bos_post_processor(const std::string& bos, int64_t bos_id) {
  return {{"type", "TemplateProcessing"},
          {"single", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                  {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
          {"pair", json::array({{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
                                {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
          {"special_tokens", {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}}}}};
}

std::string file_name(const fs::path& path) {
  return path.filename().string();
}

}  // namespace

json gguf_tokenizer_json(const GgufFile& gguf) {
  const std::string file = file_name(gguf.path());
  const json& model_name = gguf.value("tokenizer.ggml.model");
  if (!model_name.is_string())
    throw StatusError(file + ": GGUF metadata 'tokenizer.ggml.model' is missing (no tokenizer)");
  const std::string kind = model_name.get<std::string>();
  if (kind != "gpt2" && kind != "llama")
    throw StatusError(file + ": tokenizer model \"" + kind +
                      "\" is not supported (gpt2: byte-level BPE, llama: SentencePiece BPE)");
  const auto tokens = array_of<std::string>(gguf, "tokenizer.ggml.tokens", true);
  auto types = array_of<int64_t>(gguf, "tokenizer.ggml.token_type", false);
  if (types.empty()) types.assign(tokens.size(), kNormal);
  if (types.size() != tokens.size())
    throw StatusError(file + ": GGUF metadata 'tokenizer.ggml.token_type' has " +
                      std::to_string(types.size()) + " entries for " +
                      std::to_string(tokens.size()) + " tokens");
  const bool spm = kind == "llama";

  json vocab = json::object();
  json added = json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    const bool special = types[i] == kControl || types[i] == kUserDefined;
    vocab[tokens[i]] = i;
    if (special || (spm && types[i] == kUnknown))
      added.push_back({{"id", i},
                       {"content", tokens[i]},
                       {"single_word", false},
                       {"lstrip", false},
                       {"rstrip", false},
                       {"normalized", false},
                       {"special", types[i] != kUserDefined}});
  }
  if (vocab.size() != tokens.size())
    throw StatusError(file + ": GGUF metadata 'tokenizer.ggml.tokens' repeats a token");

  json doc = {{"version", "1.0"}, {"truncation", nullptr}, {"padding", nullptr}};
  doc["added_tokens"] = std::move(added);
  const auto bos = id_of(gguf, "bos_token_id", tokens.size());
  const json& add_bos_value = gguf.value("tokenizer.ggml.add_bos_token");
  const bool add_bos = add_bos_value.is_boolean() ? add_bos_value.get<bool>() : spm;
  json post =
      add_bos && bos ? bos_post_processor(tokens[static_cast<size_t>(*bos)], *bos) : json(nullptr);

  json model = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false}};
  if (spm) {
    const auto scores = array_of<double>(gguf, "tokenizer.ggml.scores", true);
    if (scores.size() != tokens.size())
      throw StatusError(file + ": GGUF metadata 'tokenizer.ggml.scores' has " +
                        std::to_string(scores.size()) + " entries for " +
                        std::to_string(tokens.size()) + " tokens");
    const std::string marker = "\xE2\x96\x81";  // U+2581, SentencePiece's space
    const auto unk = id_of(gguf, "unknown_token_id", tokens.size());
    if (unk) model["unk_token"] = tokens[static_cast<size_t>(*unk)];
    model["fuse_unk"] = true;
    model["byte_fallback"] = true;
    model["merges"] = merges_from_scores(tokens, scores, types);
    const json& prefix = gguf.value("tokenizer.ggml.add_space_prefix");
    json normalizers = json::array();
    if (!prefix.is_boolean() || prefix.get<bool>())
      normalizers.push_back({{"type", "Prepend"}, {"prepend", marker}});
    normalizers.push_back(
        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", marker}});
    doc["normalizer"] = {{"type", "Sequence"}, {"normalizers", std::move(normalizers)}};
    doc["pre_tokenizer"] = nullptr;
    doc["decoder"] = {
        {"type", "Sequence"},
        {"decoders",
         json::array({{{"type", "Replace"}, {"pattern", {{"String", marker}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  } else {
    model["merges"] = array_of<std::string>(gguf, "tokenizer.ggml.merges", true);
    const json& pre = gguf.value("tokenizer.ggml.pre");
    auto [normalizer, pre_tokenizer] =
        byte_level_family(pre.is_string() ? pre.get<std::string>() : "", file);
    // Llama 3's tokenizer.json takes a whole word from the vocabulary before merging.
    if (pre.is_string() && (pre == "llama-bpe" || pre == "llama3")) model["ignore_merges"] = true;
    doc["normalizer"] = std::move(normalizer);
    doc["pre_tokenizer"] = std::move(pre_tokenizer);
    doc["decoder"] = byte_level(false);
    if (post.is_null()) post = byte_level(false);
  }
  model["vocab"] = std::move(vocab);
  doc["post_processor"] = std::move(post);
  doc["model"] = std::move(model);
  return doc;
}

bool is_gguf_model(const fs::path& model) {
  std::error_code ec;
  return fs::is_regular_file(model, ec);
}

Expected<Tokenizer> load_model_tokenizer(const fs::path& model) {
  if (!is_gguf_model(model)) return Tokenizer::load((model / "tokenizer.json").string());
  try {
    const GgufFile gguf = GgufFile::open(model);
    return Tokenizer::from_json(gguf_tokenizer_json(gguf).dump(), file_name(model));
  } catch (const StatusError& e) {
    return e.error();
  }
}

Expected<ChatTemplate> load_model_chat_template(const fs::path& model) {
  if (!is_gguf_model(model)) return ChatTemplate::load((model / "tokenizer_config.json").string());
  try {
    const GgufFile gguf = GgufFile::open(model);
    const auto tokens = array_of<std::string>(gguf, "tokenizer.ggml.tokens", true);
    auto token_text = [&](const char* key) {
      const auto id = id_of(gguf, key, tokens.size());
      return id ? tokens[static_cast<size_t>(*id)] : std::string();
    };
    const std::string bos = token_text("bos_token_id"), eos = token_text("eos_token_id");
    const json& source = gguf.value("tokenizer.chat_template");
    if (source.is_string()) {
      auto chat = ChatTemplate::from_template(source.get<std::string>(), bos, eos);
      if (!chat.ok()) return Error{file_name(model) + ": " + chat.error().message};
      return chat;
    }
    const json& architecture = gguf.value("general.architecture");
    const std::pair<const char*, ChatTemplate::Format> families[] = {
        {"llama", ChatTemplate::Format::kMistral},
        {"qwen2moe", ChatTemplate::Format::kChatML},
        {"qwen3moe", ChatTemplate::Format::kQwen3},
        {"deepseek2", ChatTemplate::Format::kDeepSeekV3}};
    for (const auto& [name, format] : families)
      if (architecture == name) return ChatTemplate::builtin(format, bos, eos);
    return Error{file_name(model) +
                 ": has no tokenizer.chat_template (and its architecture has no "
                 "built-in chat format)"};
  } catch (const StatusError& e) {
    return e.error();
  }
}

}  // namespace moeline::model
