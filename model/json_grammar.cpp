#include "model/json_grammar.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <set>

namespace moeline::model {

// The ordered document keeps an object's keys in the schema's order, which is the order the
// generated document gives its properties.
using json = nlohmann::ordered_json;
using Kind = JsonGrammar::Kind;

namespace {

// Whitespace between tokens as llama.cpp's JSON grammars allow it: none, one space, or a newline
// and up to 20 spaces or tabs of indentation. Frame::whitespace: 0 none yet, 1 after the one
// space, 2 + n after the newline and n indents.
constexpr uint8_t kMaxIndent = 20;
constexpr uint64_t kMaxIntegerDigits = 19;
constexpr uint64_t kMaxFractionDigits = 20;
constexpr uint64_t kMaxExponentDigits = 3;
// Nesting: a free-form value's objects and arrays (json_object mode, a property without a
// schema) at most 32 deep, which is never a dead end (they can always close); a schema's own up
// to 256, so that a recursive schema that requires its next level is not cut short where the
// answer still has room.
constexpr size_t kMaxFreeDepth = 32;
constexpr size_t kMaxDepth = 256;
constexpr size_t kMaxNodes = 4096;
constexpr size_t kMaxLiterals = 1024;
constexpr size_t kMaxProperties = 256;
constexpr size_t kMaxSchemaNesting = 128;
constexpr size_t kMaxAlternatives = 256;
// Forks of a union that are followed at once: beyond this the schema is too ambiguous to serve.
constexpr size_t kMaxStacks = 64;

// The assertions of the subset (annotations and unknown keywords are ignored).
const std::set<std::string, std::less<>> kAssertions = {
    "type",      "properties", "required", "additionalProperties",
    "items",     "minItems",   "maxItems", "minLength",
    "maxLength", "enum",       "const",    "anyOf",
    "oneOf",     "allOf",      "$ref"};
// Assertions outside the subset: refused by name.
const std::set<std::string, std::less<>> kUnsupported = {"pattern",
                                                         "patternProperties",
                                                         "minimum",
                                                         "maximum",
                                                         "exclusiveMinimum",
                                                         "exclusiveMaximum",
                                                         "multipleOf",
                                                         "uniqueItems",
                                                         "contains",
                                                         "minContains",
                                                         "maxContains",
                                                         "prefixItems",
                                                         "minProperties",
                                                         "maxProperties",
                                                         "propertyNames",
                                                         "dependentRequired",
                                                         "dependentSchemas",
                                                         "dependencies",
                                                         "if",
                                                         "then",
                                                         "else",
                                                         "not",
                                                         "unevaluatedProperties",
                                                         "unevaluatedItems",
                                                         "additionalItems",
                                                         "$dynamicRef",
                                                         "$recursiveRef",
                                                         "contentSchema"};

enum FrameKind : uint8_t {
  kRoot,
  kObjectFrame,
  kMapFrame,
  kArrayFrame,
  kStringFrame,
  kNumberFrame,
  kLiteralFrame
};
// Container phases.
enum Phase : uint8_t {
  kOpen,
  kKey,
  kColon,
  kValueNext,
  kValue,
  kAfterValue,
  kComma,
  kDone,
  kPrefix,
  kSuffix,          // the root, inside the text around the document
  kThinkOpening,    // the root, inside "<think>" (Frame::a: its bytes so far)
  kReasoning,       // the root, inside the reasoning (Frame::a: the bytes of "</think>" so far)
  kAfterReasoning,  // the root, in the whitespace after "</think>" (Frame::a: its bytes)
};
// The whitespace the document (or its prefix text) may follow "</think>" by (the models write
// "\n\n" there), and "<think>" the start of the answer.
constexpr uint64_t kMaxReasoningGap = 4;
constexpr std::string_view kThinkOpenText = "<think>";
constexpr std::string_view kThinkCloseText = "</think>";
// Number states.
enum NumberState : uint8_t { kMinus, kZero, kInt, kDot, kFraction, kE, kExponentSign, kExponent };
// String escape states (Frame::a): 0 none, 1 after '\', 2..5 reading the 4 hex digits of \u.
// Frame::extra: the first continuation byte's range after a UTF-8 lead (0: 80-BF, 1: A0-BF,
// 2: 80-9F, 3: 90-BF, 4: 80-8F); Frame::b: continuation bytes still to come; Frame::c: code
// points so far.

bool is_whitespace(uint8_t byte) {
  return byte == ' ' || byte == '\n' || byte == '\t';
}
bool is_digit(uint8_t byte) {
  return byte >= '0' && byte <= '9';
}
bool is_hex(uint8_t byte) {
  return is_digit(byte) || (byte >= 'a' && byte <= 'f') || (byte >= 'A' && byte <= 'F');
}

std::string pointer_child(const std::string& where, const std::string& key) {
  std::string escaped;
  for (char c : key) {
    if (c == '~')
      escaped += "~0";
    else if (c == '/')
      escaped += "~1";
    else
      escaped += c;
  }
  return where + "/" + escaped;
}

}  // namespace

class JsonSchemaCompiler {
 public:
  explicit JsonSchemaCompiler(const json& root)
      : root_(root), grammar_(std::make_shared<JsonGrammar>()) {}

  std::shared_ptr<const JsonGrammar> any_object() {
    add_builtins();
    grammar_->root_ = any_map_;
    return grammar_;
  }

  std::shared_ptr<const JsonGrammar> run(std::string_view prefix, std::string_view suffix) {
    add_builtins();
    grammar_->root_ = compile(root_, "", 0);
    check_no_left_recursion();
    flatten_unions();
    check_reachable_end();
    check_one_ofs();
    if (!prefix.empty()) grammar_->prefix_ = literals({{std::string(prefix), 0}});
    if (!suffix.empty()) grammar_->suffix_ = literals({{std::string(suffix), 0}});
    return grammar_;
  }

