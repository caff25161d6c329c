// Globals (range, namespace, dict, joiner, raise_exception, strftime_now), argument binding for
// built-ins, and json.dumps for the tojson filter.
#include <algorithm>
#include <cmath>
#include <ctime>

#include "tokenizer/jinja/builtins.h"
#include "tokenizer/jinja/evaluator.h"

namespace moeline::tokenizer::jinja {

Params::Params(const char* function, CallArgs& args, std::initializer_list<const char*> names,
               bool allow_extra_positional)
    : function_(function), slots_(names.size()) {
  std::vector<const char*> list(names);
  for (size_t i = 0; i < args.positional.size(); ++i) {
    if (i < list.size()) {
      slots_[i] = args.positional[i];
    } else if (allow_extra_positional) {
      extra.push_back(args.positional[i]);
    } else {
      fail(std::string(function) + "() takes at most " + std::to_string(list.size()) +
           " arguments (" + std::to_string(args.positional.size()) + " given)");
    }
  }
  for (auto& [key, value] : args.keyword) {
    // The name as a plain reference: clang 14 (scripts/fuzz) cannot capture a structured binding.
    const std::string& name = key;
    auto it = std::find_if(list.begin(), list.end(), [&](const char* n) { return name == n; });
    if (it == list.end())
      fail(std::string(function) + "() got an unexpected keyword argument '" + key + "'");
    size_t i = static_cast<size_t>(it - list.begin());
    if (slots_[i])
      fail(std::string(function) + "() got multiple values for argument '" + key + "'");
    slots_[i] = value;
  }
}

int64_t Params::integer(size_t i, int64_t fallback) const {
  if (!slots_[i] || slots_[i]->is_none()) return fallback;
  if (!slots_[i]->is_integral())
    fail(std::string(function_) + "(): expected an integer, got " + slots_[i]->type_name());
  return slots_[i]->as_int();
}

std::optional<std::string> Params::string(size_t i) const {
  if (!slots_[i] || slots_[i]->is_none()) return std::nullopt;
  if (!slots_[i]->is_string())
    fail(std::string(function_) + "(): expected a string, got " + slots_[i]->type_name());
  return slots_[i]->as_string();
}

namespace {

// The sandbox's MAX_RANGE.
constexpr int64_t kMaxRange = 100000;

Value range(Evaluator& ev, CallArgs& args) {
  Params p("range", args, {"start", "stop", "step"});
  if (!p.has(0)) fail("range expected at least 1 argument, got 0");
  int64_t start = 0, stop, step = p.integer(2, 1);
  if (p.has(1)) {
    start = p.integer(0, 0);
    stop = p.integer(1, 0);
  } else {
    stop = p.integer(0, 0);
  }
  if (step == 0) fail("range() arg 3 must not be zero");
  int64_t count = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                           : (start > stop ? (start - stop - step - 1) / -step : 0);
  if (count > kMaxRange)
    fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  ev.count_steps(count);
  List out;
  for (int64_t i = 0; i < count; ++i) out.push_back(Value::integer(start + i * step));
  return Value::list(std::move(out));
}

std::shared_ptr<Dict> dict_from_args(const char* function, CallArgs& args) {
  auto d = std::make_shared<Dict>();
  if (args.positional.size() > 1)
    fail(std::string(function) + "() expected at most 1 positional argument");
  if (!args.positional.empty()) {
    const Value& init = args.positional[0];
    if (init.is_dict()) {
      for (const auto& [k, v] : init.mapping().entries) d->set(k, v);
    } else {
      for (const auto& pair : iterate(init)) {
        if (!pair.is_sequence() || pair.items().size() != 2)
          fail(std::string(function) + "(): sequence elements must be pairs");
        d->set(pair.items()[0], pair.items()[1]);
      }
    }
  }
  for (auto& [key, value] : args.keyword) d->set(Value::string(key), value);
  return d;
}

std::string strftime_now(const Evaluator& ev, const std::string& format) {
  auto now = ev.options().now.value_or(std::chrono::system_clock::now());
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::tm local{};
  localtime_r(&t, &local);
  if (format.empty()) return "";
  // strftime returns 0 both for "too small" and for an empty result; grow a few times only.
  for (size_t size = 256; size <= 65536; size *= 4) {
    std::string buf(size, '\0');
    size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &local);
    if (n > 0) return buf.substr(0, n);
  }
  return "";
}

}  // namespace

