// jinja2's filters over strings and scalars (and tojson, as transformers defines it). The
// filters over sequences live in sequence_filters.cpp.
#include <cmath>
#include <cstdio>
#include <map>

#include "tokenizer/jinja/builtins.h"
#include "tokenizer/jinja/evaluator.h"
#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {
namespace {

Value f_tojson(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
  if (p.flag(0, false)) fail("unsupported: tojson(ensure_ascii=True)");
  std::string out =
      to_json(v, p.get_or(1, Value::none()), p.get_or(2, Value::none()), p.flag(3, false));
  ev.check_size(out.size());
  return Value::string(std::move(out));
}

Value f_trim(Evaluator&, const Value& v, CallArgs& args) {
  Params p("trim", args, {"chars"});
  return Value::string(text::strip(v.str(), p.string(0), true, true));
}

Value f_length(Evaluator&, const Value& v, CallArgs& args) {
  Params p("length", args, {});
  return Value::integer(length(v));
}

#define STRING_FILTER(NAME, FN)                            \
  Value NAME(Evaluator&, const Value& v, CallArgs& args) { \
    Params p(#NAME, args, {});                             \
    return Value::string(FN(v.str()));                     \
  }
STRING_FILTER(f_upper, text::upper)
STRING_FILTER(f_lower, text::lower)
STRING_FILTER(f_capitalize, text::capitalize)
STRING_FILTER(f_title, text::title_filter)

Value f_string(Evaluator&, const Value& v, CallArgs& args) {
  Params p("string", args, {});
  return Value::string(v.str());
}

Value f_replace(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("replace", args, {"old", "new", "count"});
  if (!p.has(1)) fail("replace() needs old and new");
  std::string out = text::replace(v.str(), p.get(0)->str(), p.get(1)->str(), p.integer(2, -1));
  ev.check_size(out.size());
  return Value::string(std::move(out));
}

Value f_default(Evaluator&, const Value& v, CallArgs& args) {
  Params p("default", args, {"default_value", "boolean"});
  bool use_default = v.is_undefined() || (p.flag(1, false) && !v.truthy());
  return use_default ? p.get_or(0, Value::string("")) : v;
}

// Python int(str): optional sign, digits with single underscores, surrounding whitespace.
std::optional<int64_t> parse_int(const std::string& s, int base) {
  std::string t = text::strip(s, std::nullopt, true, true);
  std::string digits;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '_' && i > 0 && i + 1 < t.size() && t[i - 1] != '_' && std::isalnum(t[i - 1]))
      continue;
    digits.push_back(t[i]);
  }
  if (digits.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long long r = std::strtoll(digits.c_str(), &end, base);
  if (end != digits.c_str() + digits.size() || errno == ERANGE ||
      digits.find(' ') != std::string::npos ||
      (digits.size() > 1 && (digits[1] == 'x' || digits[1] == 'X') && base == 10))
    return std::nullopt;
  return r;
}

std::optional<double> parse_float(const std::string& s) {
  std::string t = text::strip(s, std::nullopt, true, true);
  if (t.empty()) return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  // strtod also reads hex floats, which Python's float() does not.
  if (t.find('x') != std::string::npos || t.find('X') != std::string::npos) return std::nullopt;
  return d;
}

Value f_int(Evaluator&, const Value& v, CallArgs& args) {
  Params p("int", args, {"default", "base"});
  Value fallback = p.get_or(0, Value::integer(0));
  if (v.is_integral()) return Value::integer(v.as_int());
  if (v.is_float()) {
    if (!std::isfinite(v.as_double()) || std::fabs(v.as_double()) >= 9.2e18) return fallback;
    return Value::integer(static_cast<int64_t>(v.as_double()));
  }
  if (v.is_string()) {
    if (auto i = parse_int(v.as_string(), static_cast<int>(p.integer(1, 10))))
      return Value::integer(*i);
    if (auto d = parse_float(v.as_string()); d && std::isfinite(*d) && std::fabs(*d) < 9.2e18)
      return Value::integer(static_cast<int64_t>(*d));
  }
  return fallback;
}

Value f_float(Evaluator&, const Value& v, CallArgs& args) {
  Params p("float", args, {"default"});
  if (v.is_number()) return Value::real(v.as_double());
  if (v.is_string())
    if (auto d = parse_float(v.as_string())) return Value::real(*d);
  return p.get_or(0, Value::real(0.0));
}

Value f_abs(Evaluator&, const Value& v, CallArgs& args) {
  Params p("abs", args, {});
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) fail("integer overflow");
    return Value::integer(std::llabs(v.as_int()));
  }
  if (v.is_float()) return Value::real(std::fabs(v.as_double()));
  if (v.is_undefined()) fail(v.undefined_hint());
  fail("bad operand type for abs(): '" + v.type_name() + "'");
}

