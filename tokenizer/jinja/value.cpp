#include "tokenizer/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {

void fail(const std::string& message) {
  throw RenderError(message);
}

std::string cat(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (std::string_view p : parts) out.append(p);
  return out;
}

Value Value::undefined(std::string hint) {
  Value v;
  v.text_ = std::move(hint);
  return v;
}
Value Value::none() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.bool_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.kind_ = Kind::kInt;
  v.int_ = i;
  return v;
}
Value Value::real(double d) {
  Value v;
  v.kind_ = Kind::kFloat;
  v.real_ = d;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.text_ = std::move(s);
  return v;
}
Value Value::list(List items) {
  Value v;
  v.kind_ = Kind::kList;
  v.list_ = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::tuple(List items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::kTuple;
  return v;
}
Value Value::iterator(List items) {
  Value v = list(std::move(items));
  v.kind_ = Kind::kIterator;
  return v;
}
Value Value::markup(std::string s) {
  Value v = string(std::move(s));
  v.bool_ = true;
  return v;
}
List Value::take_items() const {
  List out = std::move(*list_);
  list_->clear();
  return out;
}

Value Value::dict(std::shared_ptr<Dict> d) {
  Value v;
  v.kind_ = Kind::kDict;
  v.dict_ = std::move(d);
  return v;
}
Value Value::name_space(std::shared_ptr<Dict> d) {
  Value v = dict(std::move(d));
  v.kind_ = Kind::kNamespace;
  return v;
}
Value Value::callable(std::string name, std::function<Value(CallArgs&)> fn) {
  Value v;
  v.kind_ = Kind::kCallable;
  v.callable_ = std::make_shared<Callable>(Callable{std::move(name), std::move(fn)});
  return v;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return bool_;
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return real_ != 0;
    case Kind::kString:
      return !text_.empty();
    case Kind::kList:
    case Kind::kTuple:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->entries.empty();
    case Kind::kIterator:
    case Kind::kNamespace:
    case Kind::kCallable:
      return true;
  }
  return false;
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  bool negative = sci[0] == '-';
  if (negative) sci.erase(0, 1);
  size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exponent = std::atoi(sci.c_str() + e + 1);
  std::string out;
  if (negative) out.push_back('-');
  // CPython's repr switches to exponent notation outside 1e-4 <= |d| < 1e16.
  if (exponent < -4 || exponent >= 16) {
    out.push_back(digits[0]);
    if (digits.size() > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    out.append(exponent < 0 ? "e-" : "e+");
    int magnitude = std::abs(exponent);
    if (magnitude < 10) out.push_back('0');
    out.append(std::to_string(magnitude));
  } else if (exponent >= 0) {
    auto whole = static_cast<size_t>(exponent) + 1;
    if (digits.size() <= whole) {
      out.append(digits);
      out.append(whole - digits.size(), '0');
      out.append(".0");
    } else {
      out.append(digits, 0, whole);
      out.push_back('.');
      out.append(digits, whole, std::string::npos);
    }
  } else {
    out.append("0.");
    out.append(static_cast<size_t>(-exponent - 1), '0');
    out.append(digits);
  }
  return out;
}

std::string Value::str() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return text_;
    default:
      return repr();
  }
}

