#include "tokenizer/components.h"

#include <algorithm>
#include <atomic>
#include <unordered_map>
#include <utility>

#include "tokenizer/factories.h"
#include "tokenizer/json_util.h"
#include "tokenizer/unicode.h"

namespace moeline::tokenizer::tok {

using text::MatchSpan;

// ---------------------------------------------------------------------------------------------
// Patterns and splitting
// ---------------------------------------------------------------------------------------------

void Pattern::find_all(std::string_view input, std::vector<MatchSpan>& out) const {
  if (regex_) {
    regex_->find_all(input, out);
    return;
  }
  if (text_.empty()) return;
  for (std::size_t at = input.find(text_); at != std::string_view::npos;
       at = input.find(text_, at + text_.size())) {
    out.push_back({at, at + text_.size()});
  }
}

std::string Pattern::replace_all(std::string_view input, std::string_view content) const {
  std::vector<MatchSpan> matches;
  find_all(input, matches);
  if (matches.empty()) return std::string(input);
  std::string out;
  out.reserve(input.size());
  std::size_t last = 0;
  for (const MatchSpan& m : matches) {
    out.append(input.substr(last, m.begin - last));
    out.append(content);
    last = m.end;
  }
  out.append(input.substr(last));
  return out;
}

namespace {

struct Span {
  std::size_t begin, end;
  bool is_match;
};

// Every character for which `pred` holds is a match of its own (a char-predicate pattern).
template <class Pred>
void find_chars(std::string_view input, Pred pred, std::vector<MatchSpan>& out) {
  for (std::size_t i = 0; i < input.size();) {
    const std::size_t at = i;
    const char32_t cp = text::next_code_point(input, i);
    if (pred(cp)) out.push_back({at, i});
  }
}

}  // namespace

void split_piece(Piece&& piece, const std::vector<MatchSpan>& matches, SplitBehavior behavior,
                 bool invert, std::vector<Piece>& out) {
  const std::string_view s = piece.text;
  if (matches.empty()) {
    const bool whole_is_match = invert;
    if (!s.empty() && !(whole_is_match && behavior == SplitBehavior::kRemoved)) {
      out.push_back(std::move(piece));
    }
    return;
  }
  std::vector<Span> spans;
  spans.reserve(matches.size() * 2 + 1);
  std::size_t prev = 0;
  for (const MatchSpan& m : matches) {
    if (prev != m.begin) spans.push_back({prev, m.begin, invert});
    spans.push_back({m.begin, m.end, !invert});
    prev = m.end;
  }
  if (prev != s.size()) spans.push_back({prev, s.size(), invert});

  // (begin, end, remove) after applying the behaviour, as NormalizedString::split does.
  std::vector<Span> parts;
  parts.reserve(spans.size());
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Span& sp : spans) parts.push_back({sp.begin, sp.end, false});
      break;
    case SplitBehavior::kRemoved:
      for (const Span& sp : spans) parts.push_back({sp.begin, sp.end, sp.is_match});
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.is_match && !previous_match && !parts.empty()) {
          parts.back().end = sp.end;
        } else {
          parts.push_back({sp.begin, sp.end, false});
        }
        previous_match = sp.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->is_match && !previous_match && !parts.empty()) {
          parts.back().begin = it->begin;
        } else {
          parts.push_back({it->begin, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Span& sp : spans) {
        if (sp.is_match == previous_match && !parts.empty()) {
          parts.back().end = sp.end;
        } else {
          parts.push_back({sp.begin, sp.end, false});
        }
        previous_match = sp.is_match;
      }
      break;
    }
  }
  for (const Span& p : parts) {
    if (p.is_match || p.begin == p.end) continue;  // is_match here means "remove"
    out.push_back(
        {std::string(s.substr(p.begin, p.end - p.begin)), piece.at_start && p.begin == 0});
  }
}

// ---------------------------------------------------------------------------------------------
// Normalizers
// ---------------------------------------------------------------------------------------------