void add_globals(Evaluator& ev, std::vector<std::pair<std::string, Value>>& vars) {
  Evaluator* e = &ev;
  vars.emplace_back("range",
                    Value::callable("range", [e](CallArgs& args) { return range(*e, args); }));
  vars.emplace_back("namespace", Value::callable("namespace", [](CallArgs& args) {
                      return Value::name_space(dict_from_args("namespace", args));
                    }));
  vars.emplace_back("dict", Value::callable("dict", [](CallArgs& args) {
                      return Value::dict(dict_from_args("dict", args));
                    }));
  vars.emplace_back("joiner", Value::callable("joiner", [](CallArgs& args) {
                      Params p("joiner", args, {"sep"});
                      std::string sep = p.string(0).value_or(", ");
                      auto used = std::make_shared<bool>(false);
                      return Value::callable("joiner", [sep, used](CallArgs&) {
                        bool first = !*used;
                        *used = true;
                        return Value::string(first ? "" : sep);
                      });
                    }));
  vars.emplace_back("raise_exception", Value::callable("raise_exception", [](CallArgs& args) {
                      Params p("raise_exception", args, {"message"});
                      throw RenderError(p.get_or(0, Value::string("")).str(), 0, true);
                      return Value::none();
                    }));
  vars.emplace_back("strftime_now", Value::callable("strftime_now", [e](CallArgs& args) {
                      Params p("strftime_now", args, {"format"});
                      std::optional<std::string> format = p.string(0);
                      if (!format) fail("strftime_now() needs a format string");
                      return Value::string(strftime_now(*e, *format));
                    }));
}

namespace {

void json_string(std::string& out, const std::string& s) {
  out.push_back('"');
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          static const char* kHex = "0123456789abcdef";
          out += "\\u00";
          out.push_back(kHex[(c >> 4) & 0xF]);
          out.push_back(kHex[c & 0xF]);
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

struct JsonStyle {
  std::optional<std::string> indent;
  std::string item_separator;
  std::string key_separator;
  bool sort_keys;
};

std::string json_key(const Value& k) {
  switch (k.kind()) {
    case Value::Kind::kString:
      return k.as_string();
    case Value::Kind::kBool:
      return k.as_bool() ? "true" : "false";
    case Value::Kind::kNone:
      return "null";
    case Value::Kind::kInt:
    case Value::Kind::kFloat:
      return k.repr();
    default:
      fail("keys must be str, int, float, bool or None, not " + k.type_name());
  }
}

void dump(std::string& out, const Value& v, const JsonStyle& style, int level) {
  auto newline = [&](int depth) {
    if (!style.indent) return;
    out.push_back('\n');
    for (int i = 0; i < depth; ++i) out += *style.indent;
  };
  switch (v.kind()) {
    case Value::Kind::kNone:
      out += "null";
      return;
    case Value::Kind::kBool:
      out += v.as_bool() ? "true" : "false";
      return;
    case Value::Kind::kInt:
      out += v.repr();
      return;
    case Value::Kind::kFloat: {
      double d = v.as_double();
      out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity") : v.repr();
      return;
    }
    case Value::Kind::kString:
      json_string(out, v.as_string());
      return;
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (v.items().empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < v.items().size(); ++i) {
        if (i) out += style.item_separator;
        newline(level + 1);
        dump(out, v.items()[i], style, level + 1);
      }
      newline(level);
      out.push_back(']');
      return;
    }
    case Value::Kind::kDict: {
      if (v.mapping().entries.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<Value, Value>*> entries;
      for (const auto& e : v.mapping().entries) entries.push_back(&e);
      if (style.sort_keys)
        std::stable_sort(entries.begin(), entries.end(),
                         [](auto* a, auto* b) { return compare(a->first, b->first) < 0; });
      out.push_back('{');
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += style.item_separator;
        newline(level + 1);
        json_string(out, json_key(entries[i]->first));
        out += style.key_separator;
        dump(out, entries[i]->second, style, level + 1);
      }
      newline(level);
      out.push_back('}');
      return;
    }
    default: {
      std::string type = v.is_undefined() ? "Undefined" : v.type_name();
      fail("Object of type " + type.substr(0, type.find(' ')) + " is not JSON serializable");
    }
  }
}

}  // namespace

std::string to_json(const Value& value, const Value& indent, const Value& separators,
                    bool sort_keys) {
  JsonStyle style;
  style.sort_keys = sort_keys;
  if (indent.is_integral()) {
    style.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, indent.as_int())), ' ');
  } else if (indent.is_string()) {
    style.indent = indent.as_string();
  } else if (!indent.is_none() && !indent.is_undefined()) {
    fail("tojson: indent must be an integer or a string");
  }
  style.item_separator = style.indent ? "," : ", ";
  style.key_separator = ": ";
  if (!separators.is_none() && !separators.is_undefined()) {
    if (!separators.is_sequence() || separators.items().size() != 2 ||
        !separators.items()[0].is_string() || !separators.items()[1].is_string())
      fail("tojson: separators must be a pair of strings");
    style.item_separator = separators.items()[0].as_string();
    style.key_separator = separators.items()[1].as_string();
  }
  std::string out;
  dump(out, value, style, 0);
  return out;
}

}  // namespace moeline::tokenizer::jinja