 private:
  [[noreturn]] static void fail(const std::string& where, const std::string& what) {
    throw StatusError("json_schema at " + (where.empty() ? std::string("the root") : where) + ": " +
                      what);
  }

  uint32_t add(JsonGrammar::Node node) {
    if (grammar_->nodes_.size() >= kMaxNodes)
      throw StatusError("json_schema is too large: more than " + std::to_string(kMaxNodes) +
                        " parts");
    grammar_->nodes_.push_back(std::move(node));
    return static_cast<uint32_t>(grammar_->nodes_.size() - 1);
  }

  uint32_t literals(std::vector<std::pair<std::string, uint32_t>> texts) {
    std::sort(texts.begin(), texts.end());
    texts.erase(std::unique(texts.begin(), texts.end(),
                            [](const auto& a, const auto& b) { return a.first == b.first; }),
                texts.end());
    JsonGrammar::Node node;
    node.kind = Kind::kLiterals;
    for (auto& [text, tag] : texts) {
      node.literals.push_back(std::move(text));
      node.tags.push_back(tag);
    }
    return add(std::move(node));
  }

  void add_builtins() {
    // any = object | array | string | number | true | false | null
    any_ = add({});
    any_map_ = add({.kind = Kind::kMap, .child = any_});
    const uint32_t any_array = add({.kind = Kind::kArray, .child = any_});
    grammar_->free_containers_ = {any_map_, any_array};
    grammar_->any_string_ = add({.kind = Kind::kString});
    const uint32_t number = add({.kind = Kind::kNumber});
    const uint32_t words = literals({{"true", 0}, {"false", 0}, {"null", 0}});
    grammar_->nodes_[any_].alternatives = {any_map_, any_array, grammar_->any_string_, number,
                                           words};
  }

  uint32_t compile(const json& schema, const std::string& where, int depth) {
    if (depth > 64) fail(where, "nested more than 64 deep");
    if (schema.is_boolean()) {
      if (!schema.get<bool>()) fail(where, "the schema false accepts nothing");
      return any_;
    }
    if (!schema.is_object()) fail(where, "a schema must be an object or a boolean");
    for (const auto& [key, value] : schema.items())
      if (kUnsupported.contains(key))
        fail(pointer_child(where, key), "the keyword '" + key + "' is not supported");

    // The keywords that combine or replace a schema take no other assertion beside them: it
    // would be ignored, and the document might then fail it.
    for (const char* keyword : {"$ref", "allOf", "anyOf", "oneOf", "const", "enum"}) {
      if (!schema.contains(keyword)) continue;
      const bool values =
          std::string_view(keyword) == "const" || std::string_view(keyword) == "enum";
      for (const auto& [key, value] : schema.items())
        if (kAssertions.contains(key) && key != keyword && !(values && key == "type"))
          fail(pointer_child(where, key),
               "'" + key + "' beside '" + keyword + "' is not supported");
    }
    if (auto ref = schema.find("$ref"); ref != schema.end()) return reference(*ref, where, depth);
    if (auto all = schema.find("allOf"); all != schema.end()) {
      if (!all->is_array() || all->size() != 1)
        fail(pointer_child(where, "allOf"), "only an allOf of one schema is supported");
      return compile((*all)[0], pointer_child(where, "allOf") + "/0", depth + 1);
    }
    for (const char* keyword : {"const", "enum"}) {
      auto found = schema.find(keyword);
      if (found == schema.end()) continue;
      const std::string at = pointer_child(where, keyword);
      const bool one = std::string_view(keyword) == "const";
      if (!one && (!found->is_array() || found->empty()))
        fail(at, "enum must be a non-empty array");
      if (!one && found->size() > kMaxLiterals)
        fail(at, "enum may list at most " + std::to_string(kMaxLiterals) + " values");
      // Beside a type, only the values of that type.
      std::vector<std::pair<std::string, uint32_t>> texts;
      for (const json& value : one ? json::array({*found}) : *found)
        if (!schema.contains("type") || of_type(value, schema["type"], where))
          texts.emplace_back(value.dump(), 0);
      if (texts.empty()) fail(at, "no value has the type beside it");
      return literals(std::move(texts));
    }
    for (const char* keyword : {"anyOf", "oneOf"}) {
      auto options = schema.find(keyword);
      if (options == schema.end()) continue;
      const std::string at = pointer_child(where, keyword);
      if (!options->is_array() || options->empty()) fail(at, "must be a non-empty array");
      JsonGrammar::Node node;
      for (size_t i = 0; i < options->size(); ++i)
        node.alternatives.push_back(
            compile((*options)[i], at + "/" + std::to_string(i), depth + 1));
      const uint32_t index = add(std::move(node));
      // oneOf: a document must match exactly one branch, which the grammar cannot count; served
      // where no document can match two (branches of different JSON types, or different values).
      if (std::string_view(keyword) == "oneOf") one_ofs_.emplace_back(index, at);
      return index;
    }

    std::vector<std::string> types;
    if (auto type = schema.find("type"); type != schema.end()) {
      if (type->is_string()) {
        types.push_back(type->get<std::string>());
      } else if (type->is_array() && !type->empty()) {
        for (const json& name : *type) {
          if (!name.is_string()) fail(pointer_child(where, "type"), "type names are strings");
          types.push_back(name.get<std::string>());
        }
      } else {
        fail(pointer_child(where, "type"), "type must be a name or a non-empty list of names");
      }
    } else if (schema.contains("properties") || schema.contains("required") ||
               schema.contains("additionalProperties")) {
      types.push_back("object");
    } else if (schema.contains("items") || schema.contains("minItems") ||
               schema.contains("maxItems")) {
      types.push_back("array");
    } else if (schema.contains("minLength") || schema.contains("maxLength")) {
      types.push_back("string");
    } else {
      return any_;
    }
    std::vector<uint32_t> typed;
    for (const std::string& type : types) typed.push_back(typed_node(schema, type, where, depth));
    if (typed.size() == 1) return typed[0];
    return add({.alternatives = std::move(typed)});
  }

