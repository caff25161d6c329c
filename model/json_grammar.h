#pragma once
// Structured output: which bytes may come next in a JSON document that must match a schema.
//
// A JsonGrammar is compiled once from a JSON Schema (or stands for "any JSON object", OpenAI's
// json_object mode); a JsonMatcher follows one document through it byte by byte and says, at
// every point, whether a byte can come next and whether the document can end here. Every
// document the matcher accepts to its end is valid JSON that validates against the schema (the
// matcher may refuse some valid documents: see below); a prefix it accepts can always be
// completed.
//
// The schema subset (draft 2020-12 and draft 7 spellings):
//   type (a name or a list), enum and const (beside type: the values of that type), anyOf,
//   oneOf (where no document can match two branches), allOf of one schema, $ref to "#",
//   "#/$defs/NAME" or "#/definitions/NAME" (recursion allowed; unions flattened at compile time),
//   object: properties, required, additionalProperties (a schema where there are no properties),
//   array: items, minItems, maxItems; string: minLength, maxLength (in code points).
// Annotations (title, description, default, examples, format, ...) are ignored, as validators do.
// An assertion outside the subset (pattern, minimum, uniqueItems, ...), or beside $ref, allOf,
// anyOf, oneOf, enum or const, is refused by name rather than ignored, since ignoring it could
// give a document the schema rejects. What could never end (a property whose value requires
// itself, say) is not offered.
//
// What the matcher generates, like vLLM's and llama.cpp's grammars: an object's properties in
// the schema's order, each at most once, none that the schema does not list (unless it has no
// properties and allows any); between tokens no whitespace, one space, or a newline and up to 20
// spaces or tabs (as json.dumps writes with and without indent); free-form values nested at most
// 32 deep, a schema's own objects and arrays 256; integers of at most
// 19 digits, fractions of at most 20, exponents of at most 3; strings of
// valid UTF-8 with escapes, no \u surrogates; a const or enum value written as compact JSON
// (json.dumps with separators (",", ":")), which matters only for objects and arrays.

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "model/sampling.h"

namespace moeline::model {

// How deeply the objects and arrays of a JSON text nest (strings skipped; the text need not be
// valid): checked before a parse whose result is walked recursively.
size_t json_text_depth(std::string_view text);

// The longest schema text a request may carry.
inline constexpr size_t kMaxJsonSchemaBytes = 64 * 1024;

class JsonGrammar {
 public:
  // Any JSON object (OpenAI's response_format json_object).
  static std::shared_ptr<const JsonGrammar> any_object();
  // The schema's grammar; an Error names the keyword and where it is (a JSON pointer). The
  // properties keep the order the text writes them in.
  // With `prefix` and `suffix`: the document between those texts (a tool call's tags), with
  // whitespace allowed inside them.
  static Expected<std::shared_ptr<const JsonGrammar>> compile(std::string_view schema_text,
                                                              std::string_view prefix = {},
                                                              std::string_view suffix = {});

  enum class Kind : uint8_t {
    kUnion,
    kObject,
    kMap,
    kArray,
    kString,
    kNumber,
    kInteger,
    kLiterals
  };
  struct Property {
    uint32_t node = 0;
    bool required = false;
    std::string key;  // the name as a JSON string
  };
  struct Node {
    Kind kind = Kind::kUnion;
    std::vector<uint32_t> alternatives;  // kUnion
    std::vector<Property> properties;    // kObject, in the schema's order
    // kObject: for each next-property index i, the kLiterals node of the keys that may come
    // next (i up to the first required property after it), as JSON strings, tagged with j.
    std::vector<uint32_t> key_choices;
    std::vector<bool> required_from;  // kObject: a required property at index >= i
    uint32_t child = 0;               // kMap: the values' node; kArray: the items' node
    uint64_t min = 0;                 // kArray: items; kString: code points
    uint64_t max = UINT64_MAX;
    std::vector<std::string> literals;  // kLiterals: JSON texts, sorted
    std::vector<uint32_t> tags;         // kLiterals: each literal's tag
  };

