#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "tokenizer/components.h"
#include "tokenizer/factories.h"
#include "tokenizer/json_util.h"
#include "tokenizer/unicode.h"

namespace moeline::tokenizer {

using tok::Piece;

namespace {

struct AddedToken {
  std::int32_t id;
  std::string content;
  bool single_word, lstrip, rstrip, normalized, special;
};

// Leftmost-longest matching of added tokens (what the reference's Aho-Corasick automaton does), as
// a byte trie walked from each position whose first byte can start a token.
class TokenTrie {
 public:
  void insert(std::string_view key, std::int32_t token_index) {
    if (key.empty()) return;
    if (nodes_.empty()) nodes_.emplace_back();
    std::size_t node = 0;
    for (unsigned char b : key) {
      std::int32_t child = -1;
      for (const auto& [byte, next] : nodes_[node].children) {
        if (byte == b) child = next;
      }
      if (child < 0) {
        child = static_cast<std::int32_t>(nodes_.size());
        nodes_[node].children.emplace_back(b, child);
        nodes_.emplace_back();
      }
      node = static_cast<std::size_t>(child);
    }
    if (nodes_[node].token < 0) nodes_[node].token = token_index;  // the first of duplicates wins
    first_byte_[static_cast<unsigned char>(key[0])] = true;
  }
  bool empty() const { return nodes_.empty(); }

  // The next match at or after `from`: (begin, end, token index), or begin == npos.
  std::tuple<std::size_t, std::size_t, std::int32_t> find(std::string_view s,
                                                          std::size_t from) const {
    for (std::size_t i = from; i < s.size(); ++i) {
      if (!first_byte_[static_cast<unsigned char>(s[i])]) continue;
      std::size_t node = 0, best_end = 0;
      std::int32_t best = -1;
      for (std::size_t j = i; j < s.size(); ++j) {
        std::int32_t child = -1;
        for (const auto& [byte, next] : nodes_[node].children) {
          if (byte == static_cast<unsigned char>(s[j])) child = next;
        }
        if (child < 0) break;
        node = static_cast<std::size_t>(child);
        if (nodes_[node].token >= 0) {
          best = nodes_[node].token;
          best_end = j + 1;
        }
      }
      if (best >= 0) return {i, best_end, best};
    }
    return {std::string_view::npos, 0, -1};
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, std::int32_t>> children;
    std::int32_t token = -1;
  };
  std::vector<Node> nodes_;
  std::array<bool, 256> first_byte_{};
};

// A segment of input: text still to tokenize, or an added token already recognised.
struct Segment {
  Piece piece;
  std::int32_t token_id = -1;
};

}  // namespace

class TokenizerImpl {
 public:
  std::unique_ptr<tok::Normalizer> normalizer;
  std::unique_ptr<tok::PreTokenizer> pre_tokenizer;
  std::unique_ptr<tok::Bpe> model;
  std::unique_ptr<tok::PostProcessor> post_processor;
  std::unique_ptr<tok::Decoder> decoder;

  std::vector<AddedToken> added;
  std::unordered_map<std::int32_t, std::size_t> added_by_id;  // id -> index in `added`
  std::unordered_set<std::string> special_contents;
  TokenTrie raw_trie;         // tokens matched before normalisation
  TokenTrie normalized_trie;  // tokens matched on normalised text
  std::size_t vocab_size = 0;

