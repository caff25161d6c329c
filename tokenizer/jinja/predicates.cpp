// jinja2's tests (`x is defined`, `n is divisibleby 3`, ...).
#include <map>

#include "tokenizer/jinja/builtins.h"
#include "tokenizer/jinja/evaluator.h"
#include "tokenizer/jinja/text.h"

namespace moeline::tokenizer::jinja {
namespace {

const Value& operand(const char* test, CallArgs& args) {
  if (args.positional.size() != 1 || !args.keyword.empty())
    fail(std::string("test '") + test + "' takes exactly one argument");
  return args.positional[0];
}

void no_args(const char* test, CallArgs& args) {
  if (!args.positional.empty() || !args.keyword.empty())
    fail(std::string("test '") + test + "' takes no arguments");
}

#define SIMPLE_TEST(NAME, EXPR)                           \
  bool NAME(Evaluator&, const Value& v, CallArgs& args) { \
    no_args(#NAME, args);                                 \
    return EXPR;                                          \
  }

SIMPLE_TEST(test_defined, !v.is_undefined())
SIMPLE_TEST(test_undefined, v.is_undefined())
SIMPLE_TEST(test_none, v.is_none())
SIMPLE_TEST(test_string, v.is_string())
SIMPLE_TEST(test_number, v.is_number())
SIMPLE_TEST(test_integer, v.is_int())
SIMPLE_TEST(test_float, v.is_float())
SIMPLE_TEST(test_mapping, v.is_dict())
SIMPLE_TEST(test_iterable,
            v.is_string() || v.is_sequence() || v.is_dict() || v.is_undefined() || v.is_iterator())
SIMPLE_TEST(test_sequence, v.is_string() || v.is_sequence() || v.is_dict())
SIMPLE_TEST(test_boolean, v.is_bool())
SIMPLE_TEST(test_true, v.is_bool() && v.as_bool())
SIMPLE_TEST(test_false, v.is_bool() && !v.as_bool())
SIMPLE_TEST(test_callable, v.is_callable() || v.is_undefined())
SIMPLE_TEST(test_escaped, v.is_undefined() && false)
SIMPLE_TEST(test_lower, v.is_string() && text::lower(v.as_string()) == v.as_string())
SIMPLE_TEST(test_upper, v.is_string() && text::upper(v.as_string()) == v.as_string())

int64_t integer_operand(const Value& v, const char* test) {
  if (v.is_undefined()) fail(v.undefined_hint());
  if (!v.is_integral()) fail(std::string("test '") + test + "' needs an integer");
  return v.as_int();
}

bool test_odd(Evaluator&, const Value& v, CallArgs& args) {
  no_args("odd", args);
  return integer_operand(v, "odd") % 2 != 0;
}
bool test_even(Evaluator&, const Value& v, CallArgs& args) {
  no_args("even", args);
  return integer_operand(v, "even") % 2 == 0;
}
bool test_divisibleby(Evaluator&, const Value& v, CallArgs& args) {
  int64_t n = integer_operand(operand("divisibleby", args), "divisibleby");
  if (n == 0) fail("integer division or modulo by zero");
  return integer_operand(v, "divisibleby") % n == 0;
}
bool test_eq(Evaluator&, const Value& v, CallArgs& args) {
  return equals(v, operand("eq", args));
}
bool test_ne(Evaluator&, const Value& v, CallArgs& args) {
  return !equals(v, operand("ne", args));
}
bool test_gt(Evaluator&, const Value& v, CallArgs& args) {
  return compare(v, operand("gt", args)) > 0;
}
bool test_ge(Evaluator&, const Value& v, CallArgs& args) {
  return compare(v, operand("ge", args)) >= 0;
}
bool test_lt(Evaluator&, const Value& v, CallArgs& args) {
  return compare(v, operand("lt", args)) < 0;
}
bool test_le(Evaluator&, const Value& v, CallArgs& args) {
  return compare(v, operand("le", args)) <= 0;
}
bool test_in(Evaluator&, const Value& v, CallArgs& args) {
  return contains(operand("in", args), v);
}
bool test_sameas(Evaluator&, const Value& v, CallArgs& args) {
  const Value& other = operand("sameas", args);
  // Python identity: singletons compare by value, containers by reference.
  if (v.is_none() || v.is_bool() || v.is_undefined()) return equals(v, other);
  if (v.is_sequence() && other.is_sequence()) return &v.items() == &other.items();
  if ((v.is_dict() || v.is_namespace()) && (other.is_dict() || other.is_namespace()))
    return v.mapping_ptr() == other.mapping_ptr();
  return false;
}

}  // namespace

TestFn find_test(std::string_view name) {
  static const std::map<std::string, TestFn, std::less<>> kTests = {
      {"defined", test_defined},
      {"undefined", test_undefined},
      {"none", test_none},
      {"string", test_string},
      {"number", test_number},
      {"integer", test_integer},
      {"float", test_float},
      {"mapping", test_mapping},
      {"iterable", test_iterable},
      {"sequence", test_sequence},
      {"boolean", test_boolean},
      {"true", test_true},
      {"false", test_false},
      {"callable", test_callable},
      {"escaped", test_escaped},
      {"lower", test_lower},
      {"upper", test_upper},
      {"odd", test_odd},
      {"even", test_even},
      {"divisibleby", test_divisibleby},
      {"eq", test_eq},
      {"equalto", test_eq},
      {"==", test_eq},
      {"ne", test_ne},
      {"!=", test_ne},
      {"gt", test_gt},
      {"greaterthan", test_gt},
      {">", test_gt},
      {"ge", test_ge},
      {">=", test_ge},
      {"lt", test_lt},
      {"lessthan", test_lt},
      {"<", test_lt},
      {"le", test_le},
      {"<=", test_le},
      {"in", test_in},
      {"sameas", test_sameas}};
  auto it = kTests.find(name);
  return it == kTests.end() ? nullptr : it->second;
}

}  // namespace moeline::tokenizer::jinja