std::string Value::repr() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return bool_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(int_);
    case Kind::kFloat:
      return float_repr(real_);
    case Kind::kString:
      return text::repr(text_);
    case Kind::kList:
    case Kind::kTuple: {
      bool tuple = kind_ == Kind::kTuple;
      std::string out = tuple ? "(" : "[";
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i) out += ", ";
        out += (*list_)[i].repr();
      }
      if (tuple && list_->size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      std::string out = kind_ == Kind::kNamespace ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, v] : dict_->entries) {
        if (!first) out += ", ";
        first = false;
        out += k.repr() + ": " + v.repr();
      }
      return out + (kind_ == Kind::kNamespace ? "}>" : "}");
    }
    case Kind::kCallable:
      return "<function " + callable_->name + ">";
    case Kind::kIterator:
      return "<generator object>";
  }
  return "";
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType object";
    case Kind::kBool:
      return "bool object";
    case Kind::kInt:
      return "int object";
    case Kind::kFloat:
      return "float object";
    case Kind::kString:
      return "str object";
    case Kind::kList:
      return "list object";
    case Kind::kTuple:
      return "tuple object";
    case Kind::kIterator:
      return "generator object";
    case Kind::kDict:
      return "dict object";
    case Kind::kNamespace:
      return "Namespace object";
    case Kind::kCallable:
      return "function object";
  }
  return "object";
}

const Value* Dict::find(const Value& key) const {
  for (const auto& [k, v] : entries)
    if (equals(k, key)) return &v;
  return nullptr;
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : entries)
    if (k.is_string() && k.as_string() == key) return &v;
  return nullptr;
}

void Dict::set(Value key, Value value) {
  for (auto& [k, v] : entries) {
    if (equals(k, key)) {
      v = std::move(value);
      return;
    }
  }
  entries.emplace_back(std::move(key), std::move(value));
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList:
    case Value::Kind::kTuple: {
      if (a.items().size() != b.items().size()) return false;
      for (size_t i = 0; i < a.items().size(); ++i)
        if (!equals(a.items()[i], b.items()[i])) return false;
      return true;
    }
    case Value::Kind::kDict: {
      if (a.mapping().entries.size() != b.mapping().entries.size()) return false;
      for (const auto& [k, v] : a.mapping().entries) {
        const Value* other = b.mapping().find(k);
        if (!other || !equals(v, *other)) return false;
      }
      return true;
    }
    case Value::Kind::kNamespace:
      return a.mapping_ptr() == b.mapping_ptr();
    case Value::Kind::kIterator:
      return &a.items() == &b.items();
    case Value::Kind::kCallable:
      return &a.function() == &b.function();
    default:
      return false;
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
  }
  if (a.is_undefined() || b.is_undefined())
    fail(a.is_undefined() ? a.undefined_hint() : b.undefined_hint());
  if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order.
    int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_sequence() && a.kind() == b.kind()) {
    const List &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  fail("cannot order '" + a.type_name() + "' and '" + b.type_name() + "'");
}

bool contains(const Value& haystack, const Value& needle) {
  switch (haystack.kind()) {
    case Value::Kind::kString:
      if (!needle.is_string())
        fail("'in <string>' requires string as left operand, not " + needle.type_name());
      return haystack.as_string().find(needle.as_string()) != std::string::npos;
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      for (const auto& item : haystack.items())
        if (equals(item, needle)) return true;
      return false;
    case Value::Kind::kDict:
      return haystack.mapping().find(needle) != nullptr;
    case Value::Kind::kIterator:
      for (const auto& item : haystack.take_items())
        if (equals(item, needle)) return true;
      return false;
    case Value::Kind::kUndefined:
      return false;
    default:
      fail("argument of type '" + haystack.type_name() + "' is not iterable");
  }
}

List iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return v.items();
    case Value::Kind::kIterator:
      return v.take_items();
    case Value::Kind::kDict: {
      List keys;
      for (const auto& [k, value] : v.mapping().entries) keys.push_back(k);
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (char32_t c : text::decode(v.as_string()))
        chars.push_back(Value::string(text::encode(std::u32string(1, c))));
      return chars;
    }
    default:
      fail("'" + v.type_name() + "' is not iterable");
  }
}

int64_t length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return text::length(v.as_string());
    case Value::Kind::kList:
    case Value::Kind::kTuple:
      return static_cast<int64_t>(v.items().size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.mapping().entries.size());
    default:
      fail("object of type '" + v.type_name() + "' has no len()");
  }
}

}  // namespace moeline::tokenizer::jinja
