// Expression evaluation and Python's arithmetic.
#include <cmath>

#include "tokenizer/jinja/builtins.h"
#include "tokenizer/jinja/evaluator.h"
#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {
namespace {

[[noreturn]] void operand_error(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail(a.undefined_hint());
  if (b.is_undefined()) fail(b.undefined_hint());
  fail("unsupported operand type(s) for " + op + ": '" + a.type_name() + "' and '" + b.type_name() +
       "'");
}

int64_t checked(bool overflow, int64_t value) {
  // Python ints are unbounded; ours are 64-bit, and a template that needs more is refused.
  if (overflow) fail("integer overflow");
  return value;
}

Value repeat(const Value& seq, int64_t times, const Evaluator& ev) {
  if (times <= 0) return seq.is_string() ? Value::string("") : Value::list({});
  if (seq.is_string()) {
    ev.check_size(seq.as_string().size() * static_cast<size_t>(times));
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += seq.as_string();
    return Value::string(std::move(out));
  }
  ev.check_size(seq.items().size() * static_cast<size_t>(times));
  List out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return seq.kind() == Value::Kind::kTuple ? Value::tuple(std::move(out))
                                           : Value::list(std::move(out));
}

double floor_mod(double a, double b) {
  double m = std::fmod(a, b);
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

}  // namespace

Value binary_op(const std::string& op, const Value& a, const Value& b, const Evaluator& ev) {
  if (op == "~") {
    std::string s = a.str() + b.str();
    ev.check_size(s.size());
    return Value::string(std::move(s));
  }
  bool numbers = a.is_number() && b.is_number();
  bool ints = numbers && a.is_integral() && b.is_integral();
  if (op == "+") {
    if (ints) {
      int64_t r = 0;
      bool overflow = __builtin_add_overflow(a.as_int(), b.as_int(), &r);
      return Value::integer(checked(overflow, r));
    }
    if (numbers) return Value::real(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      ev.check_size(a.as_string().size() + b.as_string().size());
      if (a.is_markup() != b.is_markup()) {
        // Markup + str escapes the plain side (the "..."|safe + x idiom of some templates).
        std::string left = a.is_markup() ? a.as_string() : html_escape(a.as_string());
        std::string right = b.is_markup() ? b.as_string() : html_escape(b.as_string());
        return Value::markup(left + right);
      }
      std::string joined = a.as_string() + b.as_string();
      return a.is_markup() ? Value::markup(std::move(joined)) : Value::string(std::move(joined));
    }
    if (a.is_sequence() && a.kind() == b.kind()) {
      List out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      ev.check_size(out.size());
      return a.kind() == Value::Kind::kTuple ? Value::tuple(std::move(out))
                                             : Value::list(std::move(out));
    }
    operand_error(op, a, b);
  }
  if (op == "-") {
    if (ints) {
      int64_t r = 0;
      bool overflow = __builtin_sub_overflow(a.as_int(), b.as_int(), &r);
      return Value::integer(checked(overflow, r));
    }
    if (numbers) return Value::real(a.as_double() - b.as_double());
    operand_error(op, a, b);
  }
  if (op == "*") {
    if (ints) {
      int64_t r = 0;
      bool overflow = __builtin_mul_overflow(a.as_int(), b.as_int(), &r);
      return Value::integer(checked(overflow, r));
    }
    if (numbers) return Value::real(a.as_double() * b.as_double());
    if ((a.is_string() || a.is_sequence()) && b.is_integral()) return repeat(a, b.as_int(), ev);
    if ((b.is_string() || b.is_sequence()) && a.is_integral()) return repeat(b, a.as_int(), ev);
    operand_error(op, a, b);
  }
  if (!numbers) {
    if (op == "%" && a.is_string()) fail("unsupported: printf-style string formatting ('%')");
    operand_error(op, a, b);
  }
  if (op == "/") {
    if (b.as_double() == 0) fail("division by zero");
    return Value::real(a.as_double() / b.as_double());
  }
  if (op == "//" || op == "%") {
    if (b.as_double() == 0) fail(op == "%" ? "modulo by zero" : "integer division by zero");
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (x == INT64_MIN && y == -1) fail("integer overflow");
      int64_t q = x / y, m = x % y;
      if (m != 0 && ((m < 0) != (y < 0))) {
        --q;
        m += y;
      }
      return Value::integer(op == "//" ? q : m);
    }
    double x = a.as_double(), y = b.as_double();
    double m = floor_mod(x, y);
    return Value::real(op == "//" ? std::round((x - m) / y) : m);
  }
  if (op == "**") {
    if (ints && b.as_int() >= 0) {
      int64_t result = 1, base = a.as_int();
      for (int64_t e = b.as_int(); e > 0; --e) {
        if (__builtin_mul_overflow(result, base, &result)) fail("integer overflow");
        if (result == 0 || result == 1) break;
      }
      if (result == 1 && base == -1 && b.as_int() % 2) result = -1;
      return Value::integer(result);
    }
    if (a.as_double() == 0 && b.as_double() < 0) fail("0.0 cannot be raised to a negative power");
    return Value::real(std::pow(a.as_double(), b.as_double()));
  }
  fail("unknown operator '" + op + "'");
}