  // Whether `value` has one of the JSON types `type` names.
  static bool of_type(const json& value, const json& type, const std::string& where) {
    std::vector<std::string> names;
    if (type.is_string())
      names.push_back(type.get<std::string>());
    else if (type.is_array())
      for (const json& name : type)
        if (name.is_string()) names.push_back(name.get<std::string>());
    if (names.empty()) fail(pointer_child(where, "type"), "type must be a name or a list of names");
    for (const std::string& name : names) {
      if ((name == "string" && value.is_string()) || (name == "number" && value.is_number()) ||
          (name == "integer" &&
           (value.is_number_integer() ||
            (value.is_number_float() && value.get<double>() == std::floor(value.get<double>())))) ||
          (name == "boolean" && value.is_boolean()) || (name == "null" && value.is_null()) ||
          (name == "object" && value.is_object()) || (name == "array" && value.is_array()))
        return true;
    }
    return false;
  }

  uint32_t reference(const json& ref, const std::string& where, int depth) {
    const std::string at = pointer_child(where, "$ref");
    if (!ref.is_string()) fail(at, "$ref must be a string");
    const std::string target = ref.get<std::string>();
    if (auto known = references_.find(target); known != references_.end()) return known->second;
    const json* resolved = nullptr;
    if (target == "#") {
      resolved = &root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        const std::string_view p(prefix);
        if (target.rfind(p, 0) != 0) continue;
        const std::string name = target.substr(p.size());
        auto defs = root_.find(std::string(p.substr(2, p.size() - 3)));
        if (defs == root_.end() || !defs->is_object()) continue;
        if (auto found = defs->find(name); found != defs->end()) resolved = &*found;
      }
    }
    if (resolved == nullptr)
      fail(at, "'" + target +
                   "' is not a reference to '#', '#/$defs/NAME' or '#/definitions/NAME' "
                   "that this schema defines");
    // A placeholder first, so that a schema that refers to itself ends.
    const uint32_t placeholder = add({});
    references_[target] = placeholder;
    const uint32_t compiled = compile(*resolved, target.substr(1), depth + 1);
    grammar_->nodes_[placeholder].alternatives = {compiled};
    return placeholder;
  }

  uint64_t bound(const json& schema, const char* keyword, uint64_t fallback,
                 const std::string& where) {
    auto value = schema.find(keyword);
    if (value == schema.end()) return fallback;
    if (!value->is_number_integer() || value->get<int64_t>() < 0)
      fail(pointer_child(where, keyword), "must be a non-negative integer");
    return value->get<uint64_t>();
  }

  uint32_t typed_node(const json& schema, const std::string& type, const std::string& where,
                      int depth) {
    if (type == "object") return object_node(schema, where, depth);
    if (type == "array") {
      JsonGrammar::Node node{.kind = Kind::kArray};
      if (auto items = schema.find("items"); items != schema.end()) {
        if (items->is_array())
          fail(pointer_child(where, "items"), "a list of item schemas is not supported");
        node.child = compile(*items, pointer_child(where, "items"), depth + 1);
      } else {
        node.child = any_;
      }
      node.min = bound(schema, "minItems", 0, where);
      node.max = bound(schema, "maxItems", UINT64_MAX, where);
      if (node.min > node.max) fail(where, "minItems is above maxItems");
      if (node.min > 1024) fail(pointer_child(where, "minItems"), "at most 1024 is supported");
      return add(std::move(node));
    }
    if (type == "string") {
      JsonGrammar::Node node{.kind = Kind::kString};
      node.min = bound(schema, "minLength", 0, where);
      node.max = bound(schema, "maxLength", UINT64_MAX, where);
      if (node.min > node.max) fail(where, "minLength is above maxLength");
      return add(std::move(node));
    }
    if (type == "number") return add({.kind = Kind::kNumber});
    if (type == "integer") return add({.kind = Kind::kInteger});
    if (type == "boolean") return literals({{"true", 0}, {"false", 0}});
    if (type == "null") return literals({{"null", 0}});
    fail(pointer_child(where, "type"), "unknown type '" + type + "'");
  }

  uint32_t object_node(const json& schema, const std::string& where, int depth) {
    const json properties = schema.value("properties", json::object());
    if (!properties.is_object()) fail(pointer_child(where, "properties"), "must be an object");
    std::set<std::string> required;
    if (auto names = schema.find("required"); names != schema.end()) {
      if (!names->is_array()) fail(pointer_child(where, "required"), "must be a list of names");
      for (const json& name : *names) {
        if (!name.is_string() || !properties.contains(name.get<std::string>()))
          fail(pointer_child(where, "required"),
               "names " + name.dump() + ", which is not one of the properties");
        required.insert(name.get<std::string>());
      }
    }
    const json additional = schema.value("additionalProperties", json(true));
    if (properties.empty() && !(additional.is_boolean() && !additional.get<bool>())) {
      // A map: any keys, every value of one schema.
      const uint32_t values =
          compile(additional, pointer_child(where, "additionalProperties"), depth + 1);
      return add({.kind = Kind::kMap, .child = values});
    }
    if (properties.size() > kMaxProperties)
      fail(pointer_child(where, "properties"),
           "at most " + std::to_string(kMaxProperties) + " properties are supported");
    JsonGrammar::Node node{.kind = Kind::kObject};
    for (const auto& [name, property] : properties.items()) {
      node.properties.push_back(
          {compile(property, pointer_child(pointer_child(where, "properties"), name), depth + 1),
           required.contains(name), json(name).dump()});
    }
    const size_t n = node.properties.size();
    node.required_from.assign(n + 1, false);
    for (size_t i = n; i-- > 0;)
      node.required_from[i] = node.required_from[i + 1] || node.properties[i].required;
    node.key_choices = key_choices(node.properties, std::vector<bool>(n, true));
    return add(std::move(node));
  }

