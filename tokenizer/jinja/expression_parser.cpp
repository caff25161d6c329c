// Expressions with jinja2's operator precedence: tuples, conditionals, or/and/not, comparisons,
// arithmetic and unary signs.
#include "tokenizer/jinja/expression_parser.h"

#include <set>

namespace moeline::tokenizer::jinja {

bool ExpressionParser::at_tuple_end() const {
  const Token& t = peek();
  return t.kind == TokenKind::kVariableEnd || t.kind == TokenKind::kBlockEnd ||
         t.kind == TokenKind::kEnd || at_op(")") || at_name("in") || at_name("recursive");
}

ExprPtr ExpressionParser::parse_tuple(bool with_condition, bool explicit_parentheses) {
  int line = peek().line;
  std::vector<ExprPtr> items;
  bool is_tuple = false;
  while (true) {
    if (!items.empty()) expect_op(",");
    if (at_tuple_end()) break;
    items.push_back(parse_expression(with_condition));
    if (at_op(","))
      is_tuple = true;
    else
      break;
  }
  if (!is_tuple) {
    if (!items.empty()) return std::move(items[0]);
    if (!explicit_parentheses) error("expected an expression, got " + describe(peek()));
  }
  auto e = make_expr(Expr::Kind::kTuple, line);
  e->args = std::move(items);
  return e;
}

ExprPtr ExpressionParser::parse_expression(bool with_condition) {
  DepthGuard guard(*this);
  ExprPtr e = parse_or();
  if (!with_condition) return e;
  while (at_name("if")) {
    int line = next().line;
    auto c = make_expr(Expr::Kind::kCondition, line);
    ExprPtr test = parse_or();
    ExprPtr otherwise = skip_name("else") ? parse_expression(true) : nullptr;
    c->args.push_back(std::move(e));
    c->args.push_back(std::move(test));
    c->args.push_back(std::move(otherwise));
    e = std::move(c);
  }
  return e;
}

ExprPtr ExpressionParser::binary(Expr::Kind kind, std::string op, ExprPtr left, ExprPtr right,
                                 int line) {
  auto e = make_expr(kind, line);
  e->name = std::move(op);
  e->args.push_back(std::move(left));
  e->args.push_back(std::move(right));
  return e;
}

ExprPtr ExpressionParser::parse_or() {
  ExprPtr left = parse_and();
  while (at_name("or")) {
    int line = next().line;
    left = binary(Expr::Kind::kOr, "or", std::move(left), parse_and(), line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_and() {
  ExprPtr left = parse_not();
  while (at_name("and")) {
    int line = next().line;
    left = binary(Expr::Kind::kAnd, "and", std::move(left), parse_not(), line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_not() {
  if (at_name("not")) {
    DepthGuard guard(*this);
    auto e = make_expr(Expr::Kind::kNot, next().line);
    e->args.push_back(parse_not());
    return e;
  }
  return parse_compare();
}

ExprPtr ExpressionParser::parse_compare() {
  int line = peek().line;
  ExprPtr first = parse_math1();
  std::vector<std::string> ops;
  std::vector<ExprPtr> operands;
  static const std::set<std::string> kCompareOps = {"==", "!=", "<", "<=", ">", ">="};
  while (true) {
    if (peek().kind == TokenKind::kOperator && kCompareOps.count(peek().text)) {
      ops.push_back(next().text);
    } else if (at_name("in")) {
      next();
      ops.push_back("in");
    } else if (at_name("not") && at_name("in", 1)) {
      next();
      next();
      ops.push_back("not in");
    } else {
      break;
    }
    operands.push_back(parse_math1());
  }
  if (ops.empty()) return first;
  auto e = make_expr(Expr::Kind::kCompare, line);
  e->args.push_back(std::move(first));
  for (auto& o : operands) e->args.push_back(std::move(o));
  e->ops = std::move(ops);
  return e;
}

ExprPtr ExpressionParser::parse_math1() {
  ExprPtr left = parse_concat();
  while (at_op("+") || at_op("-")) {
    const Token& t = next();
    left = binary(Expr::Kind::kBinary, t.text, std::move(left), parse_concat(), t.line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_concat() {
  ExprPtr left = parse_math2();
  while (at_op("~")) {
    const Token& t = next();
    left = binary(Expr::Kind::kBinary, "~", std::move(left), parse_math2(), t.line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_math2() {
  ExprPtr left = parse_pow();
  while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
    const Token& t = next();
    left = binary(Expr::Kind::kBinary, t.text, std::move(left), parse_pow(), t.line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_pow() {
  ExprPtr left = parse_unary(true);
  while (at_op("**")) {
    const Token& t = next();
    left = binary(Expr::Kind::kBinary, "**", std::move(left), parse_unary(true), t.line);
  }
  return left;
}

ExprPtr ExpressionParser::parse_unary(bool with_filter) {
  DepthGuard guard(*this);
  ExprPtr e;
  if (at_op("-") || at_op("+")) {
    const Token& t = next();
    e = make_expr(t.text == "-" ? Expr::Kind::kNegate : Expr::Kind::kPlus, t.line);
    e->args.push_back(parse_unary(false));
  } else {
    e = parse_primary();
  }
  e = parse_postfix(std::move(e));
  if (with_filter) e = parse_filter_expr(std::move(e));
  return e;
}

}  // namespace moeline::tokenizer::jinja