namespace {

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void normalize(std::string& s) const override {
    for (const auto& p : parts_) p->normalize(s);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(text::NormalForm form) : form_(form) {}
  void normalize(std::string& s) const override { s = text::normalize(s, form_); }

 private:
  text::NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  void normalize(std::string& s) const override { s = text::to_lower(s); }
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string& s) const override {
    const std::size_t begin = left_ ? text::leading_white_space(s) : 0;
    const std::size_t end =
        right_ ? text::trailing_white_space_start(std::string_view(s).substr(begin)) + begin
               : s.size();
    s = s.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

class StripAccentsNormalizer final : public Normalizer {
 public:
  void normalize(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0; i < s.size();) {
      const std::size_t at = i;
      const char32_t cp = text::next_code_point(s, i);
      if (!text::is_combining_mark(cp)) out.append(s, at, i - at);
    }
    s = std::move(out);
  }
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(std::string& s) const override { s = pattern_.replace_all(s, content_); }

 private:
  Pattern pattern_;
  std::string content_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  void normalize(std::string& s) const override {
    if (!s.empty()) s.insert(0, prepend_);
  }

 private:
  std::string prepend_;
};

Pattern parse_pattern(json::element e, const std::string& where) {
  json::object o = json::as_object(e, where);
  if (auto s = json::member(o, "String")) {
    return Pattern::literal(std::string(json::as_string(*s, where + ".String")));
  }
  if (auto r = json::member(o, "Regex")) {
    try {
      return Pattern::regex(json::as_string(*r, where + ".Regex"));
    } catch (const StatusError& error) {
      json::fail(where + ".Regex", error.what());
    }
  }
  json::fail(where, "expected {\"String\": ...} or {\"Regex\": ...}");
}

std::string_view type_of(json::object o, const std::string& where) {
  return json::as_string(json::required(o, "type", where), where + ".type");
}

// The components of a "Sequence": `make` applied to each element of the list under `key`.
template <class Make>
auto parse_sequence(json::object o, std::string_view key, const std::string& where, Make make) {
  const std::string list = where + "." + std::string(key);
  std::vector<decltype(make(std::declval<json::element>(), std::string()))> parts;
  std::size_t i = 0;
  for (json::element child : json::as_array(json::required(o, key, where), list)) {
    parts.push_back(make(child, list + "[" + std::to_string(i++) + "]"));
  }
  return parts;
}

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(json::element e, const std::string& where) {
  json::object o = json::as_object(e, where);
  const std::string_view type = type_of(o, where);
  if (type == "Sequence") {
    return std::make_unique<SequenceNormalizer>(
        parse_sequence(o, "normalizers", where, make_normalizer));
  }
  if (type == "NFC") return std::make_unique<UnicodeNormalizer>(text::NormalForm::kNFC);
  if (type == "NFD") return std::make_unique<UnicodeNormalizer>(text::NormalForm::kNFD);
  if (type == "NFKC") return std::make_unique<UnicodeNormalizer>(text::NormalForm::kNFKC);
  if (type == "NFKD") return std::make_unique<UnicodeNormalizer>(text::NormalForm::kNFKD);
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "StripAccents") return std::make_unique<StripAccentsNormalizer>();
  if (type == "Strip") {
    return std::make_unique<StripNormalizer>(json::bool_or(o, "strip_left", true, where),
                                             json::bool_or(o, "strip_right", true, where));
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(
        parse_pattern(json::required(o, "pattern", where), where + ".pattern"),
        std::string(json::as_string(json::required(o, "content", where), where + ".content")));
  }
  if (type == "Prepend") {
    return std::make_unique<PrependNormalizer>(
        std::string(json::as_string(json::required(o, "prepend", where), where + ".prepend")));
  }
  json::fail(where, "unsupported normalizer type \"" + std::string(type) +
                        "\" (supported: Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Strip, "
                        "StripAccents, Replace, Prepend)");
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers
// ---------------------------------------------------------------------------------------------

namespace {

SplitBehavior parse_behavior(std::string_view name, const std::string& where) {
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  json::fail(where, "unknown split behavior \"" + std::string(name) + "\"");
}

// Applies `find` (appends matches for one piece) with a behaviour to every piece.
template <class Find>
void split_all(std::vector<Piece>& pieces, Find find, SplitBehavior behavior, bool invert) {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 4);
  std::vector<MatchSpan> matches;
  for (Piece& p : pieces) {
    matches.clear();
    find(std::string_view(p.text), matches);
    split_piece(std::move(p), matches, behavior, invert, out);
  }
  pieces = std::move(out);
}

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& p : parts_) p->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Pattern pattern, SplitBehavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_all(
        pieces, [&](std::string_view s, std::vector<MatchSpan>& m) { pattern_.find_all(s, m); },
        behavior_, invert_);
  }

 private:
  Pattern pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

