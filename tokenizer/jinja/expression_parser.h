#pragma once
// The parser's layers, bottom up: TokenStream (tokens and their checks), OperandParser (literals,
// names, subscripts, calls, filters and tests), ExpressionParser (jinja2's operator precedence and
// conditional expressions); parser.cpp adds the statements on top. Internal to the engine.

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/jinja/ast.h"
#include "tokenizer/jinja/lexer.h"
#include "tokenizer/jinja/parser.h"

namespace moeline::tokenizer::jinja {

inline ExprPtr make_expr(Expr::Kind kind, int line) {
  auto e = std::make_unique<Expr>();
  e->kind = kind;
  e->line = line;
  return e;
}

class TokenStream {
 public:
  explicit TokenStream(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

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

  // Bounds recursion: every nested block, unary operator and expression passes one.
  struct DepthGuard {
    explicit DepthGuard(TokenStream& s) : stream(s) {
      if (++stream.depth_ > kMaxParseDepth) stream.error("template nesting too deep");
    }
    ~DepthGuard() { --stream.depth_; }
    TokenStream& stream;
  };

 protected:
  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
};

// Operands and their postfix forms; full expressions come from the subclass (parentheses, list
// items and arguments hold any expression).
class OperandParser : public TokenStream {
 public:
  using TokenStream::TokenStream;
  virtual ~OperandParser() = default;
  virtual ExprPtr parse_tuple(bool with_condition, bool explicit_parentheses) = 0;
  virtual ExprPtr parse_expression(bool with_condition) = 0;

  ExprPtr parse_primary();
  ExprPtr parse_list();
  ExprPtr parse_dict();
  ExprPtr parse_postfix(ExprPtr e);
  ExprPtr parse_filter_expr(ExprPtr e);
  ExprPtr parse_subscript(ExprPtr subject);
  ExprPtr parse_subscribed();
  void parse_call_args(Expr& e);
  ExprPtr parse_call(ExprPtr callee);
  std::string parse_dotted_name();
  ExprPtr parse_filter(ExprPtr subject);
  ExprPtr parse_test(ExprPtr subject);
};

class ExpressionParser : public OperandParser {
 public:
  using OperandParser::OperandParser;

  bool at_tuple_end() const;
  ExprPtr parse_tuple(bool with_condition, bool explicit_parentheses) override;
  ExprPtr parse_expression(bool with_condition) override;
  ExprPtr binary(Expr::Kind kind, std::string op, ExprPtr left, ExprPtr right, int line);
  ExprPtr parse_or();
  ExprPtr parse_and();
  ExprPtr parse_not();
  ExprPtr parse_compare();
  ExprPtr parse_math1();
  ExprPtr parse_concat();
  ExprPtr parse_math2();
  ExprPtr parse_pow();
  ExprPtr parse_unary(bool with_filter);
};

}  // namespace moeline::tokenizer::jinja
