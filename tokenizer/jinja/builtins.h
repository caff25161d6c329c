#pragma once
// jinja2's built-in filters, tests, globals and the Python methods of str, dict and list that the
// sandbox allows, plus attribute and item access as jinja2's getattr/getitem do them.

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "tokenizer/jinja/value.h"

namespace moeline::tokenizer::jinja {

class Evaluator;

using FilterFn = Value (*)(Evaluator& ev, const Value& subject, CallArgs& args);
using TestFn = bool (*)(Evaluator& ev, const Value& subject, CallArgs& args);
FilterFn find_filter(std::string_view name);  // nullptr: unsupported
TestFn find_test(std::string_view name);      // nullptr: unsupported

// `obj.name`: a method or attribute first, then an item; `obj[key]`: an item first, then a method.
// A miss is Undefined (printing it is empty); a miss on Undefined itself is an error.
Value get_attribute(const Value& subject, const std::string& name);
Value get_item(const Value& subject, const Value& key);

// The globals every render sees: range, namespace, dict, raise_exception, strftime_now, cycler,
// joiner.
void add_globals(Evaluator& ev, std::vector<std::pair<std::string, Value>>& vars);

// markupsafe.escape: & < > " ' as HTML entities.
std::string html_escape(std::string_view s);

// json.dumps(value, ensure_ascii=False, indent, separators, sort_keys).
std::string to_json(const Value& value, const Value& indent, const Value& separators,
                    bool sort_keys);

// Python-style binding of call arguments to named parameters, for built-ins.
class Params {
 public:
  Params(const char* function, CallArgs& args, std::initializer_list<const char*> names,
         bool allow_extra_positional = false);
  const Value* get(size_t i) const { return slots_[i] ? &*slots_[i] : nullptr; }
  Value get_or(size_t i, Value fallback) const { return slots_[i] ? *slots_[i] : fallback; }
  bool has(size_t i) const { return slots_[i].has_value(); }
  int64_t integer(size_t i, int64_t fallback) const;
  bool flag(size_t i, bool fallback) const { return slots_[i] ? slots_[i]->truthy() : fallback; }
  std::optional<std::string> string(size_t i) const;  // none and unset are nullopt
  List extra;                                         // positional arguments past the named ones

 private:
  const char* function_;
  std::vector<std::optional<Value>> slots_;
};

}  // namespace moeline::tokenizer::jinja