// GPT-2's pre-split pattern, used by ByteLevel when use_regex is set.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space) {
    if (use_regex) regex_.emplace(kGpt2Pattern);
  }
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    if (add_prefix_space_) {
      for (Piece& p : pieces) {
        if (p.text.empty() || p.text[0] != ' ') p.text.insert(0, " ");
      }
    }
    if (regex_) {
      split_all(
          pieces, [&](std::string_view s, std::vector<MatchSpan>& m) { regex_->find_all(s, m); },
          SplitBehavior::kIsolated, false);
    }
    const auto& chars = text::byte_level_chars();
    for (Piece& p : pieces) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (unsigned char b : p.text) mapped += chars[b];
      p.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::optional<text::Regex> regex_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

PrependScheme parse_prepend_scheme(json::object o, const std::string& where) {
  if (auto scheme = json::member(o, "prepend_scheme")) {
    const std::string_view s = json::as_string(*scheme, where + ".prepend_scheme");
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    json::fail(where + ".prepend_scheme", "expected always, first or never");
  }
  // Files written before prepend_scheme existed carry add_prefix_space instead.
  return json::bool_or(o, "add_prefix_space", true, where) ? PrependScheme::kAlways
                                                           : PrependScheme::kNever;
}

std::string parse_replacement(json::object o, const std::string& where) {
  std::string r(json::string_or(o, "replacement", "\xE2\x96\x81", where));
  std::size_t i = 0;
  if (r.empty() || (text::next_code_point(r, i), i != r.size())) {
    json::fail(where + ".replacement", "expected exactly one character");
  }
  return r;
}

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)),
        scheme_(scheme),
        split_(split),
        marker_(Pattern::literal(replacement_)) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (Piece& p : pieces) {
      p.text = space_.replace_all(p.text, replacement_);
      const bool starts = p.text.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts &&
          (scheme_ == PrependScheme::kAlways || (scheme_ == PrependScheme::kFirst && p.at_start))) {
        p.text.insert(0, replacement_);
      }
    }
    if (split_) {
      split_all(
          pieces, [&](std::string_view s, std::vector<MatchSpan>& m) { marker_.find_all(s, m); },
          SplitBehavior::kMergedWithNext, false);
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
  Pattern space_ = Pattern::literal(" ");
  Pattern marker_;
};

template <class Pred>
class CharSplitPreTokenizer final : public PreTokenizer {
 public:
  CharSplitPreTokenizer(Pred pred, SplitBehavior behavior)
      : pred_(std::move(pred)), behavior_(behavior) {}
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_all(
        pieces, [&](std::string_view s, std::vector<MatchSpan>& m) { find_chars(s, pred_, m); },
        behavior_, false);
  }

 private:
  Pred pred_;
  SplitBehavior behavior_;
};

template <class Pred>
std::unique_ptr<PreTokenizer> char_split(Pred pred, SplitBehavior behavior) {
  return std::make_unique<CharSplitPreTokenizer<Pred>>(std::move(pred), behavior);
}

}  // namespace