// Python's round(x, n): correctly rounded, ties to even on the exact binary value, which is what
// printf's correctly rounded conversion does too.
double python_round(double x, int64_t digits) {
  if (!std::isfinite(x)) return x;
  if (digits == 0) return std::nearbyint(x);
  if (digits > 0) {
    if (digits > 300) return x;
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(digits), x);
    return std::strtod(buf, nullptr);
  }
  double scale = std::pow(10.0, static_cast<double>(-digits));
  return std::nearbyint(x / scale) * scale;
}

Value f_round(Evaluator&, const Value& v, CallArgs& args) {
  Params p("round", args, {"precision", "method"});
  int64_t precision = p.integer(0, 0);
  std::string method = p.string(1).value_or("common");
  if (v.is_undefined()) fail(v.undefined_hint());
  if (!v.is_number()) fail("type " + v.type_name() + " doesn't define __round__ method");
  if (method == "common") {
    if (v.is_integral() && precision >= 0) return Value::integer(v.as_int());
    return Value::real(python_round(v.as_double(), precision));
  }
  if (method != "ceil" && method != "floor") fail("method must be common, ceil or floor");
  double scale = std::pow(10.0, static_cast<double>(precision));
  double scaled = v.as_double() * scale;
  return Value::real((method == "ceil" ? std::ceil(scaled) : std::floor(scaled)) / scale);
}

Value f_safe(Evaluator&, const Value& v, CallArgs& args) {
  Params p("safe", args, {});
  return Value::markup(v.str());
}

Value f_escape(Evaluator&, const Value& v, CallArgs& args) {
  Params p("escape", args, {});
  return v.is_markup() ? v : Value::markup(html_escape(v.str()));
}

}  // namespace

std::string html_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

namespace {

Value f_indent(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("indent", args, {"width", "first", "blank"});
  std::string indention;
  const Value* width = p.get(0);
  if (width && width->is_string())
    indention = width->as_string();
  else
    indention = std::string(static_cast<size_t>(std::max<int64_t>(0, p.integer(0, 4))), ' ');
  std::string s = v.str() + "\n";  // jinja2 appends a newline so that splitlines keeps a last one
  std::vector<std::string> lines = text::splitlines(s);
  std::string out;
  if (p.flag(2, false)) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) {
        out.push_back('\n');
        out += indention;
      }
      out += lines[i];
    }
  } else if (!lines.empty()) {
    out = lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      out.push_back('\n');
      if (!lines[i].empty()) out += indention;
      out += lines[i];
    }
  }
  if (p.flag(1, false)) out = indention + out;
  ev.check_size(out.size());
  return Value::string(std::move(out));
}

Value f_wordcount(Evaluator&, const Value& v, CallArgs& args) {
  Params p("wordcount", args, {});
  int64_t words = 0;
  bool in_word = false;
  for (char32_t c : text::decode(v.str())) {
    bool word_char = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                     c == '_' || (c >= 0x80 && !text::is_space(c));
    if (word_char && !in_word) ++words;
    in_word = word_char;
  }
  return Value::integer(words);
}

Value f_center(Evaluator& ev, const Value& v, CallArgs& args) {
  Params p("center", args, {"width"});
  int64_t width = p.integer(0, 80);
  ev.check_size(static_cast<size_t>(std::max<int64_t>(0, width)));
  return Value::string(text::center(v.str(), width));
}

Value f_attr(Evaluator&, const Value& v, CallArgs& args) {
  Params p("attr", args, {"name"});
  std::optional<std::string> name = p.string(0);
  if (!name) fail("attr() needs a name");
  return get_attribute(v, *name);
}

}  // namespace

FilterFn find_sequence_filter(std::string_view name);

FilterFn find_filter(std::string_view name) {
  static const std::map<std::string, FilterFn, std::less<>> kFilters = {
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"length", f_length},
      {"count", f_length},
      {"upper", f_upper},
      {"lower", f_lower},
      {"capitalize", f_capitalize},
      {"title", f_title},
      {"string", f_string},
      {"replace", f_replace},
      {"default", f_default},
      {"d", f_default},
      {"int", f_int},
      {"float", f_float},
      {"abs", f_abs},
      {"round", f_round},
      {"safe", f_safe},
      {"escape", f_escape},
      {"e", f_escape},
      {"indent", f_indent},
      {"wordcount", f_wordcount},
      {"center", f_center},
      {"attr", f_attr}};
  auto it = kFilters.find(name);
  return it != kFilters.end() ? it->second : find_sequence_filter(name);
}

}  // namespace moeline::tokenizer::jinja
