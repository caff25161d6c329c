#pragma once
// The values a template computes with, modelled on the Python objects jinja2 sees: None, bool,
// int, float, str, list, tuple, dict, jinja2's Undefined, namespace() objects and callables
// (globals, macros, bound methods). Lists and dicts are shared by pointer, like Python references;
// the sandbox never mutates them (only namespace attributes change). Not thread-safe; a Value
// lives within one render.

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moeline::tokenizer::jinja {

// Thrown inside the engine for any failure and turned into an Error at the API boundary; `line`
// is filled in by the innermost node that knows its line.
class RenderError : public std::runtime_error {
 public:
  explicit RenderError(const std::string& message, int at_line = 0, bool by_template = false)
      : std::runtime_error(message), line(at_line), raised(by_template) {}
  int line;
  bool raised;  // by the template itself, through raise_exception()
};
[[noreturn]] void fail(const std::string& message);
// Joins pieces; also sidesteps GCC 12's false -Wrestrict on `"literal" + std::string`.
std::string cat(std::initializer_list<std::string_view> parts);

class Value;
using List = std::vector<Value>;
struct Dict;
struct Callable;
struct CallArgs;

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kTuple,
    kIterator,  // one-shot, like the generators jinja2's map/select/items/... filters return
    kDict,
    kNamespace,
    kCallable
  };

  Value() = default;  // Undefined
  static Value undefined(std::string hint);
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value real(double d);
  static Value string(std::string s);
  static Value list(List items);
  static Value tuple(List items);
  static Value iterator(List items);
  // A str marked safe (jinja2's Markup, from the safe and escape filters): `+` with a plain str
  // HTML-escapes the plain side.
  static Value markup(std::string s);
  static Value dict(std::shared_ptr<Dict> d);
  static Value name_space(std::shared_ptr<Dict> d);
  static Value callable(std::string name, std::function<Value(CallArgs&)> fn);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_integral() const { return is_int() || is_bool(); }  // Python: bool is an int
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return kind_ == Kind::kString && bool_; }
  bool is_iterator() const { return kind_ == Kind::kIterator; }
  bool is_sequence() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_callable() const { return kind_ == Kind::kCallable; }

  bool as_bool() const { return bool_; }
  int64_t as_int() const { return is_bool() ? int64_t{bool_} : int_; }
  double as_double() const { return is_float() ? real_ : static_cast<double>(as_int()); }
  const std::string& as_string() const { return text_; }
  // The reason this value is undefined ("'x' is undefined"), for the error raised on use.
  const std::string& undefined_hint() const { return text_; }
  const List& items() const { return *list_; }
  // Consumes an iterator: its items, leaving it empty as a spent Python generator.
  List take_items() const;
  Dict& mapping() const { return *dict_; }
  const std::shared_ptr<Dict>& mapping_ptr() const { return dict_; }
  Callable& function() const { return *callable_; }

  // Python's truth value, str() and repr().
  bool truthy() const;
  std::string str() const;
  std::string repr() const;
  // jinja2's object type names in messages: "dict object", "str object", ...
  std::string type_name() const;

 private:
  Kind kind_ = Kind::kUndefined;
  bool bool_ = false;
  int64_t int_ = 0;
  double real_ = 0;
  std::string text_;
  std::shared_ptr<List> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<Callable> callable_;
};

// An insertion-ordered mapping (Python dicts keep insertion order). Lookups are linear: chat
// contexts hold small dicts, and the render limits bound everything else.
struct Dict {
  std::vector<std::pair<Value, Value>> entries;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
  void set(Value key, Value value);
};

struct CallArgs {
  List positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

struct Callable {
  std::string name;
  std::function<Value(CallArgs&)> fn;
};

// Python ==, and the ordering of <, <=, >, >= (a RenderError for types Python cannot order).
bool equals(const Value& a, const Value& b);
int compare(const Value& a, const Value& b);
// Python `needle in haystack`.
bool contains(const Value& haystack, const Value& needle);
// The items Python's iter() yields: list/tuple items, dict keys, string characters; Undefined
// iterates as empty.
List iterate(const Value& v);
int64_t length(const Value& v);
// Python repr() of a float (shortest round trip, "1e+16", "0.0001", "1.0").
std::string float_repr(double d);

}  // namespace moeline::tokenizer::jinja