  // For each next-property index i, the keys that may come next: the offered properties from i
  // up to the first required one.
  std::vector<uint32_t> key_choices(std::vector<JsonGrammar::Property> properties,
                                    const std::vector<bool>& offered) {
    std::vector<uint32_t> out;
    for (size_t i = 0; i < properties.size(); ++i) {
      std::vector<std::pair<std::string, uint32_t>> choices;
      for (size_t j = i; j < properties.size(); ++j) {
        if (offered[j]) choices.emplace_back(properties[j].key, static_cast<uint32_t>(j));
        if (properties[j].required) break;
      }
      out.push_back(literals(std::move(choices)));
    }
    return out;
  }

  // A schema whose every document must go on forever (an object that requires itself) has no
  // document the matcher could finish; it is refused here rather than found out mid-answer.
  void check_reachable_end() {
    std::vector<bool> finite(grammar_->nodes_.size(), false);
    for (bool changed = true; changed;) {
      changed = false;
      for (size_t i = 0; i < finite.size(); ++i) {
        if (finite[i]) continue;
        const JsonGrammar::Node& node = grammar_->nodes_[i];
        bool ok = false;
        switch (node.kind) {
          case Kind::kUnion:
            ok = std::any_of(node.alternatives.begin(), node.alternatives.end(),
                             [&](uint32_t a) { return finite[a]; });
            break;
          case Kind::kObject:
            ok = std::all_of(
                node.properties.begin(), node.properties.end(),
                [&](const JsonGrammar::Property& p) { return !p.required || finite[p.node]; });
            break;
          case Kind::kArray:
            ok = node.min == 0 || finite[node.child];
            break;
          default:
            ok = true;
        }
        if (ok) finite[i] = changed = true;
      }
    }
    if (!finite[grammar_->root_]) throw StatusError("json_schema has no finite document");
    // What could never end is never offered: a union's endless alternatives, an optional
    // property whose value has no end, the items of an array that may be empty, a map's values.
    auto& nodes = grammar_->nodes_;
    for (size_t i = 0; i < finite.size(); ++i) {
      if (!finite[i]) continue;
      if (nodes[i].kind == Kind::kUnion) {
        std::erase_if(nodes[i].alternatives, [&](uint32_t a) { return !finite[a]; });
      } else if (nodes[i].kind == Kind::kArray && !finite[nodes[i].child]) {
        nodes[i].max = 0;
      } else if (nodes[i].kind == Kind::kMap && !finite[nodes[i].child]) {
        nodes[i] = JsonGrammar::Node{.kind = Kind::kObject, .required_from = {false}};
      } else if (nodes[i].kind == Kind::kObject) {
        std::vector<bool> offered;
        for (const JsonGrammar::Property& property : nodes[i].properties)
          offered.push_back(finite[property.node]);
        if (std::find(offered.begin(), offered.end(), false) != offered.end()) {
          // (key_choices adds nodes: no reference into `nodes` is held across it.)
          std::vector<uint32_t> choices = key_choices(nodes[i].properties, offered);
          nodes[i].key_choices = std::move(choices);
        }
      }
    }
  }

  // Every union's alternatives become the containers and scalars it reaches through unions
  // (nested anyOf, $ref placeholders), each once: the matcher then forks once per real choice,
  // never through a chain of unions (which shared $refs could make exponential).
  void flatten_unions() {
    auto& nodes = grammar_->nodes_;
    std::vector<std::vector<uint32_t>> leaves(nodes.size());
    std::vector<bool> done(nodes.size(), false);
    // Unions reach unions only without a cycle (checked before): depth-first, children first.
    std::function<void(uint32_t)> visit = [&](uint32_t u) {
      if (done[u]) return;
      std::vector<uint32_t> out;
      for (uint32_t a : nodes[u].alternatives) {
        if (nodes[a].kind == Kind::kUnion) {
          visit(a);
          out.insert(out.end(), leaves[a].begin(), leaves[a].end());
        } else {
          out.push_back(a);
        }
      }
      std::sort(out.begin(), out.end());
      out.erase(std::unique(out.begin(), out.end()), out.end());
      if (out.size() > kMaxAlternatives)
        throw StatusError("json_schema has a union of more than " +
                          std::to_string(kMaxAlternatives) +
                          " alternatives (nested anyOf and $ref counted)");
      leaves[u] = std::move(out);
      done[u] = true;
    };
    for (uint32_t u = 0; u < nodes.size(); ++u)
      if (nodes[u].kind == Kind::kUnion) visit(u);
    for (uint32_t u = 0; u < nodes.size(); ++u)
      if (nodes[u].kind == Kind::kUnion) nodes[u].alternatives = leaves[u];
  }

