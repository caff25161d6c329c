#pragma once
// Walks the statement tree with jinja2's scoping: the context and globals at the root, template
// variables above them, a fresh frame per loop iteration (so `set` inside a loop does not leak,
// which is why templates use namespace()), and a frame per macro call. One Evaluator per render;
// not thread-safe.

#include <memory>
#include <string>
#include <vector>

#include "tokenizer/jinja/ast.h"
#include "tokenizer/jinja/template.h"
#include "tokenizer/jinja/value.h"

namespace moeline::tokenizer::jinja {

struct Frame {
  std::shared_ptr<Frame> parent;
  std::vector<std::pair<std::string, Value>> vars;
  const Value* find(const std::string& name) const;
  void set(const std::string& name, Value value);
};

class Evaluator {
 public:
  Evaluator(const RenderOptions& options, std::shared_ptr<Frame> globals);

  std::string render(const Body& body);
  Value eval(const Expr& e);
  Value call(const Value& callee, CallArgs& args);
  Value apply_filter(const std::string& name, const Value& subject, CallArgs& args);
  bool apply_test(const std::string& name, const Value& subject, CallArgs& args);

  // Limits: one unit of work per loop iteration or per item a filter walks; every string built
  // is checked against the output limit.
  void count_steps(int64_t n = 1);
  void check_size(size_t bytes) const;
  const RenderOptions& options() const { return options_; }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  Flow exec(const Body& body, std::string& out);
  Flow exec(const Stmt& s, std::string& out);
  Flow exec_if(const Stmt& s, std::string& out);
  Flow exec_for(const Stmt& s, std::string& out);
  void exec_set(const Stmt& s);
  void exec_set_block(const Stmt& s);
  Value make_macro(const Stmt& s, const Body* caller_body);
  void assign(const Target& target, const Value& value, Frame& frame);
  void emit(std::string& out, std::string_view text);
  std::string render_scoped(const Body& body, std::shared_ptr<Frame> frame);

  Value eval_unchecked(const Expr& e);
  Value eval_call(const Expr& e);
  Value eval_compare(const Expr& e);
  Value eval_slice(const Expr& e);
  CallArgs eval_args(const Expr& e, size_t first);

  const RenderOptions& options_;
  std::shared_ptr<Frame> frame_;
  int64_t steps_ = 0;
  size_t produced_ = 0;
  int call_depth_ = 0;
};

// Binary operators with Python semantics: + - * / // % ** and ~ (string concatenation).
Value binary_op(const std::string& op, const Value& a, const Value& b, const Evaluator& ev);

}  // namespace moeline::tokenizer::jinja
