// Operands: literals, names, lists, dicts, subscripts and slices, calls, filters and tests.
#include "tokenizer/jinja/expression_parser.h"

namespace moeline::tokenizer::jinja {

ExprPtr OperandParser::parse_primary() {
  const Token& t = peek();
  if (t.kind == TokenKind::kName) {
    next();
    auto e = make_expr(Expr::Kind::kLiteral, t.line);
    if (t.text == "true" || t.text == "True") {
      e->literal = Value::boolean(true);
    } else if (t.text == "false" || t.text == "False") {
      e->literal = Value::boolean(false);
    } else if (t.text == "none" || t.text == "None") {
      e->literal = Value::none();
    } else {
      e->kind = Expr::Kind::kName;
      e->name = t.text;
    }
    return e;
  }
  if (t.kind == TokenKind::kString) {
    std::string s;
    int line = t.line;
    while (peek().kind == TokenKind::kString) s += next().text;
    auto e = make_expr(Expr::Kind::kLiteral, line);
    e->literal = Value::string(std::move(s));
    return e;
  }
  if (t.kind == TokenKind::kInteger || t.kind == TokenKind::kFloat) {
    next();
    auto e = make_expr(Expr::Kind::kLiteral, t.line);
    e->literal = t.kind == TokenKind::kInteger ? Value::integer(t.integer) : Value::real(t.real);
    return e;
  }
  if (skip_op("(")) {
    ExprPtr e = parse_tuple(true, true);
    expect_op(")");
    return e;
  }
  if (at_op("[")) return parse_list();
  if (at_op("{")) return parse_dict();
  error("unexpected " + describe(t));
}

ExprPtr OperandParser::parse_list() {
  auto e = make_expr(Expr::Kind::kList, next().line);
  while (!at_op("]")) {
    if (!e->args.empty()) expect_op(",");
    if (at_op("]")) break;
    e->args.push_back(parse_expression(true));
  }
  expect_op("]");
  return e;
}

ExprPtr OperandParser::parse_dict() {
  auto e = make_expr(Expr::Kind::kDict, next().line);
  while (!at_op("}")) {
    if (!e->args.empty()) expect_op(",");
    if (at_op("}")) break;
    e->args.push_back(parse_expression(true));
    expect_op(":");
    e->args.push_back(parse_expression(true));
  }
  expect_op("}");
  return e;
}

ExprPtr OperandParser::parse_postfix(ExprPtr e) {
  while (true) {
    if (at_op(".") || at_op("[")) {
      e = parse_subscript(std::move(e));
    } else if (at_op("(")) {
      e = parse_call(std::move(e));
    } else {
      return e;
    }
  }
}

ExprPtr OperandParser::parse_filter_expr(ExprPtr e) {
  while (true) {
    if (at_op("|")) {
      e = parse_filter(std::move(e));
    } else if (at_name("is")) {
      e = parse_test(std::move(e));
    } else if (at_op("(")) {
      e = parse_call(std::move(e));
    } else {
      return e;
    }
  }
}

ExprPtr OperandParser::parse_subscript(ExprPtr subject) {
  const Token& t = next();
  if (t.text == ".") {
    const Token& attr = next();
    if (attr.kind == TokenKind::kName) {
      auto e = make_expr(Expr::Kind::kGetAttr, t.line);
      e->name = attr.text;
      e->args.push_back(std::move(subject));
      return e;
    }
    if (attr.kind != TokenKind::kInteger) error("expected name or number after '.'");
    auto e = make_expr(Expr::Kind::kGetItem, t.line);
    auto key = make_expr(Expr::Kind::kLiteral, t.line);
    key->literal = Value::integer(attr.integer);
    e->args.push_back(std::move(subject));
    e->args.push_back(std::move(key));
    return e;
  }
  std::vector<ExprPtr> keys;
  while (!at_op("]")) {
    if (!keys.empty()) expect_op(",");
    keys.push_back(parse_subscribed());
  }
  expect_op("]");
  if (keys.empty()) error("expected a subscript");
  if (keys.size() == 1 && keys[0]->kind == Expr::Kind::kSlice) {
    keys[0]->args.insert(keys[0]->args.begin(), std::move(subject));
    return std::move(keys[0]);
  }
  auto e = make_expr(Expr::Kind::kGetItem, t.line);
  e->args.push_back(std::move(subject));
  if (keys.size() == 1) {
    e->args.push_back(std::move(keys[0]));
  } else {
    auto tuple = make_expr(Expr::Kind::kTuple, t.line);
    tuple->args = std::move(keys);
    e->args.push_back(std::move(tuple));
  }
  return e;
}

ExprPtr OperandParser::parse_subscribed() {
  int line = peek().line;
  std::vector<ExprPtr> parts;
  if (skip_op(":")) {
    parts.push_back(nullptr);
  } else {
    ExprPtr e = parse_expression(true);
    if (!skip_op(":")) return e;
    parts.push_back(std::move(e));
  }
  if (at_op(":") || at_op("]") || at_op(","))
    parts.push_back(nullptr);
  else
    parts.push_back(parse_expression(true));
  if (skip_op(":") && !at_op("]") && !at_op(","))
    parts.push_back(parse_expression(true));
  else
    parts.push_back(nullptr);
  auto slice = make_expr(Expr::Kind::kSlice, line);
  slice->args = std::move(parts);
  return slice;
}

void OperandParser::parse_call_args(Expr& e) {
  expect_op("(");
  bool first = true;
  while (!at_op(")")) {
    if (!first) {
      expect_op(",");
      if (at_op(")")) break;
    }
    first = false;
    if (at_op("*") || at_op("**")) error("unsupported: *args and **kwargs in calls");
    if (peek().kind == TokenKind::kName && at_op("=", 1)) {
      std::string key = next().text;
      next();
      e.kwargs.emplace_back(key, parse_expression(true));
    } else {
      if (!e.kwargs.empty()) error("positional argument after keyword argument");
      e.args.push_back(parse_expression(true));
    }
  }
  expect_op(")");
}

ExprPtr OperandParser::parse_call(ExprPtr callee) {
  auto e = make_expr(Expr::Kind::kCall, peek().line);
  e->args.push_back(std::move(callee));
  parse_call_args(*e);
  return e;
}

std::string OperandParser::parse_dotted_name() {
  std::string name = expect_name();
  while (at_op(".") && peek(1).kind == TokenKind::kName) {
    next();
    name += "." + next().text;
  }
  return name;
}

ExprPtr OperandParser::parse_filter(ExprPtr subject) {
  int line = next().line;  // '|'
  auto e = make_expr(Expr::Kind::kFilter, line);
  e->name = parse_dotted_name();
  e->args.push_back(std::move(subject));
  if (at_op("(")) parse_call_args(*e);
  return e;
}

ExprPtr OperandParser::parse_test(ExprPtr subject) {
  int line = next().line;  // 'is'
  auto e = make_expr(Expr::Kind::kTest, line);
  e->negated = skip_name("not");
  e->name = parse_dotted_name();
  e->args.push_back(std::move(subject));
  const Token& t = peek();
  if (at_op("(")) {
    parse_call_args(*e);
  } else if ((t.kind == TokenKind::kName || t.kind == TokenKind::kString ||
              t.kind == TokenKind::kInteger || t.kind == TokenKind::kFloat || at_op("[") ||
              at_op("{")) &&
             !at_name("else") && !at_name("or") && !at_name("and")) {
    if (at_name("is")) error("you cannot chain multiple tests with is");
    e->args.push_back(parse_postfix(parse_primary()));
  }
  return e;
}

}  // namespace moeline::tokenizer::jinja