  // What a node's documents begin with, for oneOf: the JSON types it produces, and for literals
  // their texts.
  struct Shape {
    std::set<std::string> types;
    std::set<std::string> literals;
  };
  Shape shape_of(uint32_t index) const {
    const JsonGrammar::Node& node = grammar_->nodes_[index];
    Shape shape;
    switch (node.kind) {
      case Kind::kUnion:
        for (uint32_t a : node.alternatives) {
          Shape inner = shape_of(a);
          shape.types.insert(inner.types.begin(), inner.types.end());
          shape.literals.insert(inner.literals.begin(), inner.literals.end());
        }
        break;
      case Kind::kObject:
      case Kind::kMap:
        shape.types = {"object"};
        break;
      case Kind::kArray:
        shape.types = {"array"};
        break;
      case Kind::kString:
        shape.types = {"string"};
        break;
      case Kind::kNumber:
      case Kind::kInteger:
        shape.types = {"number"};
        break;
      case Kind::kLiterals:
        shape.literals.insert(node.literals.begin(), node.literals.end());
        break;
    }
    return shape;
  }
  static std::string type_of_literal(const std::string& text) {
    switch (text[0]) {
      case '"':
        return "string";
      case '{':
        return "object";
      case '[':
        return "array";
      case 't':
      case 'f':
        return "boolean";
      case 'n':
        return "null";
      default:
        return "number";
    }
  }
  void check_one_ofs() const {
    for (const auto& [index, where] : one_ofs_) {
      const auto& branches = grammar_->nodes_[index].alternatives;
      std::vector<Shape> shapes;
      for (uint32_t b : branches) shapes.push_back(shape_of(b));
      for (size_t i = 0; i < shapes.size(); ++i)
        for (size_t j = i + 1; j < shapes.size(); ++j) {
          bool overlap = false;
          for (const std::string& t : shapes[i].types) overlap |= shapes[j].types.contains(t);
          for (const std::string& l : shapes[i].literals)
            overlap |=
                shapes[j].literals.contains(l) || shapes[j].types.contains(type_of_literal(l));
          for (const std::string& l : shapes[j].literals)
            overlap |= shapes[i].types.contains(type_of_literal(l));
          if (overlap)
            fail(where,
                 "oneOf branches that one document could match both are not supported "
                 "(anyOf is)");
        }
    }
  }

  // A union that reaches itself through unions alone ({"$defs": {"a": {"anyOf": [{"$ref":
  // "#/$defs/a"}, ...]}}}) would be opened without end at the first byte: refused.
  void check_no_left_recursion() {
    const auto& nodes = grammar_->nodes_;
    std::vector<uint8_t> state(nodes.size(), 0);  // 0 unseen, 1 on the path, 2 done
    std::vector<std::pair<uint32_t, size_t>> path;
    for (uint32_t start = 0; start < nodes.size(); ++start) {
      if (state[start] != 0 || nodes[start].kind != Kind::kUnion) continue;
      path = {{start, 0}};
      state[start] = 1;
      while (!path.empty()) {
        auto& [node, next] = path.back();
        const std::vector<uint32_t>& alternatives = nodes[node].alternatives;
        if (next == alternatives.size()) {
          state[node] = 2;
          path.pop_back();
          continue;
        }
        const uint32_t alternative = alternatives[next++];
        if (nodes[alternative].kind != Kind::kUnion || state[alternative] == 2) continue;
        if (state[alternative] == 1)
          throw StatusError(
              "json_schema refers to itself with no value in between (a $ref that is its own "
              "first alternative): no document could begin");
        state[alternative] = 1;
        path.emplace_back(alternative, 0);
      }
    }
  }

  const json& root_;
  std::shared_ptr<JsonGrammar> grammar_;
  std::map<std::string, uint32_t> references_;
  std::vector<std::pair<uint32_t, std::string>> one_ofs_;  // oneOf unions, and where they are
  uint32_t any_ = 0;
  uint32_t any_map_ = 0;
};

std::shared_ptr<const JsonGrammar> JsonGrammar::any_object() {
  static const std::shared_ptr<const JsonGrammar> grammar = [] {
    const json empty = json::object();
    return JsonSchemaCompiler(empty).any_object();
  }();
  return grammar;
}

Expected<std::shared_ptr<const JsonGrammar>> JsonGrammar::compile(std::string_view schema_text,
                                                                  std::string_view prefix,
                                                                  std::string_view suffix) {
  if (schema_text.size() > kMaxJsonSchemaBytes)
    return Error{"json_schema is " + std::to_string(schema_text.size()) + " bytes; at most " +
                 std::to_string(kMaxJsonSchemaBytes) + " are accepted"};
  // Nesting is bounded before the parse: values are copied and written back (enum, const)
  // recursively.
  if (json_text_depth(schema_text) > kMaxSchemaNesting)
    return Error{"json_schema is nested more than " + std::to_string(kMaxSchemaNesting) + " deep"};
  const json schema = json::parse(schema_text, nullptr, false);
  if (schema.is_discarded()) return Error{"json_schema is not valid JSON"};
  try {
    return JsonSchemaCompiler(schema).run(prefix, suffix);
  } catch (const StatusError& error) {
    return error.error();
  } catch (const json::exception& error) {
    return Error{std::string("json_schema: ") + error.what()};
  }
}

size_t json_text_depth(std::string_view text) {
  size_t depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
    } else if ((c == '}' || c == ']') && depth > 0) {
      --depth;
    }
  }
  return deepest;
}

// ---------------------------------------------------------------------------------------------

JsonMatcher::JsonMatcher(std::shared_ptr<const JsonGrammar> grammar, ReasoningBlock reasoning)
    : grammar_(std::move(grammar)) {
  if (reasoning != ReasoningBlock::kNone) {
    Frame root;
    root.kind = kRoot;
    root.node = grammar_->root();
    root.phase = reasoning == ReasoningBlock::kOpen ? kReasoning : kThinkOpening;
    stacks_.push_back({root});
  }
  if (reasoning != ReasoningBlock::kOpen) stacks_.push_back(document_start());
}

JsonMatcher::Stack JsonMatcher::document_start() const {
  Frame root;
  root.kind = kRoot;
  root.phase = kValueNext;
  root.node = grammar_->root();
  Stack stack = {root};
  if (grammar_->prefix() != JsonGrammar::kNoText) {
    stack[0].phase = kPrefix;
    Frame text;
    text.kind = kLiteralFrame;
    text.node = grammar_->prefix();
    text.b = 1;
    stack.push_back(text);
  }
  return stack;
}