  void split_added(Segment&& segment, const TokenTrie& trie, std::vector<Segment>& out) const;
  std::vector<std::int32_t> encode(std::string_view input, const EncodeOptions& options) const;
  std::optional<std::string> token_text(std::int32_t id) const;
};

namespace {

bool starts_with_word(std::string_view s) {
  if (s.empty()) return false;
  std::size_t i = 0;
  return text::is_word_char(text::next_code_point(s, i));
}
bool ends_with_word(std::string_view s) {
  return !s.empty() && text::is_word_char(text::last_code_point(s));
}
}  // namespace

void TokenizerImpl::split_added(Segment&& segment, const TokenTrie& trie,
                                std::vector<Segment>& out) const {
  const std::string_view s = segment.piece.text;
  if (trie.empty() || s.empty()) {
    out.push_back(std::move(segment));
    return;
  }
  const bool at_start = segment.piece.at_start;
  std::size_t start_offset = 0;
  std::size_t from = 0;
  while (true) {
    auto [begin, end, index] = trie.find(s, from);
    if (begin == std::string_view::npos) break;
    from = end;
    const AddedToken& token = added[static_cast<std::size_t>(index)];
    if (token.single_word) {
      const bool start_space = begin == 0 || !ends_with_word(s.substr(0, begin));
      const bool stop_space = end == s.size() || !starts_with_word(s.substr(end));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip)
      begin = std::max(text::trailing_white_space_start(s.substr(0, begin)), start_offset);
    if (token.rstrip) end += text::leading_white_space(s.substr(end));
    if (start_offset < begin) {
      out.push_back({{std::string(s.substr(start_offset, begin - start_offset)),
                      at_start && start_offset == 0},
                     -1});
    }
    out.push_back({{std::string(s.substr(begin, end - begin)), false}, token.id});
    start_offset = end;
  }
  if (start_offset != s.size()) {
    out.push_back({{std::string(s.substr(start_offset)), at_start && start_offset == 0}, -1});
  }
}

std::vector<std::int32_t> TokenizerImpl::encode(std::string_view input,
                                                const EncodeOptions& options) const {
  std::vector<Segment> raw;
  split_added({{std::string(input), true}, -1}, raw_trie, raw);

  std::vector<Segment> segments;
  segments.reserve(raw.size());
  for (Segment& seg : raw) {
    if (seg.token_id >= 0) {
      segments.push_back(std::move(seg));
      continue;
    }
    if (normalizer) normalizer->normalize(seg.piece.text);
    split_added(std::move(seg), normalized_trie, segments);
  }

  std::vector<std::int32_t> ids;
  ids.reserve(input.size() / 3 + 8);
  std::vector<Piece> pieces;
  for (Segment& seg : segments) {
    if (seg.token_id >= 0) {
      ids.push_back(seg.token_id);
      continue;
    }
    if (seg.piece.text.empty()) continue;
    pieces.clear();
    pieces.push_back(std::move(seg.piece));
    if (pre_tokenizer) pre_tokenizer->pre_tokenize(pieces);
    for (const Piece& p : pieces) model->tokenize(p.text, ids);
  }
  if (options.add_special_tokens && post_processor) post_processor->process(ids);
  return ids;
}

std::optional<std::string> TokenizerImpl::token_text(std::int32_t id) const {
  if (auto it = added_by_id.find(id); it != added_by_id.end()) return added[it->second].content;
  if (auto t = model->id_to_token(id)) return std::string(*t);
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------------

namespace {

// Real vocabularies stay below a million entries; the bound keeps a corrupt id from sizing the
// id table to gigabytes.
constexpr std::int64_t kMaxTokenId = (1 << 24) - 1;

std::unique_ptr<tok::Bpe> load_bpe(tok::json::object m, const std::string& where) {
  namespace json = tok::json;
  if (auto type = json::member(m, "type")) {
    const std::string_view t = json::as_string(*type, where + ".type");
    if (t != "BPE") {
      json::fail(where + ".type",
                 "unsupported model type \"" + std::string(t) + "\" (supported: BPE)");
    }
  }
  if (auto dropout = json::member(m, "dropout")) {
    double d = 0;
    if (dropout->get(d) || d != 0.0) {
      json::fail(where + ".dropout",
                 "BPE dropout makes encoding random; only null or 0 is supported");
    }
  }
  tok::Bpe::Options options;
  if (auto unk = json::member(m, "unk_token"))
    options.unk_token = std::string(json::as_string(*unk, where + ".unk_token"));
  options.continuing_subword_prefix = json::string_or(m, "continuing_subword_prefix", "", where);
  options.end_of_word_suffix = json::string_or(m, "end_of_word_suffix", "", where);
  options.fuse_unk = json::bool_or(m, "fuse_unk", false, where);
  options.byte_fallback = json::bool_or(m, "byte_fallback", false, where);
  options.ignore_merges = json::bool_or(m, "ignore_merges", false, where);

  json::object vocab = json::as_object(json::required(m, "vocab", where), where + ".vocab");
  json::array merges = json::as_array(json::required(m, "merges", where), where + ".merges");

  // Copy every string into one arena first so the views handed to the model stay valid.
  std::size_t bytes = 0;
  for (auto field : vocab) bytes += field.key.size();
  for (json::element e : merges) {
    std::string_view s;
    if (!e.get(s)) {
      bytes += s.size();
    } else {
      for (json::element part : json::as_array(e, where + ".merges")) {
        bytes += json::as_string(part, where + ".merges").size();
      }
    }
  }
  auto arena = std::make_unique<std::string>();
  arena->reserve(bytes);  // never reallocates below, so the views stay valid
  auto keep = [&](std::string_view s) {
    const std::size_t at = arena->size();
    arena->append(s);
    return std::string_view(arena->data() + at, s.size());
  };

  std::vector<std::string_view> tokens;
  std::vector<bool> present;
  for (auto field : vocab) {
    const std::int64_t id =
        json::as_int(field.value, where + ".vocab[\"" + std::string(field.key) + "\"]");
    if (id < 0 || id > kMaxTokenId) {
      json::fail(where + ".vocab[\"" + std::string(field.key) + "\"]",
                 "id out of range (0.." + std::to_string(kMaxTokenId) + ")");
    }
    if (static_cast<std::size_t>(id) >= tokens.size()) {
      tokens.resize(static_cast<std::size_t>(id) + 1);
      present.resize(static_cast<std::size_t>(id) + 1, false);
    }
    tokens[static_cast<std::size_t>(id)] = keep(field.key);
    present[static_cast<std::size_t>(id)] = true;
  }

  std::vector<std::pair<std::string_view, std::string_view>> pairs;
  pairs.reserve(merges.size());
  std::size_t index = 0;
  for (json::element e : merges) {
    const std::string at = where + ".merges[" + std::to_string(index++) + "]";
    std::string_view s;
    if (!e.get(s)) {
      const std::size_t space = s.find(' ');
      if (space == std::string_view::npos || s.find(' ', space + 1) != std::string_view::npos) {
        json::fail(
            at, "expected \"left right\" with exactly one space, got \"" + std::string(s) + "\"");
      }
      pairs.emplace_back(keep(s.substr(0, space)), keep(s.substr(space + 1)));
    } else {
      json::array parts = json::as_array(e, at);
      if (parts.size() != 2) json::fail(at, "expected [left, right]");
      pairs.emplace_back(keep(json::as_string(parts.at(0), at)),
                         keep(json::as_string(parts.at(1), at)));
    }
  }
  return std::make_unique<tok::Bpe>(std::move(tokens), std::move(present), pairs,
                                    std::move(options), std::move(arena));
}

std::shared_ptr<TokenizerImpl> build(const simdjson::padded_string& padded,
                                     const std::string& origin) {
  namespace json = tok::json;
  simdjson::dom::parser parser;
  json::element root;
  if (auto error = parser.parse(padded).get(root)) {
    throw StatusError(origin + ": not valid JSON (" + simdjson::error_message(error) + ")");
  }
  json::object doc = json::as_object(root, origin);
  auto impl = std::make_shared<TokenizerImpl>();

  impl->model = load_bpe(json::as_object(json::required(doc, "model", origin), origin + ": model"),
                         origin + ": model");
  if (auto n = json::member(doc, "normalizer"))
    impl->normalizer = tok::make_normalizer(*n, origin + ": normalizer");
  if (auto p = json::member(doc, "pre_tokenizer"))
    impl->pre_tokenizer = tok::make_pre_tokenizer(*p, origin + ": pre_tokenizer");
  if (auto p = json::member(doc, "post_processor"))
    impl->post_processor = tok::make_post_processor(*p, origin + ": post_processor");
  if (auto d = json::member(doc, "decoder"))
    impl->decoder = tok::make_decoder(*d, origin + ": decoder");

  // Ids as the reference assigns them on load (the file's ids are only checked there): a token
  // already in the model's vocabulary keeps that id, a new one takes the next id after the model's
  // vocabulary (counted in entries) or after the largest added id.
  std::size_t max_id = impl->model->id_count();
  std::unordered_map<std::string, std::int32_t> added_ids;
  std::int64_t next_id = static_cast<std::int64_t>(impl->model->vocab_entries());
  if (auto list = json::member(doc, "added_tokens")) {
    std::size_t i = 0;
    for (json::element e : json::as_array(*list, origin + ": added_tokens")) {
      const std::string at = origin + ": added_tokens[" + std::to_string(i++) + "]";
      json::object o = json::as_object(e, at);
      AddedToken t;
      const std::int64_t declared = json::as_int(json::required(o, "id", at), at + ".id");
      if (declared < 0 || declared > kMaxTokenId) {
        json::fail(at + ".id", "id out of range (0.." + std::to_string(kMaxTokenId) + ")");
      }
      t.content = json::as_string(json::required(o, "content", at), at + ".content");
      if (t.content.empty()) continue;  // the reference ignores empty tokens
      t.single_word = json::bool_or(o, "single_word", false, at);
      t.lstrip = json::bool_or(o, "lstrip", false, at);
      t.rstrip = json::bool_or(o, "rstrip", false, at);
      t.special = json::bool_or(o, "special", false, at);
      t.normalized = json::bool_or(o, "normalized", !t.special, at);
      if (text::find_invalid_utf8(t.content) != std::string_view::npos) {
        json::fail(at + ".content", "not valid UTF-8");
      }
      if (auto it = added_ids.find(t.content); it != added_ids.end()) {
        t.id = it->second;
      } else if (auto model_id = impl->model->token_to_id(t.content)) {
        t.id = *model_id;
      } else {
        t.id = static_cast<std::int32_t>(next_id++);
      }
      added_ids[t.content] = t.id;
      max_id = std::max(max_id, static_cast<std::size_t>(t.id) + 1);
      impl->added_by_id[t.id] = impl->added.size();
      if (t.special) impl->special_contents.insert(t.content);
      impl->added.push_back(std::move(t));
    }
  }
  // Specials first, then the others: the order the reference builds its automata in.
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t k = 0; k < impl->added.size(); ++k) {
      const AddedToken& t = impl->added[k];
      if (t.special != (pass == 0)) continue;
      if (!t.normalized) {
        impl->raw_trie.insert(t.content, static_cast<std::int32_t>(k));
      } else {
        std::string content = t.content;
        if (impl->normalizer) impl->normalizer->normalize(content);
        impl->normalized_trie.insert(content, static_cast<std::int32_t>(k));
      }
    }
  }
  impl->vocab_size = max_id;
  return impl;
}

}  // namespace

