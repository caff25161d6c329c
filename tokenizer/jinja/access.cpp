// Attribute and item access, and the Python methods of str, dict and list that the immutable
// sandbox allows. Methods come back as bound callables, so `s.strip` can be stored and called.
#include <algorithm>

#include "tokenizer/jinja/builtins.h"
#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {
namespace {

Value no_attribute(const Value& subject, const std::string& name) {
  return Value::undefined(cat({"'", subject.type_name(), "' has no attribute '", name, "'"}));
}

Value strings(const std::vector<std::string>& parts) {
  List out;
  for (const auto& p : parts) out.push_back(Value::string(p));
  return Value::list(std::move(out));
}

const std::string& string_arg(const Value& v, const char* method) {
  if (!v.is_string()) fail(std::string(method) + "() argument must be str, not " + v.type_name());
  return v.as_string();
}

// str.startswith/endswith take a string or a tuple of strings.
bool affix_matches(const std::string& s, const Value& affix, bool prefix, const char* method) {
  if (affix.is_sequence()) {
    for (const auto& a : affix.items())
      if (affix_matches(s, a, prefix, method)) return true;
    return false;
  }
  const std::string& a = string_arg(affix, method);
  if (a.size() > s.size()) return false;
  return prefix ? s.compare(0, a.size(), a) == 0 : s.compare(s.size() - a.size(), a.size(), a) == 0;
}

// find/rfind/count positions are in code points.
int64_t find_in(const std::string& s, const std::string& sub, bool reverse) {
  size_t at = reverse ? s.rfind(sub) : s.find(sub);
  if (at == std::string::npos) return -1;
  return text::length(std::string_view(s).substr(0, at));
}

template <class Pred>
bool all_chars(const std::string& s, Pred pred) {
  std::u32string u = text::decode(s);
  return !u.empty() && std::all_of(u.begin(), u.end(), pred);
}

Value string_method(const std::string& s, const std::string& name, CallArgs& args) {
  std::string fn = "str." + name;
  if (name == "startswith" || name == "endswith") {
    Params p(fn.c_str(), args, {"prefix", "start", "end"});
    if (!p.has(0)) fail(fn + "() takes at least 1 argument");
    if (p.has(1) || p.has(2)) fail("unsupported: " + fn + "() with start/end");
    return Value::boolean(affix_matches(s, *p.get(0), name == "startswith", fn.c_str()));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Params p(fn.c_str(), args, {"chars"});
    return Value::string(text::strip(s, p.string(0), name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    Params p(fn.c_str(), args, {"sep", "maxsplit"});
    return strings(text::split(s, p.string(0), p.integer(1, -1), name == "rsplit"));
  }
  if (name == "splitlines") return strings(text::splitlines(s));
  if (name == "replace") {
    Params p(fn.c_str(), args, {"old", "new", "count"});
    if (!p.has(1)) fail(fn + "() takes at least 2 arguments");
    return Value::string(text::replace(s, string_arg(*p.get(0), "replace"),
                                       string_arg(*p.get(1), "replace"), p.integer(2, -1)));
  }
  if (name == "upper") return Value::string(text::upper(s));
  if (name == "lower") return Value::string(text::lower(s));
  if (name == "title") return Value::string(text::title(s));
  if (name == "capitalize") return Value::string(text::capitalize(s));
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    Params p(fn.c_str(), args, {"sub"});
    if (!p.has(0)) fail(fn + "() takes at least 1 argument");
    int64_t at = find_in(s, string_arg(*p.get(0), name.c_str()), name[0] == 'r');
    if (at < 0 && name.find("index") != std::string::npos) fail("substring not found");
    return Value::integer(at);
  }
  if (name == "count") {
    Params p(fn.c_str(), args, {"sub"});
    if (!p.has(0)) fail(fn + "() takes at least 1 argument");
    return Value::integer(text::count(s, string_arg(*p.get(0), "count")));
  }
  if (name == "join") {
    Params p(fn.c_str(), args, {"iterable"});
    if (!p.has(0)) fail(fn + "() takes exactly one argument");
    std::string out;
    bool first = true;
    for (const auto& item : iterate(*p.get(0))) {
      if (!first) out += s;
      first = false;
      out += string_arg(item, "join");
    }
    return Value::string(std::move(out));
  }
  if (name == "removeprefix" || name == "removesuffix") {
    Params p(fn.c_str(), args, {"affix"});
    if (!p.has(0)) fail(fn + "() takes exactly one argument");
    const std::string& a = string_arg(*p.get(0), name.c_str());
    bool prefix = name == "removeprefix";
    if (!affix_matches(s, *p.get(0), prefix, name.c_str())) return Value::string(s);
    return Value::string(prefix ? s.substr(a.size()) : s.substr(0, s.size() - a.size()));
  }
  if (name == "center") {
    Params p(fn.c_str(), args, {"width"});
    return Value::string(text::center(s, p.integer(0, 0)));
  }
  if (name == "isspace") return Value::boolean(all_chars(s, text::is_space));
  if (name == "isdigit")
    return Value::boolean(all_chars(s, [](char32_t c) { return c >= '0' && c <= '9'; }));
  if (name == "isalpha")
    return Value::boolean(all_chars(s, [](char32_t c) {
      return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
    }));
  if (name == "islower") return Value::boolean(s != text::upper(s) && s == text::lower(s));
  if (name == "isupper") return Value::boolean(s != text::lower(s) && s == text::upper(s));
  fail("unsupported method '" + fn + "'");
}

Value dict_method(const Value& d, const std::string& name, CallArgs& args) {
  std::string fn = "dict." + name;
  if (name == "items" || name == "keys" || name == "values") {
    Params p(fn.c_str(), args, {});
    List out;
    for (const auto& [k, v] : d.mapping().entries) {
      if (name == "items")
        out.push_back(Value::tuple({k, v}));
      else
        out.push_back(name == "keys" ? k : v);
    }
    return Value::list(std::move(out));
  }
  if (name == "get") {
    Params p(fn.c_str(), args, {"key", "default"});
    if (!p.has(0)) fail("get expected at least 1 argument, got 0");
    const Value* found = d.mapping().find(*p.get(0));
    return found ? *found : p.get_or(1, Value::none());
  }
  fail("unsupported method '" + fn + "'");
}

Value list_method(const Value& l, const std::string& name, CallArgs& args) {
  std::string fn = "list." + name;
  Params p(fn.c_str(), args, {"value"});
  if (!p.has(0)) fail(fn + "() takes exactly one argument");
  if (name == "count")
    return Value::integer(std::count_if(l.items().begin(), l.items().end(),
                                        [&](const Value& v) { return equals(v, *p.get(0)); }));
  for (size_t i = 0; i < l.items().size(); ++i)
    if (equals(l.items()[i], *p.get(0))) return Value::integer(static_cast<int64_t>(i));
  fail(p.get(0)->repr() + " is not in list");
}

bool is_method(const Value& subject, const std::string& name) {
  static const std::vector<std::string> kString = {
      "startswith", "endswith", "strip",   "lstrip",  "rstrip",  "split",        "rsplit",
      "splitlines", "replace",  "upper",   "lower",   "title",   "capitalize",   "find",
      "rfind",      "index",    "rindex",  "count",   "join",    "removeprefix", "removesuffix",
      "center",     "isspace",  "isdigit", "isalpha", "islower", "isupper"};
  static const std::vector<std::string> kDict = {"items", "keys", "values", "get"};
  static const std::vector<std::string> kList = {"index", "count"};
  const auto& names = subject.is_string() ? kString : subject.is_dict() ? kDict : kList;
  return std::find(names.begin(), names.end(), name) != names.end();
}

// What the immutable sandbox refuses: every method that mutates a list or dict.
bool is_mutator(const Value& subject, const std::string& name) {
  static const std::vector<std::string> kList = {"append", "extend",  "insert", "pop",
                                                 "remove", "reverse", "sort",   "clear"};
  static const std::vector<std::string> kDict = {"clear", "pop", "popitem", "setdefault", "update"};
  const auto& names = subject.is_dict() ? kDict : kList;
  return std::find(names.begin(), names.end(), name) != names.end();
}

Value bound_method(const Value& subject, const std::string& name) {
  Value self = subject;
  return Value::callable(name, [self, name](CallArgs& args) {
    if (self.is_string()) return string_method(self.as_string(), name, args);
    if (self.is_dict()) return dict_method(self, name, args);
    return list_method(self, name, args);
  });
}

// Python attributes (methods) of the value, or nullopt when it has none by that name.
std::optional<Value> python_attribute(const Value& subject, const std::string& name) {
  bool has_methods = subject.is_string() || subject.is_dict() || subject.is_sequence();
  if (!has_methods) return std::nullopt;
  if ((subject.is_dict() || subject.kind() == Value::Kind::kList) && is_mutator(subject, name))
    return Value::undefined("access to attribute '" + name + "' of '" +
                            subject.type_name().substr(0, subject.type_name().find(' ')) +
                            "' object is unsafe.");
  if (is_method(subject, name)) return bound_method(subject, name);
  return std::nullopt;
}

std::optional<Value> item(const Value& subject, const Value& key) {
  if (subject.is_dict()) {
    const Value* v = subject.mapping().find(key);
    return v ? std::optional<Value>(*v) : std::nullopt;
  }
  if ((subject.is_sequence() || subject.is_string()) && key.is_integral()) {
    int64_t i = key.as_int();
    if (subject.is_string()) {
      std::u32string u = text::decode(subject.as_string());
      auto n = static_cast<int64_t>(u.size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return std::nullopt;
      return Value::string(text::encode(u.substr(i, 1)));
    }
    auto n = static_cast<int64_t>(subject.items().size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return std::nullopt;
    return subject.items()[i];
  }
  return std::nullopt;
}

}  // namespace

Value get_attribute(const Value& subject, const std::string& name) {
  if (subject.is_undefined()) fail(subject.undefined_hint());
  if (subject.is_namespace()) {
    const Value* v = subject.mapping().find(name);
    return v ? *v : no_attribute(subject, name);
  }
  if (auto attr = python_attribute(subject, name)) return *attr;
  if (auto v = item(subject, Value::string(name))) return *v;
  return no_attribute(subject, name);
}

Value get_item(const Value& subject, const Value& key) {
  if (subject.is_undefined()) fail(subject.undefined_hint());
  if (subject.is_namespace() && key.is_string()) return get_attribute(subject, key.as_string());
  if (auto v = item(subject, key)) return *v;
  if (key.is_string()) {
    if (auto attr = python_attribute(subject, key.as_string())) return *attr;
    return no_attribute(subject, key.as_string());
  }
  return Value::undefined(cat({"'", subject.type_name(), "' has no element ", key.repr()}));
}

}  // namespace moeline::tokenizer::jinja
