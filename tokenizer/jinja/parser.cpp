// Statements: the body of a template and each tag (if, for, set, macro, call, ...).
#include <set>

#include "tokenizer/jinja/expression_parser.h"

namespace moeline::tokenizer::jinja {
namespace {

bool uses_name(const Expr* e, const std::string& name) {
  if (!e) return false;
  if (e->kind == Expr::Kind::kName && e->name == name) return true;
  for (const auto& a : e->args)
    if (uses_name(a.get(), name)) return true;
  for (const auto& [k, v] : e->kwargs)
    if (uses_name(v.get(), name)) return true;
  return false;
}

bool uses_name(const Body& body, const std::string& name) {
  for (const auto& s : body) {
    if (uses_name(s->expr.get(), name) || uses_name(s->filter.get(), name) ||
        uses_name(s->body, name) || uses_name(s->else_body, name))
      return true;
    for (const auto& [condition, branch] : s->branches)
      if (uses_name(condition.get(), name) || uses_name(branch, name)) return true;
    for (const auto& f : s->filters)
      if (uses_name(f.get(), name)) return true;
  }
  return false;
}

class StatementParser : public ExpressionParser {
 public:
  using ExpressionParser::ExpressionParser;
  Body parse_all() {
    Body body = parse_body({});
    if (peek().kind != TokenKind::kEnd) error("unexpected tag '" + peek(1).text + "'");
    return body;
  }