void JsonMatcher::reason(const Stack& stack, uint8_t byte, std::vector<Stack>& out) const {
  const Frame& root = stack.back();
  Stack next = stack;
  if (root.phase == kThinkOpening) {
    // GLM-4.5 begins its answer with "\n<think>": a few bytes of whitespace may come first.
    if (root.a == 0 && (is_whitespace(byte) || byte == '\r')) {
      if (root.whitespace >= kMaxReasoningGap) return;
      ++next.back().whitespace;
      out.push_back(std::move(next));
      return;
    }
    if (byte != static_cast<uint8_t>(kThinkOpenText[root.a])) return;
    if (++next.back().a == kThinkOpenText.size()) next.back().phase = kReasoning, next.back().a = 0;
    out.push_back(std::move(next));
    return;
  }
  // The bytes of "</think>" so far ('<' begins it again: it occurs only first).
  uint64_t matched = byte == static_cast<uint8_t>(kThinkCloseText[root.a]) ? root.a + 1
                     : byte == '<'                                         ? 1
                                                                           : 0;
  if (matched == kThinkCloseText.size()) next.back().phase = kAfterReasoning, matched = 0;
  next.back().a = matched;
  out.push_back(std::move(next));
}

void JsonMatcher::after_reasoning(const Stack& stack, uint8_t byte, std::vector<Stack>& out) const {
  if (is_whitespace(byte) || byte == '\r') {
    if (stack.back().a >= kMaxReasoningGap) return;
    Stack next = stack;
    ++next.back().a;
    out.push_back(std::move(next));
    return;
  }
  step(document_start(), byte, out);
}

std::optional<char> JsonMatcher::reasoning_text() const {
  if (stacks_.size() != 1 || stacks_[0].size() != 1) return std::nullopt;
  const Frame& root = stacks_[0][0];
  if (root.phase != kReasoning) return std::nullopt;
  return root.a == 0 ? '\0' : kThinkCloseText[root.a];
}

size_t JsonMatcher::depth_limit(uint32_t container) const {
  return grammar_->free_container(container) ? kMaxFreeDepth : kMaxDepth;
}

bool JsonMatcher::complete(const Frame& frame) const {
  switch (frame.kind) {
    case kObjectFrame:
    case kMapFrame:
    case kArrayFrame:
    case kStringFrame:
      return frame.phase == kDone;
    case kNumberFrame:
      return frame.phase == kZero || frame.phase == kInt || frame.phase == kFraction ||
             frame.phase == kExponent;
    case kLiteralFrame: {
      const JsonGrammar::Node& node = grammar_->node(frame.node);
      return frame.a < frame.b && node.literals[frame.a].size() == frame.c;
    }
    default:
      return false;
  }
}

void JsonMatcher::child_done(Frame& parent, const Frame& child) const {
  if (parent.phase == kKey) {
    if (parent.kind == kObjectFrame) {
      const JsonGrammar::Node& keys = grammar_->node(child.node);
      const uint32_t property = keys.tags[child.a];
      parent.a = property + 1;
      parent.b = grammar_->node(parent.node).properties[property].node;
    }
    parent.phase = kColon;
  } else if (parent.kind == kRoot && parent.phase != kValue) {
    parent.phase = parent.phase == kPrefix ? kValueNext : kDone;  // after the prefix, the suffix
  } else {
    parent.phase = kAfterValue;
    if (parent.kind == kArrayFrame) ++parent.a;
  }
  parent.whitespace = 0;
}

void JsonMatcher::open(Stack stack, uint32_t node_index, uint8_t byte,
                       std::vector<Stack>& out) const {
  const JsonGrammar::Node& node = grammar_->node(node_index);
  Frame frame;
  frame.node = node_index;
  switch (node.kind) {
    case Kind::kUnion:
      for (uint32_t alternative : node.alternatives) open(stack, alternative, byte, out);
      return;
    case Kind::kObject:
    case Kind::kMap:
      if (byte != '{' || stack.size() >= depth_limit(node_index)) return;
      frame.kind = node.kind == Kind::kObject ? kObjectFrame : kMapFrame;
      frame.phase = kOpen;
      break;
    case Kind::kArray:
      if (byte != '[' || stack.size() >= depth_limit(node_index)) return;
      frame.kind = kArrayFrame;
      frame.phase = kOpen;
      break;
    case Kind::kString:
      if (byte != '"') return;
      frame.kind = kStringFrame;
      frame.phase = kOpen;
      break;
    case Kind::kNumber:
    case Kind::kInteger:
      frame.kind = kNumberFrame;
      if (byte == '-')
        frame.phase = kMinus;
      else if (byte == '0')
        frame.phase = kZero;
      else if (is_digit(byte))
        frame.phase = kInt, frame.a = 1;
      else
        return;
      break;
    case Kind::kLiterals:
      frame.kind = kLiteralFrame;
      frame.a = 0;
      frame.b = node.literals.size();
      frame.c = 0;
      stack.push_back(frame);
      consume(stack, byte, out);
      return;
  }
  stack.push_back(frame);
  out.push_back(std::move(stack));
}

