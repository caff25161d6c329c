#include "model/jinja/parser.h"

#include <set>

#include "model/jinja/lexer.h"

namespace moeline::model::jinja {
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

ExprPtr make(Expr::Kind kind, int line) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->line = line;
  return e;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse_all() {
    Body body = parse_body({});
    if (peek().kind != TokenKind::kEnd) error("unexpected tag '" + peek(1).text + "'");
    return body;
  }

 private:
  // ---- token helpers
  const Token& peek(size_t ahead = 0) const {
    size_t i = std::min(pos_ + ahead, tokens_.size() - 1);
    return tokens_[i];
  }
  const Token& next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool at_op(std::string_view op, size_t ahead = 0) const {
    return peek(ahead).kind == TokenKind::kOperator && peek(ahead).text == op;
  }
  bool at_name(std::string_view name, size_t ahead = 0) const {
    return peek(ahead).kind == TokenKind::kName && peek(ahead).text == name;
  }
  bool skip_op(std::string_view op) {
    if (!at_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!at_name(name)) return false;
    next();
    return true;
  }
  [[noreturn]] void error(const std::string& message) const {
    throw RenderError(message, peek().line);
  }
  std::string describe(const Token& t) const {
    switch (t.kind) {
      case TokenKind::kEnd:
        return "end of template";
      case TokenKind::kBlockEnd:
        return "end of statement block";
      case TokenKind::kVariableEnd:
        return "end of print statement";
      case TokenKind::kString:
        return "string";
      default:
        return "'" + t.text + "'";
    }
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op)) error("expected '" + std::string(op) + "', got " + describe(peek()));
  }
  std::string expect_name() {
    if (peek().kind != TokenKind::kName) error("expected a name, got " + describe(peek()));
    return next().text;
  }
  void expect_block_end() {
    if (peek().kind != TokenKind::kBlockEnd)
      error("expected end of statement block, got " + describe(peek()));
    next();
  }

  struct DepthGuard {
    explicit DepthGuard(Parser& p) : parser(p) {
      if (++parser.depth_ > kMaxParseDepth) parser.error("template nesting too deep");
    }
    ~DepthGuard() { --parser.depth_; }
    Parser& parser;
  };

  // ---- statements
  Body parse_body(const std::set<std::string>& end_tags) {
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

  StmtPtr parse_statement() {
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

  Body parse_end(const std::string& end_tag) {
    Body body = parse_body({end_tag});
    next();  // block begin
    next();  // end tag
    expect_block_end();
    return body;
  }

  void parse_if(Stmt& s) {
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

  Target parse_target(bool allow_tuple, bool allow_attribute) {
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

  void parse_for(Stmt& s) {
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

  void parse_set(Stmt& s) {
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

  void parse_params(Stmt& s) {
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

  void parse_macro(Stmt& s) {
    s.kind = Stmt::Kind::kMacro;
    s.text = expect_name();
    parse_params(s);
    expect_block_end();
    s.body = parse_end("endmacro");
    s.catch_varargs = uses_name(s.body, "varargs");
    s.catch_kwargs = uses_name(s.body, "kwargs");
  }

  void parse_call_block(Stmt& s) {
    s.kind = Stmt::Kind::kCallBlock;
    if (at_op("(")) parse_params(s);
    s.expr = parse_expression(true);
    if (s.expr->kind != Expr::Kind::kCall) error("expected a call in the call block");
    expect_block_end();
    s.body = parse_end("endcall");
    s.catch_varargs = uses_name(s.body, "varargs");
    s.catch_kwargs = uses_name(s.body, "kwargs");
  }

  // ---- expressions
  bool at_tuple_end() const {
    const Token& t = peek();
    return t.kind == TokenKind::kVariableEnd || t.kind == TokenKind::kBlockEnd ||
           t.kind == TokenKind::kEnd || at_op(")") || at_name("in") || at_name("recursive");
  }

  ExprPtr parse_tuple(bool with_condition, bool explicit_parentheses) {
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
    auto e = make(Expr::Kind::kTuple, line);
    e->args = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condition) {
    DepthGuard guard(*this);
    ExprPtr e = parse_or();
    if (!with_condition) return e;
    while (at_name("if")) {
      int line = next().line;
      auto c = make(Expr::Kind::kCondition, line);
      ExprPtr test = parse_or();
      ExprPtr otherwise = skip_name("else") ? parse_expression(true) : nullptr;
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(test));
      c->args.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(Expr::Kind kind, std::string op, ExprPtr left, ExprPtr right, int line) {
    auto e = make(kind, line);
    e->name = std::move(op);
    e->args.push_back(std::move(left));
    e->args.push_back(std::move(right));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (at_name("or")) {
      int line = next().line;
      left = binary(Expr::Kind::kOr, "or", std::move(left), parse_and(), line);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (at_name("and")) {
      int line = next().line;
      left = binary(Expr::Kind::kAnd, "and", std::move(left), parse_not(), line);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (at_name("not")) {
      DepthGuard guard(*this);
      auto e = make(Expr::Kind::kNot, next().line);
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
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
    auto e = make(Expr::Kind::kCompare, line);
    e->args.push_back(std::move(first));
    for (auto& o : operands) e->args.push_back(std::move(o));
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (at_op("+") || at_op("-")) {
      const Token& t = next();
      left = binary(Expr::Kind::kBinary, t.text, std::move(left), parse_concat(), t.line);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (at_op("~")) {
      const Token& t = next();
      left = binary(Expr::Kind::kBinary, "~", std::move(left), parse_math2(), t.line);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
      const Token& t = next();
      left = binary(Expr::Kind::kBinary, t.text, std::move(left), parse_pow(), t.line);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (at_op("**")) {
      const Token& t = next();
      left = binary(Expr::Kind::kBinary, "**", std::move(left), parse_unary(true), t.line);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr e;
    if (at_op("-") || at_op("+")) {
      const Token& t = next();
      e = make(t.text == "-" ? Expr::Kind::kNegate : Expr::Kind::kPlus, t.line);
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = peek();
    if (t.kind == TokenKind::kName) {
      next();
      auto e = make(Expr::Kind::kLiteral, t.line);
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
      auto e = make(Expr::Kind::kLiteral, line);
      e->literal = Value::string(std::move(s));
      return e;
    }
    if (t.kind == TokenKind::kInteger || t.kind == TokenKind::kFloat) {
      next();
      auto e = make(Expr::Kind::kLiteral, t.line);
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

  ExprPtr parse_list() {
    auto e = make(Expr::Kind::kList, next().line);
    while (!at_op("]")) {
      if (!e->args.empty()) expect_op(",");
      if (at_op("]")) break;
      e->args.push_back(parse_expression(true));
    }
    expect_op("]");
    return e;
  }

  ExprPtr parse_dict() {
    auto e = make(Expr::Kind::kDict, next().line);
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

  ExprPtr parse_postfix(ExprPtr e) {
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

  ExprPtr parse_filter_expr(ExprPtr e) {
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

  ExprPtr parse_subscript(ExprPtr subject) {
    const Token& t = next();
    if (t.text == ".") {
      const Token& attr = next();
      if (attr.kind == TokenKind::kName) {
        auto e = make(Expr::Kind::kGetAttr, t.line);
        e->name = attr.text;
        e->args.push_back(std::move(subject));
        return e;
      }
      if (attr.kind != TokenKind::kInteger) error("expected name or number after '.'");
      auto e = make(Expr::Kind::kGetItem, t.line);
      auto key = make(Expr::Kind::kLiteral, t.line);
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
    auto e = make(Expr::Kind::kGetItem, t.line);
    e->args.push_back(std::move(subject));
    if (keys.size() == 1) {
      e->args.push_back(std::move(keys[0]));
    } else {
      auto tuple = make(Expr::Kind::kTuple, t.line);
      tuple->args = std::move(keys);
      e->args.push_back(std::move(tuple));
    }
    return e;
  }

  ExprPtr parse_subscribed() {
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
    auto slice = make(Expr::Kind::kSlice, line);
    slice->args = std::move(parts);
    return slice;
  }

  void parse_call_args(Expr& e) {
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

  ExprPtr parse_call(ExprPtr callee) {
    auto e = make(Expr::Kind::kCall, peek().line);
    e->args.push_back(std::move(callee));
    parse_call_args(*e);
    return e;
  }

  std::string parse_dotted_name() {
    std::string name = expect_name();
    while (at_op(".") && peek(1).kind == TokenKind::kName) {
      next();
      name += "." + next().text;
    }
    return name;
  }

  ExprPtr parse_filter(ExprPtr subject) {
    int line = next().line;  // '|'
    auto e = make(Expr::Kind::kFilter, line);
    e->name = parse_dotted_name();
    e->args.push_back(std::move(subject));
    if (at_op("(")) parse_call_args(*e);
    return e;
  }

  ExprPtr parse_test(ExprPtr subject) {
    int line = next().line;  // 'is'
    auto e = make(Expr::Kind::kTest, line);
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

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

Body parse_template(std::string_view source) {
  return Parser(tokenize(source)).parse_all();
}

}  // namespace moeline::model::jinja