Value Evaluator::eval(const Expr& e) {
  try {
    return eval_unchecked(e);
  } catch (RenderError& err) {
    if (err.line == 0) err.line = e.line;
    throw;
  }
}

CallArgs Evaluator::eval_args(const Expr& e, size_t first) {
  CallArgs args;
  for (size_t i = first; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i]));
  for (const auto& [key, value] : e.kwargs) args.keyword.emplace_back(key, eval(*value));
  return args;
}

Value Evaluator::call(const Value& callee, CallArgs& args) {
  if (callee.is_callable()) return callee.function().fn(args);
  if (callee.is_undefined()) fail(callee.undefined_hint());
  fail(callee.type_name() + " is not callable");
}

Value Evaluator::eval_call(const Expr& e) {
  Value callee = eval(*e.args[0]);
  CallArgs args = eval_args(e, 1);
  return call(callee, args);
}

Value Evaluator::eval_compare(const Expr& e) {
  Value left = eval(*e.args[0]);
  for (size_t i = 0; i < e.ops.size(); ++i) {
    Value right = eval(*e.args[i + 1]);
    const std::string& op = e.ops[i];
    bool ok;
    if (op == "==") {
      ok = equals(left, right);
    } else if (op == "!=") {
      ok = !equals(left, right);
    } else if (op == "in") {
      ok = contains(right, left);
    } else if (op == "not in") {
      ok = !contains(right, left);
    } else {
      int c = compare(left, right);
      ok = op == "<" ? c < 0 : op == "<=" ? c <= 0 : op == ">" ? c > 0 : c >= 0;
    }
    if (!ok) return Value::boolean(false);
    left = std::move(right);
  }
  return Value::boolean(true);
}

namespace {

// Python's slice.indices(): clamps start and stop for a sequence of `length` items.
void slice_bounds(int64_t length, const Value* start, const Value* stop, int64_t step,
                  int64_t& first, int64_t& last) {
  auto clamp = [&](const Value* v, int64_t fallback) {
    if (!v || v->is_none()) return fallback;
    if (!v->is_integral()) fail("slice indices must be integers or None");
    int64_t i = v->as_int();
    if (i < 0) i += length;
    if (step > 0) return std::clamp<int64_t>(i, 0, length);
    return std::clamp<int64_t>(i, -1, length - 1);
  };
  first = clamp(start, step > 0 ? 0 : length - 1);
  last = clamp(stop, step > 0 ? length : -1);
}

}  // namespace

Value Evaluator::eval_slice(const Expr& e) {
  Value subject = eval(*e.args[0]);
  Value parts[3];
  const Value* bound[3] = {nullptr, nullptr, nullptr};
  for (int i = 0; i < 3; ++i) {
    if (e.args[i + 1]) {
      parts[i] = eval(*e.args[i + 1]);
      bound[i] = &parts[i];
    }
  }
  if (subject.is_undefined()) fail(subject.undefined_hint());
  int64_t step = 1;
  if (bound[2] && !bound[2]->is_none()) {
    if (!bound[2]->is_integral()) fail("slice indices must be integers or None");
    step = bound[2]->as_int();
    if (step == 0) fail("slice step cannot be zero");
  }
  std::u32string chars;
  int64_t length;
  if (subject.is_string()) {
    chars = text::decode(subject.as_string());
    length = static_cast<int64_t>(chars.size());
  } else if (subject.is_sequence()) {
    length = static_cast<int64_t>(subject.items().size());
  } else {
    fail("'" + subject.type_name() + "' is not subscriptable");
  }
  int64_t first, last;
  slice_bounds(length, bound[0], bound[1], step, first, last);
  std::u32string out_chars;
  List out_items;
  for (int64_t i = first; step > 0 ? i < last : i > last; i += step) {
    if (subject.is_string())
      out_chars.push_back(chars[i]);
    else
      out_items.push_back(subject.items()[i]);
  }
  if (subject.is_string()) return Value::string(text::encode(out_chars));
  return subject.kind() == Value::Kind::kTuple ? Value::tuple(std::move(out_items))
                                               : Value::list(std::move(out_items));
}