std::unique_ptr<PreTokenizer> make_pre_tokenizer(json::element e, const std::string& where) {
  json::object o = json::as_object(e, where);
  const std::string_view type = type_of(o, where);
  if (type == "Sequence") {
    return std::make_unique<SequencePreTokenizer>(
        parse_sequence(o, "pretokenizers", where, make_pre_tokenizer));
  }
  if (type == "Split") {
    return std::make_unique<SplitPreTokenizer>(
        parse_pattern(json::required(o, "pattern", where), where + ".pattern"),
        parse_behavior(json::as_string(json::required(o, "behavior", where), where + ".behavior"),
                       where + ".behavior"),
        json::bool_or(o, "invert", false, where));
  }
  if (type == "ByteLevel") {
    return std::make_unique<ByteLevelPreTokenizer>(
        json::bool_or(o, "add_prefix_space", true, where),
        json::bool_or(o, "use_regex", true, where));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspacePreTokenizer>(parse_replacement(o, where),
                                                   parse_prepend_scheme(o, where),
                                                   json::bool_or(o, "split", true, where));
  }
  if (type == "Digits") {
    const bool individual = json::bool_or(o, "individual_digits", false, where);
    return char_split([](char32_t c) { return text::is_numeric(c); },
                      individual ? SplitBehavior::kIsolated : SplitBehavior::kContiguous);
  }
  if (type == "WhitespaceSplit") {
    return char_split([](char32_t c) { return text::is_white_space(c); }, SplitBehavior::kRemoved);
  }
  if (type == "Whitespace") {
    // \w+|[^\w\s]+ kept, everything else (whitespace) removed.
    return std::make_unique<SplitPreTokenizer>(Pattern::regex(R"(\w+|[^\w\s]+)"),
                                               SplitBehavior::kRemoved, true);
  }
  if (type == "Punctuation") {
    const auto behavior =
        parse_behavior(json::string_or(o, "behavior", "Isolated", where), where + ".behavior");
    return char_split([](char32_t c) { return text::is_punctuation(c); }, behavior);
  }
  if (type == "BertPreTokenizer") {
    std::vector<std::unique_ptr<PreTokenizer>> parts;
    parts.push_back(
        char_split([](char32_t c) { return text::is_white_space(c); }, SplitBehavior::kRemoved));
    parts.push_back(
        char_split([](char32_t c) { return text::is_punctuation(c); }, SplitBehavior::kIsolated));
    return std::make_unique<SequencePreTokenizer>(std::move(parts));
  }
  if (type == "CharDelimiterSplit") {
    const std::string delimiter(json::as_string(json::required(o, "delimiter", where), where));
    std::size_t i = 0;
    const char32_t cp = delimiter.empty() ? 0 : text::next_code_point(delimiter, i);
    if (delimiter.empty() || i != delimiter.size()) {
      json::fail(where + ".delimiter", "expected exactly one character");
    }
    return char_split([cp](char32_t c) { return c == cp; }, SplitBehavior::kRemoved);
  }
  json::fail(where, "unsupported pre_tokenizer type \"" + std::string(type) +
                        "\" (supported: Sequence, Split, ByteLevel, Metaspace, Digits, Whitespace, "
                        "WhitespaceSplit, Punctuation, BertPreTokenizer, CharDelimiterSplit)");
}

// ---------------------------------------------------------------------------------------------
// Decoders
// ---------------------------------------------------------------------------------------------

namespace {

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& p : parts_) p->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      const std::size_t mark = bytes.size();
      bool all_mapped = true;
      for (std::size_t i = 0; i < t.size();) {
        const int b = text::byte_level_byte(text::next_code_point(t, i));
        if (b < 0) {
          all_mapped = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
      }
      if (!all_mapped) {
        bytes.resize(mark);
        bytes += t;  // a token outside the byte alphabet (an added token) passes through as is
      }
    }
    tokens.assign(1, text::from_utf8_lossy(bytes));
  }
};