namespace {

// build() with its exceptions turned into an Error that starts with the file's name.
Expected<std::shared_ptr<TokenizerImpl>> build_or_error(const simdjson::padded_string& json_text,
                                                        const std::string& origin) {
  try {
    return build(json_text, origin);
  } catch (const StatusError& e) {
    const std::string message = e.what();
    return Error{message.rfind(origin, 0) == 0 ? message : origin + ": " + message};
  } catch (const std::bad_alloc&) {
    return Error{origin + ": out of memory while loading the tokenizer"};
  }
}

}  // namespace

Expected<Tokenizer> Tokenizer::from_json(std::string_view json_text, const std::string& origin) {
  auto impl = build_or_error(simdjson::padded_string(json_text), origin);
  if (!impl.ok()) return impl.error();
  return Tokenizer(std::move(*impl));
}

Expected<Tokenizer> Tokenizer::load(const std::string& path) {
  simdjson::padded_string content;
  if (simdjson::padded_string::load(path).get(content)) {
    return Error{path + ": cannot open tokenizer file"};
  }
  auto impl = build_or_error(content, path);
  if (!impl.ok()) return impl.error();
  return Tokenizer(std::move(*impl));
}

Expected<std::vector<std::int32_t>> Tokenizer::encode(std::string_view input,
                                                      const EncodeOptions& options) const {
  const std::size_t bad = text::find_invalid_utf8(input);
  if (bad != std::string_view::npos) {
    return Error{"input is not valid UTF-8 (invalid byte 0x" +
                 [&] {
                   static const char* kHex = "0123456789abcdef";
                   const auto b = static_cast<unsigned char>(input[bad]);
                   return std::string{kHex[b >> 4], kHex[b & 15]};
                 }() +
                 " at offset " + std::to_string(bad) + ")"};
  }
  try {
    return impl_->encode(input, options);
  } catch (const StatusError& e) {
    return e.error();
  }
}