void JsonMatcher::consume(const Stack& stack, uint8_t byte, std::vector<Stack>& out) const {
  const Frame& top = stack.back();
  const JsonGrammar::Node& node = grammar_->node(top.node);
  auto with = [&](auto change) {
    Stack next = stack;
    change(next.back());
    out.push_back(std::move(next));
  };
  // Whitespace between tokens, in the phases that allow it.
  auto whitespace = [&]() {
    uint8_t next = 0;
    if (top.whitespace == 0)
      next = byte == ' ' ? 1 : byte == '\n' ? 2 : 0;
    else if (top.whitespace >= 2 && byte != '\n' && top.whitespace < 2 + kMaxIndent)
      next = static_cast<uint8_t>(top.whitespace + 1);
    if (next == 0) return;
    with([next](Frame& f) { f.whitespace = next; });
  };
  auto open_value = [&](uint32_t child) {
    Stack next = stack;
    next.back().phase = kValue;
    next.back().whitespace = 0;
    open(std::move(next), child, byte, out);
  };
  auto open_key = [&]() {
    Stack next = stack;
    next.back().phase = kKey;
    next.back().whitespace = 0;
    open(std::move(next),
         top.kind == kObjectFrame ? node.key_choices[top.a] : grammar_->any_string(), byte, out);
  };

  switch (top.kind) {
    case kRoot:
      if (top.phase == kThinkOpening || top.phase == kReasoning) return reason(stack, byte, out);
      if (top.phase == kAfterReasoning) return after_reasoning(stack, byte, out);
      if (top.phase != kValueNext && top.phase != kAfterValue) return;
      if (is_whitespace(byte)) return whitespace();
      if (top.phase == kValueNext) {
        open_value(top.node);
      } else if (grammar_->suffix() != JsonGrammar::kNoText) {
        Stack next = stack;
        next.back().phase = kSuffix;
        open(std::move(next), grammar_->suffix(), byte, out);
      }
      return;

    case kObjectFrame:
    case kMapFrame: {
      const bool map = top.kind == kMapFrame;
      const bool may_close = map || !node.required_from[top.a];
      const uint32_t value = map ? node.child : static_cast<uint32_t>(top.b);
      switch (top.phase) {
        case kOpen:
        case kComma:
          if (is_whitespace(byte)) return whitespace();
          if (byte == '}' && top.phase == kOpen && may_close)
            return with([](Frame& f) { f.phase = kDone; });
          if (byte == '"' && (map || top.a < node.properties.size())) open_key();
          return;
        case kColon:
          if (is_whitespace(byte)) return whitespace();
          if (byte == ':') with([](Frame& f) { f.phase = kValueNext, f.whitespace = 0; });
          return;
        case kValueNext:
          if (is_whitespace(byte)) return whitespace();
          open_value(value);
          return;
        case kAfterValue:
          if (is_whitespace(byte)) return whitespace();
          if (byte == ',' && (map || top.a < node.properties.size()))
            return with([](Frame& f) { f.phase = kComma, f.whitespace = 0; });
          if (byte == '}' && may_close) with([](Frame& f) { f.phase = kDone; });
          return;
        default:
          return;
      }
    }

    case kArrayFrame:
      switch (top.phase) {
        case kOpen:
          if (is_whitespace(byte)) return whitespace();
          if (byte == ']') {
            if (node.min == 0) with([](Frame& f) { f.phase = kDone; });
            return;
          }
          if (node.max > 0) open_value(node.child);
          return;
        case kValueNext:
          if (is_whitespace(byte)) return whitespace();
          open_value(node.child);
          return;
        case kAfterValue:
          if (is_whitespace(byte)) return whitespace();
          if (byte == ',' && top.a < node.max)
            return with([](Frame& f) { f.phase = kValueNext, f.whitespace = 0; });
          if (byte == ']' && top.a >= node.min) with([](Frame& f) { f.phase = kDone; });
          return;
        default:
          return;
      }

    case kStringFrame:
      if (top.phase == kDone) return;
      [[fallthrough]];
    case kLiteralFrame: {
      Frame next = top;
      if (step_in_place(next, byte)) with([&next](Frame& f) { f = next; });
      return;
    }

    case kNumberFrame: {
      const bool integer = node.kind == Kind::kInteger;
      auto to = [&](uint8_t phase, uint64_t digits) {
        with([&](Frame& f) { f.phase = phase, f.a = digits; });
      };
      switch (top.phase) {
        case kMinus:
          if (byte == '0')
            to(kZero, 1);
          else if (is_digit(byte))
            to(kInt, 1);
          return;
        case kZero:
        case kInt:
          if (top.phase == kInt && is_digit(byte) && top.a < kMaxIntegerDigits)
            return to(kInt, top.a + 1);
          if (integer) return;
          if (byte == '.')
            to(kDot, 0);
          else if (byte == 'e' || byte == 'E')
            to(kE, 0);
          return;
        case kDot:
          if (is_digit(byte)) to(kFraction, 1);
          return;
        case kFraction:
          if (is_digit(byte) && top.a < kMaxFractionDigits) return to(kFraction, top.a + 1);
          if (byte == 'e' || byte == 'E') to(kE, 0);
          return;
        case kE:
          if (byte == '+' || byte == '-')
            to(kExponentSign, 0);
          else if (is_digit(byte))
            to(kExponent, 1);
          return;
        case kExponentSign:
          if (is_digit(byte)) to(kExponent, 1);
          return;
        case kExponent:
          if (is_digit(byte) && top.a < kMaxExponentDigits) to(kExponent, top.a + 1);
          return;
        default:
          return;
      }
    }
  }
}