class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (text::find_invalid_utf8(pending) == std::string_view::npos) {
        out.push_back(pending);
      } else {
        for (std::size_t i = 0; i < pending.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
    };
    for (std::string& t : tokens) {
      int byte = -1;
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') byte = parse_hex(t[3], t[4]);
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens = std::move(out);
  }

 private:
  static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  static int parse_hex(char hi, char lo) {
    const int h = hex_digit(hi), l = hex_digit(lo);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, std::size_t start, std::size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::vector<std::size_t> starts;  // byte offset of each character, plus the end
      std::vector<char32_t> chars;
      for (std::size_t i = 0; i < t.size();) {
        starts.push_back(i);
        chars.push_back(text::next_code_point(t, i));
      }
      starts.push_back(t.size());
      std::size_t start_cut = 0;
      for (std::size_t i = 0; i < start_ && i < chars.size(); ++i) {
        if (chars[i] != content_) break;
        start_cut = i + 1;
      }
      std::size_t stop_cut = chars.size();
      for (std::size_t i = 0; i < stop_ && i < chars.size(); ++i) {
        const std::size_t index = chars.size() - i - 1;
        if (chars[index] != content_) break;
        stop_cut = index;
      }
      if (stop_cut < start_cut) stop_cut = start_cut;
      t = t.substr(starts[start_cut], starts[stop_cut] - starts[start_cut]);
    }
  }

 private:
  char32_t content_;
  std::size_t start_, stop_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) t = pattern_.replace_all(t, content_);
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::size_t k = 0; k < tokens.size(); ++k) {
      const bool drop = k == 0 && scheme_ != PrependScheme::kNever;
      std::string out;
      out.reserve(tokens[k].size());
      const std::string& t = tokens[k];
      for (std::size_t i = 0; i < t.size();) {
        if (t.compare(i, replacement_.size(), replacement_) == 0) {
          if (!drop) out.push_back(' ');
          i += replacement_.size();
        } else {
          const std::size_t n = text::sequence_length(static_cast<unsigned char>(t[i]));
          out.append(t, i, n);
          i += n;
        }
      }
      tokens[k] = std::move(out);
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

class BpeSuffixDecoder final : public Decoder {
 public:
  explicit BpeSuffixDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    const Pattern suffix = Pattern::literal(suffix_);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = suffix.replace_all(tokens[i], i + 1 == tokens.size() ? "" : " ");
    }
  }

 private:
  std::string suffix_;
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(json::element e, const std::string& where) {
  json::object o = json::as_object(e, where);
  const std::string_view type = type_of(o, where);
  if (type == "Sequence") {
    return std::make_unique<SequenceDecoder>(parse_sequence(o, "decoders", where, make_decoder));
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    const std::string content(json::as_string(json::required(o, "content", where), where));
    std::size_t i = 0;
    const char32_t cp = content.empty() ? 0 : text::next_code_point(content, i);
    if (content.empty() || i != content.size()) {
      json::fail(where + ".content", "expected exactly one character");
    }
    const auto start = json::int_or(o, "start", 0, where), stop = json::int_or(o, "stop", 0, where);
    if (start < 0 || stop < 0) json::fail(where, "start and stop must not be negative");
    return std::make_unique<StripDecoder>(cp, static_cast<std::size_t>(start),
                                          static_cast<std::size_t>(stop));
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(
        parse_pattern(json::required(o, "pattern", where), where + ".pattern"),
        std::string(json::as_string(json::required(o, "content", where), where + ".content")));
  }
  if (type == "Metaspace") {
    return std::make_unique<MetaspaceDecoder>(parse_replacement(o, where),
                                              parse_prepend_scheme(o, where));
  }
  if (type == "BPEDecoder") {
    return std::make_unique<BpeSuffixDecoder>(
        std::string(json::string_or(o, "suffix", "</w>", where)));
  }
  json::fail(where, "unsupported decoder type \"" + std::string(type) +
                        "\" (supported: Sequence, ByteLevel, ByteFallback, Fuse, Strip, Replace, "
                        "Metaspace, BPEDecoder)");
}

// ---------------------------------------------------------------------------------------------
// Post-processors
// ---------------------------------------------------------------------------------------------