  const Node& node(uint32_t index) const { return nodes_[index]; }
  uint32_t root() const { return root_; }
  uint32_t any_string() const { return any_string_; }
  static constexpr uint32_t kNoText = UINT32_MAX;
  uint32_t prefix() const { return prefix_; }  // kLiterals nodes, or kNoText
  // The free-form value's object or array (nested at most 32 deep, a schema's own 256).
  bool free_container(uint32_t node) const {
    return std::find(free_containers_.begin(), free_containers_.end(), node) !=
           free_containers_.end();
  }
  uint32_t suffix() const { return suffix_; }

 private:
  friend class JsonSchemaCompiler;
  std::vector<Node> nodes_;
  uint32_t root_ = 0;
  uint32_t any_string_ = 0;
  std::vector<uint32_t> free_containers_;  // the free-form value's object and array
  uint32_t prefix_ = kNoText;
  uint32_t suffix_ = kNoText;
};

class JsonMatcher {
 public:
  explicit JsonMatcher(std::shared_ptr<const JsonGrammar> grammar,
                       ReasoningBlock reasoning = ReasoningBlock::kNone);
  // Copies the position only (the scratch space stays), reusing this matcher's storage.
  JsonMatcher(const JsonMatcher& other) : grammar_(other.grammar_), stacks_(other.stacks_) {}
  JsonMatcher& operator=(const JsonMatcher& other) {
    if (grammar_ != other.grammar_) grammar_ = other.grammar_;
    stacks_ = other.stacks_;
    return *this;
  }

  // Takes the bytes if every one of them can come next; otherwise returns false and the
  // matcher is unchanged.
  bool advance(std::string_view bytes);
  // Whether the document is complete here (it may still go on, as a number can).
  bool can_end() const;
  // Inside a string, between characters, where any run of plain characters (no quote,
  // backslash or control byte; whole UTF-8 sequences) of at most this many code points may come
  // next, and leaves the matcher inside the string. nullopt elsewhere.
  std::optional<uint64_t> plain_string_room() const;
  // The code points of `text` if a string takes it as plain text (no quote, backslash or control
  // byte; whole characters, by the same rules as the matcher's strings); nullopt otherwise.
  static std::optional<uint64_t> plain_string_characters(std::string_view text);
  // Inside the reasoning block (one stack): '\0' where any text without '<' leaves the matcher as
  // it is; else the next byte of the "</think>" its text so far began, where text without '<'
  // that begins with another byte leaves it as at '\0'. nullopt elsewhere.
  std::optional<char> reasoning_text() const;

  struct Frame {
    uint32_t node = 0;
    uint8_t kind = 0;
    uint8_t phase = 0;
    uint8_t whitespace = 0;
    uint8_t extra = 0;
    uint64_t a = 0, b = 0, c = 0;
    bool operator==(const Frame&) const = default;
  };
  using Stack = std::vector<Frame>;

 private:
  // Where the document begins: the root, inside the prefix text where the grammar has one.
  Stack document_start() const;
  // A byte of the reasoning block (or of the "<think>" that opens it).
  void reason(const Stack& stack, uint8_t byte, std::vector<Stack>& out) const;
  // A byte after "</think>": whitespace (a few bytes), or the document's first.
  void after_reasoning(const Stack& stack, uint8_t byte, std::vector<Stack>& out) const;
  void step(Stack stack, uint8_t byte, std::vector<Stack>& out) const;
  void consume(const Stack& stack, uint8_t byte, std::vector<Stack>& out) const;
  void open(Stack stack, uint32_t node, uint8_t byte, std::vector<Stack>& out) const;
  // A string's byte, or a literal's: the frame changes, nothing is pushed, popped or forked.
  bool step_in_place(Frame& frame, uint8_t byte) const;
  bool complete(const Frame& frame) const;
  // How deep the stack may be when `container` opens.
  size_t depth_limit(uint32_t container) const;
  void child_done(Frame& parent, const Frame& child) const;
  bool advance_byte(uint8_t byte);

  std::shared_ptr<const JsonGrammar> grammar_;
  std::vector<Stack> stacks_;
  std::vector<Stack> scratch_;
};

}  // namespace moeline::model