bool JsonMatcher::step_in_place(Frame& f, uint8_t byte) const {
  const JsonGrammar::Node& node = grammar_->node(f.node);
  if (f.kind == kLiteralFrame) {
    // The literals in [a, b) share the first c bytes; keep those whose next byte is this one.
    uint64_t lo = f.a;
    while (lo < f.b && (node.literals[lo].size() <= f.c ||
                        static_cast<uint8_t>(node.literals[lo][f.c]) != byte))
      ++lo;
    if (lo == f.b) return false;
    uint64_t hi = lo;
    while (hi < f.b && node.literals[hi].size() > f.c &&
           static_cast<uint8_t>(node.literals[hi][f.c]) == byte)
      ++hi;
    f.a = lo, f.b = hi, ++f.c;
    return true;
  }
  // A string, before its closing quote.
  if (f.b > 0) {  // inside a UTF-8 sequence
    static constexpr uint8_t kLow[] = {0x80, 0xA0, 0x80, 0x90, 0x80};
    static constexpr uint8_t kHigh[] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
    if (byte < kLow[f.extra] || byte > kHigh[f.extra]) return false;
    --f.b, f.extra = 0;
    return true;
  }
  if (f.a == 1) {  // after a backslash
    if (byte == 'u') {
      f.a = 2;
      return true;
    }
    if (std::string_view("\"\\/bfnrt").find(static_cast<char>(byte)) == std::string_view::npos)
      return false;
    f.a = 0, ++f.c;
    return true;
  }
  if (f.a >= 2) {  // the hex digits of \u; no surrogates (D800-DFFF)
    if (!is_hex(byte)) return false;
    const uint8_t lower = static_cast<uint8_t>(byte | 0x20);
    if (f.a == 3 && f.extra == 1 && lower >= '8') return false;
    if (f.a == 2) f.extra = lower == 'd' ? 1 : 0;
    if (++f.a == 6) f.a = 0, f.extra = 0, ++f.c;
    return true;
  }
  if (byte == '"') {
    if (f.c < node.min) return false;
    f.phase = kDone;
    return true;
  }
  if (byte < 0x20 || f.c >= node.max) return false;
  if (byte == '\\') {
    f.a = 1;
    return true;
  }
  uint8_t continuation = 0, range = 0;
  if (byte < 0x80)
    continuation = 0;
  else if (byte >= 0xC2 && byte <= 0xDF)
    continuation = 1;
  else if (byte == 0xE0)
    continuation = 2, range = 1;
  else if (byte == 0xED)
    continuation = 2, range = 2;
  else if (byte >= 0xE1 && byte <= 0xEF)
    continuation = 2;
  else if (byte == 0xF0)
    continuation = 3, range = 3;
  else if (byte >= 0xF1 && byte <= 0xF3)
    continuation = 3;
  else if (byte == 0xF4)
    continuation = 3, range = 4;
  else
    return false;
  f.b = continuation, f.extra = range, ++f.c;
  return true;
}

void JsonMatcher::step(Stack stack, uint8_t byte, std::vector<Stack>& out) const {
  consume(stack, byte, out);
  // A complete value may also end here, and the byte then belongs to what holds it.
  if (stack.size() > 1 && complete(stack.back())) {
    const Frame child = stack.back();
    stack.pop_back();
    child_done(stack.back(), child);
    step(std::move(stack), byte, out);
  }
}

bool JsonMatcher::advance_byte(uint8_t byte) {
  // Most bytes of a document are a string's or a literal's before its end, where nothing can
  // pop or fork: taken in place (the general step below gives the same frame).
  if (stacks_.size() == 1) {
    Frame& top = stacks_[0].back();
    if (top.kind == kRoot && top.phase == kReasoning && byte != '<' && top.a == 0)
      return true;  // reasoning text: nothing changes until a '<'
    if ((top.kind == kStringFrame && top.phase != kDone) ||
        (top.kind == kLiteralFrame && !complete(top))) {
      Frame next = top;
      if (!step_in_place(next, byte)) return false;
      top = next;
      return true;
    }
  }
  scratch_.clear();
  for (const Stack& stack : stacks_) step(stack, byte, scratch_);
  if (scratch_.empty()) return false;
  // Forks that met again are one.
  std::vector<Stack> unique;
  for (Stack& stack : scratch_)
    if (std::find(unique.begin(), unique.end(), stack) == unique.end())
      unique.push_back(std::move(stack));
  if (unique.size() > kMaxStacks) unique.resize(kMaxStacks);
  stacks_ = std::move(unique);
  return true;
}

bool JsonMatcher::advance(std::string_view bytes) {
  if (bytes.size() == 1) return advance_byte(static_cast<uint8_t>(bytes[0]));
  std::vector<Stack> saved = stacks_;
  for (char c : bytes)
    if (!advance_byte(static_cast<uint8_t>(c))) {
      stacks_ = std::move(saved);
      return false;
    }
  return true;
}

bool JsonMatcher::can_end() const {
  for (Stack stack : stacks_) {
    while (stack.size() > 1 && complete(stack.back())) {
      const Frame child = stack.back();
      stack.pop_back();
      child_done(stack.back(), child);
    }
    if (stack.size() != 1) continue;
    const bool suffix = grammar_->suffix() != JsonGrammar::kNoText;
    if (stack[0].phase == (suffix ? kDone : kAfterValue)) return true;
  }
  return false;
}

std::optional<uint64_t> JsonMatcher::plain_string_characters(std::string_view text) {
  static const JsonMatcher matcher(JsonGrammar::any_object());
  Frame string;
  string.kind = kStringFrame;
  string.node = matcher.grammar_->any_string();
  for (char c : text) {
    const auto byte = static_cast<uint8_t>(c);
    // A quote would end the string and a backslash begin an escape: not plain text.
    if (byte == '"' || byte == '\\' || !matcher.step_in_place(string, byte)) return std::nullopt;
  }
  if (string.b != 0) return std::nullopt;  // a character split at the end
  return string.c;
}

std::optional<uint64_t> JsonMatcher::plain_string_room() const {
  if (stacks_.size() != 1) return std::nullopt;
  const Frame& top = stacks_[0].back();
  if (top.kind != kStringFrame || top.phase == kDone || top.a != 0 || top.b != 0)
    return std::nullopt;
  const uint64_t max = grammar_->node(top.node).max;
  return max - std::min(max, top.c);
}

}  // namespace moeline::model