namespace {

class SequenceProcessor final : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> parts)
      : parts_(std::move(parts)) {}
  void process(std::vector<std::int32_t>& ids) const override {
    for (const auto& p : parts_) p->process(ids);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

class NoOpProcessor final : public PostProcessor {
 public:
  void process(std::vector<std::int32_t>&) const override {}
};

// A template of special-token id runs around the sequence ("A"): TemplateProcessing, and
// Bert/Roberta processing as the fixed template [CLS] A [SEP].
class TemplateProcessor final : public PostProcessor {
 public:
  struct Item {
    bool is_sequence;
    std::vector<std::int32_t> ids;
  };
  explicit TemplateProcessor(std::vector<Item> items) : items_(std::move(items)) {}
  void process(std::vector<std::int32_t>& ids) const override {
    std::vector<std::int32_t> out;
    out.reserve(ids.size() + 4);
    for (const Item& item : items_) {
      if (item.is_sequence) {
        out.insert(out.end(), ids.begin(), ids.end());
      } else {
        out.insert(out.end(), item.ids.begin(), item.ids.end());
      }
    }
    ids = std::move(out);
  }

 private:
  std::vector<Item> items_;
};

std::int32_t pair_id(json::object o, std::string_view key, const std::string& where) {
  json::array pair = json::as_array(json::required(o, key, where), where + "." + std::string(key));
  if (pair.size() != 2) json::fail(where + "." + std::string(key), "expected [token, id]");
  return static_cast<std::int32_t>(json::as_int(pair.at(1), where + "." + std::string(key)));
}

}  // namespace

std::unique_ptr<PostProcessor> make_post_processor(json::element e, const std::string& where) {
  json::object o = json::as_object(e, where);
  const std::string_view type = type_of(o, where);
  if (type == "Sequence") {
    return std::make_unique<SequenceProcessor>(
        parse_sequence(o, "processors", where, make_post_processor));
  }
  if (type == "ByteLevel") return std::make_unique<NoOpProcessor>();
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    return std::make_unique<TemplateProcessor>(std::vector<TemplateProcessor::Item>{
        {false, {pair_id(o, "cls", where)}}, {true, {}}, {false, {pair_id(o, "sep", where)}}});
  }
  if (type == "TemplateProcessing") {
    json::object specials =
        json::as_object(json::required(o, "special_tokens", where), where + ".special_tokens");
    std::vector<TemplateProcessor::Item> items;
    std::size_t i = 0;
    for (json::element piece : json::as_array(json::required(o, "single", where), where)) {
      const std::string at = where + ".single[" + std::to_string(i++) + "]";
      json::object po = json::as_object(piece, at);
      if (auto seq = json::member(po, "Sequence")) {
        items.push_back({true, {}});
      } else if (auto special = json::member(po, "SpecialToken")) {
        const std::string_view name =
            json::as_string(json::required(json::as_object(*special, at), "id", at), at + ".id");
        auto entry = json::member(specials, name);
        if (!entry) {
          json::fail(at, "special token \"" + std::string(name) + "\" is not in special_tokens");
        }
        std::vector<std::int32_t> ids;
        for (json::element id :
             json::as_array(json::required(json::as_object(*entry, at), "ids", at), at + ".ids")) {
          ids.push_back(static_cast<std::int32_t>(json::as_int(id, at + ".ids")));
        }
        items.push_back({false, std::move(ids)});
      } else {
        json::fail(at, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    return std::make_unique<TemplateProcessor>(std::move(items));
  }
  json::fail(where, "unsupported post_processor type \"" + std::string(type) +
                        "\" (supported: Sequence, ByteLevel, TemplateProcessing, BertProcessing, "
                        "RobertaProcessing)");
}

// ---------------------------------------------------------------------------------------------
// BPE
// ---------------------------------------------------------------------------------------------

namespace {

std::atomic<std::uint64_t> next_cache_id{1};

// Per-thread word cache, as in the reference library: most pieces of real text repeat, so the
// merge loop runs once per distinct piece. Bounded in entries and in key length.
constexpr std::size_t kCacheCapacity = 10000;
constexpr std::size_t kCacheMaxKey = 256;

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return XXH3_64bits(s.data(), s.size()); }
};
using WordCache =
    std::unordered_map<std::string, std::vector<std::int32_t>, StringHash, std::equal_to<>>;

WordCache& cache_for(std::uint64_t id) {
  thread_local std::unordered_map<std::uint64_t, WordCache> caches;
  thread_local std::uint64_t last_id = 0;
  thread_local WordCache* last = nullptr;
  if (id != last_id) {
    last = &caches[id];
    last_id = id;
  }
  return *last;
}

struct Symbol {
  std::int32_t id;
  std::int32_t prev;
  std::int32_t next;
  std::uint32_t len;
};

struct MergeCandidate {
  std::uint32_t rank;
  std::uint32_t pos;
  std::int32_t new_id;
  // Min-heap on (rank, pos) through std::push_heap's max-heap.
  bool operator<(const MergeCandidate& o) const {
    return rank != o.rank ? rank > o.rank : pos > o.pos;
  }
};

}  // namespace