Expected<std::string> Tokenizer::decode(const std::vector<std::int32_t>& ids,
                                        const DecodeOptions& options) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (std::int32_t id : ids) {
    auto text = impl_->token_text(id);
    if (!text) {
      return Error{"token id " + std::to_string(id) +
                   " is not in the tokenizer's vocabulary (size " +
                   std::to_string(impl_->vocab_size) + ")"};
    }
    if (options.skip_special_tokens && impl_->special_contents.count(*text)) continue;
    tokens.push_back(std::move(*text));
  }
  if (!impl_->decoder) {
    std::string out;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i) out += ' ';
      out += tokens[i];
    }
    return out;
  }
  try {
    impl_->decoder->decode_chain(tokens);
  } catch (const StatusError& e) {
    return e.error();
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

std::size_t Tokenizer::vocab_size() const {
  return impl_->vocab_size;
}

std::optional<std::int32_t> Tokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& t : impl_->added) {
    if (t.content == token) return t.id;
  }
  return impl_->model->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(std::int32_t id) const {
  return impl_->token_text(id);
}

bool Tokenizer::is_special(std::int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

bool Tokenizer::is_fallback_byte(std::int32_t id) const {
  return !impl_->added_by_id.count(id) && impl_->model->is_fallback_byte(id);
}

std::optional<std::string> Tokenizer::partial_character_bytes(std::int32_t id) const {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  if (impl_->added_by_id.count(id)) return std::nullopt;
  const auto piece = impl_->token_text(id);
  auto alone = decode({id});
  // Only a token whose decode replaced something its own text does not hold.
  if (!piece || !alone || alone->find(kReplacement) == std::string::npos ||
      piece->find(kReplacement) != std::string::npos)
    return std::nullopt;
  if (const auto byte = impl_->model->fallback_byte(id))
    return std::string(1, static_cast<char>(*byte));
  // A byte-level piece: each of its characters stands for one byte.
  std::string bytes;
  for (std::size_t i = 0; i < piece->size();) {
    const int b = text::byte_level_byte(text::next_code_point(*piece, i));
    if (b < 0) return std::nullopt;
    bytes.push_back(static_cast<char>(b));
  }
  if (text::find_invalid_utf8(bytes) == std::string_view::npos) return std::nullopt;
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------------------------

DecodeStream::DecodeStream(const Tokenizer& tokenizer, DecodeOptions options)
    : tokenizer_(&tokenizer), options_(options) {}

namespace {

bool ends_with_replacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xEF\xBF\xBD") == 0;
}

bool starts_with_replacement(const std::string& s) {
  return s.compare(0, 3, "\xEF\xBF\xBD") == 0;
}

}  // namespace

Expected<std::string> DecodeStream::decode_range(std::size_t begin, std::size_t end) const {
  return tokenizer_->decode(
      std::vector<std::int32_t>(ids_.begin() + static_cast<std::ptrdiff_t>(begin),
                                ids_.begin() + static_cast<std::ptrdiff_t>(end)),
      options_);
}

Expected<std::string> DecodeStream::step(std::int32_t id) {
  ids_.push_back(id);
  auto full = decode_range(window_, ids_.size());
  if (!full.ok()) {
    ids_.pop_back();
    return full.error();
  }
  // A run of fallback bytes decodes as a whole: one byte more can turn characters already
  // decoded into replacement characters. Nothing is final until the run ends.
  if (tokenizer_->is_fallback_byte(id)) return std::string();
  const std::string& s = *full;
  if (s.size() <= prefix_.size() || ends_with_replacement(s) ||
      s.compare(0, prefix_.size(), prefix_) != 0) {
    return std::string();  // nothing final yet (an incomplete character, or a token that adds no
                           // text)
  }
  std::string piece = s.substr(prefix_.size());

  // The next window starts at the last token emitted, reaching back while that start decodes to
  // nothing or to a broken character: decoders that strip leading spaces or drop the first
  // token's marker (Strip, Metaspace) must not act on text that is already out.
  const std::size_t emitted = ids_.size();
  std::size_t start = emitted - 1;
  std::string prefix;
  while (true) {
    auto p = decode_range(start, emitted);
    if (!p.ok()) return p.error();
    prefix = std::move(*p);
    if ((!prefix.empty() && !starts_with_replacement(prefix)) || start == 0 ||
        emitted - start >= kMaxWindow) {
      break;
    }
    --start;
  }
  // Forget what lies before the window so memory stays bounded on long streams.
  ids_.erase(ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(start));
  window_ = 0;
  prefix_ = std::move(prefix);
  return piece;
}

Expected<std::string> DecodeStream::finish() {
  auto full = decode_range(window_, ids_.size());
  if (!full.ok()) return full.error();
  std::string rest;
  if (full->size() > prefix_.size() && full->compare(0, prefix_.size(), prefix_) == 0) {
    rest = full->substr(prefix_.size());
  }
  ids_.clear();
  prefix_.clear();
  window_ = 0;
  return rest;
}

}  // namespace moeline::tokenizer