 private:
  Body parse_body(const std::set<std::string>& end_tags);
  StmtPtr parse_statement();
  Body parse_end(const std::string& end_tag);
  void parse_if(Stmt& s);
  Target parse_target(bool allow_tuple, bool allow_attribute);
  void parse_for(Stmt& s);
  void parse_set(Stmt& s);
  void parse_params(Stmt& s);
  void parse_macro(Stmt& s);
  void parse_call_block(Stmt& s);
};

Body StatementParser::parse_body(const std::set<std::string>& end_tags) {
  DepthGuard guard(*this);
  Body body;
  while (true) {
    const Token& t = peek();
    if (t.kind == TokenKind::kEnd) {
      if (!end_tags.empty())
        error("unexpected end of template, expected '" + *end_tags.rbegin() + "'");
      return body;
    }
    if (t.kind == TokenKind::kText) {
      auto s = std::make_unique<Stmt>();
      s->kind = Stmt::Kind::kText;
      s->line = t.line;
      s->text = next().text;
      body.push_back(std::move(s));
    } else if (t.kind == TokenKind::kVariableBegin) {
      next();
      auto s = std::make_unique<Stmt>();
      s->kind = Stmt::Kind::kOutput;
      s->line = t.line;
      s->expr = parse_tuple(true, false);
      if (peek().kind != TokenKind::kVariableEnd)
        error("expected end of print statement, got " + describe(peek()));
      next();
      body.push_back(std::move(s));
    } else {
      // A block tag.
      if (peek(1).kind == TokenKind::kName && end_tags.count(peek(1).text)) return body;
      next();
      body.push_back(parse_statement());
    }
  }
}

StmtPtr StatementParser::parse_statement() {
  if (peek().kind != TokenKind::kName) error("tag name expected");
  int line = peek().line;
  std::string tag = next().text;
  auto s = std::make_unique<Stmt>();
  s->line = line;
  if (tag == "if") {
    parse_if(*s);
  } else if (tag == "for") {
    parse_for(*s);
  } else if (tag == "set") {
    parse_set(*s);
  } else if (tag == "macro") {
    parse_macro(*s);
  } else if (tag == "call") {
    parse_call_block(*s);
  } else if (tag == "break" || tag == "continue") {
    s->kind = tag == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
    expect_block_end();
  } else if (tag == "generation") {
    s->kind = Stmt::Kind::kScope;
    expect_block_end();
    s->body = parse_end("endgeneration");
  } else {
    throw RenderError("unsupported tag '" + tag + "'", line);
  }
  return s;
}

Body StatementParser::parse_end(const std::string& end_tag) {
  Body body = parse_body({end_tag});
  next();  // block begin
  next();  // end tag
  expect_block_end();
  return body;
}

void StatementParser::parse_if(Stmt& s) {
  s.kind = Stmt::Kind::kIf;
  ExprPtr condition = parse_tuple(true, false);
  while (true) {
    expect_block_end();
    Body body = parse_body({"elif", "else", "endif"});
    s.branches.emplace_back(std::move(condition), std::move(body));
    next();  // block begin
    std::string tag = next().text;
    if (tag == "elif") {
      condition = parse_tuple(true, false);
      continue;
    }
    if (tag == "else") {
      expect_block_end();
      s.else_body = parse_end("endif");
    } else {
      expect_block_end();
    }
    return;
  }
}

Target StatementParser::parse_target(bool allow_tuple, bool allow_attribute) {
  Target target;
  bool parenthesized = skip_op("(");
  target.names.push_back(expect_name());
  if (allow_attribute && at_op(".")) {
    next();
    target.attribute = expect_name();
    return target;
  }
  while (allow_tuple && at_op(",")) {
    next();
    target.unpack = true;
    if (at_name("in") || at_op(")") || at_op("=")) break;
    target.names.push_back(expect_name());
  }
  if (parenthesized) {
    expect_op(")");
    target.unpack = true;
  }
  return target;
}

void StatementParser::parse_for(Stmt& s) {
  s.kind = Stmt::Kind::kFor;
  s.target = parse_target(true, false);
  if (!skip_name("in")) error("expected 'in', got " + describe(peek()));
  s.expr = parse_tuple(false, false);
  if (skip_name("if")) s.filter = parse_tuple(true, false);
  if (at_name("recursive")) error("unsupported: recursive for loops");
  expect_block_end();
  s.body = parse_body({"else", "endfor"});
  next();
  std::string tag = next().text;
  expect_block_end();
  if (tag == "else") s.else_body = parse_end("endfor");
}

void StatementParser::parse_set(Stmt& s) {
  s.target = parse_target(true, true);
  if (skip_op("=")) {
    s.kind = Stmt::Kind::kSet;
    s.expr = parse_tuple(true, false);
    expect_block_end();
    return;
  }
  if (!s.target.attribute.empty() || s.target.unpack)
    error("a block set needs a single name as its target");
  s.kind = Stmt::Kind::kSetBlock;
  while (at_op("|")) s.filters.push_back(parse_filter(nullptr));
  expect_block_end();
  s.body = parse_end("endset");
}

void StatementParser::parse_params(Stmt& s) {
  expect_op("(");
  while (!at_op(")")) {
    if (!s.params.empty()) expect_op(",");
    MacroParam p;
    p.name = expect_name();
    if (skip_op("=")) {
      p.default_value = parse_expression(true);
    } else if (!s.params.empty() && s.params.back().default_value) {
      error("non-default argument follows default argument");
    }
    s.params.push_back(std::move(p));
  }
  expect_op(")");
}

void StatementParser::parse_macro(Stmt& s) {
  s.kind = Stmt::Kind::kMacro;
  s.text = expect_name();
  parse_params(s);
  expect_block_end();
  s.body = parse_end("endmacro");
  s.catch_varargs = uses_name(s.body, "varargs");
  s.catch_kwargs = uses_name(s.body, "kwargs");
}

void StatementParser::parse_call_block(Stmt& s) {
  s.kind = Stmt::Kind::kCallBlock;
  if (at_op("(")) parse_params(s);
  s.expr = parse_expression(true);
  if (s.expr->kind != Expr::Kind::kCall) error("expected a call in the call block");
  expect_block_end();
  s.body = parse_end("endcall");
  s.catch_varargs = uses_name(s.body, "varargs");
  s.catch_kwargs = uses_name(s.body, "kwargs");
}

}  // namespace

Body parse_template(std::string_view source) {
  return StatementParser(tokenize(source)).parse_all();
}

}  // namespace moeline::tokenizer::jinja