Bpe::Bpe(std::vector<std::string_view> tokens, std::vector<bool> present,
         const std::vector<std::pair<std::string_view, std::string_view>>& merges, Options options,
         std::unique_ptr<const std::string> arena)
    : arena_(std::move(arena)),
      tokens_(std::move(tokens)),
      present_(std::move(present)),
      options_(std::move(options)),
      cache_id_(next_cache_id.fetch_add(1)) {
  vocab_.reserve(tokens_.size());
  for (std::size_t id = 0; id < tokens_.size(); ++id) {
    if (present_[id]) vocab_.put(tokens_[id], static_cast<std::int32_t>(id));
  }
  if (options_.unk_token) {
    const std::int32_t unk = vocab_.get(*options_.unk_token);
    if (unk < 0)
      throw StatusError("model.unk_token \"" + *options_.unk_token + "\" is not in the vocab");
    unk_id_ = unk;
  }
  static const char* kHex = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const char name[7] = {'<', '0', 'x', kHex[b >> 4], kHex[b & 15], '>', 0};
    byte_ids_[b] = vocab_.get(std::string_view(name, 6));
  }
  merges_.reserve(merges.size());
  const std::size_t prefix_len = options_.continuing_subword_prefix.size();
  std::string joined;
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const std::int32_t a = vocab_.get(left), b = vocab_.get(right);
    if (a < 0 || b < 0) {
      throw StatusError("model.merges[" + std::to_string(rank) + "]: token \"" +
                        std::string(a < 0 ? left : right) + "\" is not in the vocab");
    }
    joined.assign(left);
    joined.append(right.substr(std::min(prefix_len, right.size())));
    const std::int32_t merged = vocab_.get(joined);
    if (merged < 0) {
      throw StatusError("model.merges[" + std::to_string(rank) + "]: merged token \"" + joined +
                        "\" is not in the vocab");
    }
    merges_.put((std::uint64_t(std::uint32_t(a)) << 32) | std::uint32_t(b),
                (std::uint64_t(rank) << 32) | std::uint32_t(merged));
  }
}

std::optional<std::int32_t> Bpe::token_to_id(std::string_view token) const {
  const std::int32_t id = vocab_.get(token);
  if (id < 0) return std::nullopt;
  return id;
}

std::optional<std::string_view> Bpe::id_to_token(std::int32_t id) const {
  if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size() || !present_[id]) {
    return std::nullopt;
  }
  return tokens_[id];
}

std::optional<unsigned char> Bpe::fallback_byte(std::int32_t id) const {
  if (!options_.byte_fallback || id < 0) return std::nullopt;
  const auto found = std::find(byte_ids_.begin(), byte_ids_.end(), id);
  if (found == byte_ids_.end()) return std::nullopt;
  return static_cast<unsigned char>(found - byte_ids_.begin());
}