Value Evaluator::eval_unchecked(const Expr& e) {
  switch (e.kind) {
    case Expr::Kind::kLiteral:
      return e.literal;
    case Expr::Kind::kName: {
      const Value* v = frame_->find(e.name);
      return v ? *v : Value::undefined("'" + e.name + "' is undefined");
    }
    case Expr::Kind::kList:
    case Expr::Kind::kTuple: {
      List items;
      for (const auto& a : e.args) items.push_back(eval(*a));
      return e.kind == Expr::Kind::kList ? Value::list(std::move(items))
                                         : Value::tuple(std::move(items));
    }
    case Expr::Kind::kDict: {
      auto d = std::make_shared<Dict>();
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value key = eval(*e.args[i]);
        if (key.is_sequence() && key.kind() == Value::Kind::kList) fail("unhashable type: 'list'");
        d->set(std::move(key), eval(*e.args[i + 1]));
      }
      return Value::dict(d);
    }
    case Expr::Kind::kGetAttr:
      return get_attribute(eval(*e.args[0]), e.name);
    case Expr::Kind::kGetItem: {
      Value subject = eval(*e.args[0]);
      return get_item(subject, eval(*e.args[1]));
    }
    case Expr::Kind::kSlice:
      return eval_slice(e);
    case Expr::Kind::kCall:
      return eval_call(e);
    case Expr::Kind::kFilter: {
      Value subject = eval(*e.args[0]);
      CallArgs args = eval_args(e, 1);
      return apply_filter(e.name, subject, args);
    }
    case Expr::Kind::kTest: {
      Value subject = eval(*e.args[0]);
      CallArgs args = eval_args(e, 1);
      return Value::boolean(apply_test(e.name, subject, args) != e.negated);
    }
    case Expr::Kind::kNot:
      return Value::boolean(!eval(*e.args[0]).truthy());
    case Expr::Kind::kNegate:
    case Expr::Kind::kPlus: {
      Value v = eval(*e.args[0]);
      bool negate = e.kind == Expr::Kind::kNegate;
      if (v.is_integral()) {
        if (negate && v.as_int() == INT64_MIN) fail("integer overflow");
        return Value::integer(negate ? -v.as_int() : v.as_int());
      }
      if (v.is_float()) return Value::real(negate ? -v.as_double() : v.as_double());
      if (v.is_undefined()) fail(v.undefined_hint());
      fail(std::string("bad operand type for unary ") + (negate ? "-" : "+") + ": '" +
           v.type_name() + "'");
    }
    case Expr::Kind::kBinary:
      return binary_op(e.name, eval(*e.args[0]), eval(*e.args[1]), *this);
    case Expr::Kind::kCompare:
      return eval_compare(e);
    case Expr::Kind::kAnd: {
      Value left = eval(*e.args[0]);
      return left.truthy() ? eval(*e.args[1]) : left;
    }
    case Expr::Kind::kOr: {
      Value left = eval(*e.args[0]);
      return left.truthy() ? left : eval(*e.args[1]);
    }
    case Expr::Kind::kCondition: {
      if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
      if (e.args[2]) return eval(*e.args[2]);
      return Value::undefined(
          "the inline if expression evaluated to false and no else section "
          "was defined");
    }
  }
  fail("unknown expression");
}

Value Evaluator::apply_filter(const std::string& name, const Value& subject, CallArgs& args) {
  FilterFn f = find_filter(name);
  if (!f) fail("unsupported filter '" + name + "'");
  return f(*this, subject, args);
}

bool Evaluator::apply_test(const std::string& name, const Value& subject, CallArgs& args) {
  TestFn t = find_test(name);
  if (!t) fail("unsupported test '" + name + "'");
  return t(*this, subject, args);
}

}  // namespace moeline::tokenizer::jinja