void Bpe::tokenize(std::string_view piece, std::vector<std::int32_t>& out) const {
  if (piece.empty()) return;
  if (options_.ignore_merges) {
    const std::int32_t id = vocab_.get(piece);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  if (piece.size() >= kCacheMaxKey) {
    merge_word(piece, out);
    return;
  }
  WordCache& cache = cache_for(cache_id_);
  if (auto it = cache.find(piece); it != cache.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const std::size_t mark = out.size();
  merge_word(piece, out);
  if (cache.size() < kCacheCapacity) {
    cache.emplace(std::string(piece), std::vector<std::int32_t>(out.begin() + mark, out.end()));
  }
}

void Bpe::merge_word(std::string_view w, std::vector<std::int32_t>& out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(w.size());
  auto add = [&](std::int32_t id, std::uint32_t len) {
    const auto n = static_cast<std::int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, len});
  };
  // Pending unknown token (id, bytes); id < 0 when none.
  std::int32_t unk = -1;
  std::uint32_t unk_len = 0;
  const bool affixes =
      !options_.continuing_subword_prefix.empty() || !options_.end_of_word_suffix.empty();
  std::string scratch;
  for (std::size_t i = 0; i < w.size();) {
    const std::size_t begin = i;
    i += text::sequence_length(static_cast<unsigned char>(w[i]));
    const auto byte_len = static_cast<std::uint32_t>(i - begin);
    std::string_view s = w.substr(begin, i - begin);
    if (affixes) {
      scratch.clear();
      if (begin != 0) scratch += options_.continuing_subword_prefix;
      scratch += s;
      if (i == w.size()) scratch += options_.end_of_word_suffix;
      s = scratch;
    }
    const std::int32_t id = vocab_.get(s);
    if (id >= 0) {
      if (unk >= 0) {
        add(unk, unk_len);
        unk = -1;
      }
      add(id, byte_len);
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (unsigned char b : s) all = all && byte_ids_[b] >= 0;
      if (all) {
        // As in the reference, a pending unknown is not flushed before fallback bytes.
        for (unsigned char b : s) add(byte_ids_[b], 1);
        continue;
      }
    }
    if (unk_id_) {
      if (unk >= 0 && options_.fuse_unk) {
        unk_len += byte_len;
      } else {
        if (unk >= 0) add(unk, unk_len);
        unk = *unk_id_;
        unk_len = byte_len;
      }
    }
  }
  if (unk >= 0) add(unk, unk_len);

  std::vector<MergeCandidate> heap;
  heap.reserve(symbols.size());
  auto consider = [&](std::size_t pos) {
    const Symbol& left = symbols[pos];
    if (left.next < 0) return;
    std::uint64_t value;
    if (merges_.get(
            (std::uint64_t(std::uint32_t(left.id)) << 32) | std::uint32_t(symbols[left.next].id),
            value)) {
      heap.push_back({static_cast<std::uint32_t>(value >> 32), static_cast<std::uint32_t>(pos),
                      static_cast<std::int32_t>(value & 0xFFFFFFFFu)});
      std::push_heap(heap.begin(), heap.end());
    }
  };
  for (std::size_t pos = 0; pos + 1 < symbols.size(); ++pos) consider(pos);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const MergeCandidate top = heap.back();
    heap.pop_back();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next < 0) continue;
    Symbol& right = symbols[cur.next];
    std::uint64_t value;
    if (!merges_.get((std::uint64_t(std::uint32_t(cur.id)) << 32) | std::uint32_t(right.id),
                     value) ||
        static_cast<std::int32_t>(value & 0xFFFFFFFFu) != top.new_id) {
      continue;  // stale: one side has merged since this candidate was queued
    }
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    right.len = 0;
    if (cur.next >= 0) symbols[cur.next].prev = static_cast<std::int32_t>(top.pos);
    if (cur.prev >= 0) consider(static_cast<std::size_t>(cur.prev));
    consider(top.pos);
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out.push_back(s.id);
  }
}

}  // namespace moeline::tokenizer::tok
