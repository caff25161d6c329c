#include "tokenizer/jinja/evaluator.h"

#include "tokenizer/jinja/builtins.h"

namespace moeline::tokenizer::jinja {

const Value* Frame::find(const std::string& name) const {
  for (const Frame* f = this; f; f = f->parent.get())
    for (const auto& [key, value] : f->vars)
      if (key == name) return &value;
  return nullptr;
}

void Frame::set(const std::string& name, Value value) {
  for (auto& [key, v] : vars) {
    if (key == name) {
      v = std::move(value);
      return;
    }
  }
  vars.emplace_back(name, std::move(value));
}

Evaluator::Evaluator(const RenderOptions& options, std::shared_ptr<Frame> globals)
    : options_(options) {
  add_globals(*this, globals->vars);
  frame_ = std::make_shared<Frame>();
  frame_->parent = std::move(globals);
}

std::string Evaluator::render(const Body& body) {
  std::string out;
  exec(body, out);
  return out;
}

void Evaluator::count_steps(int64_t n) {
  steps_ += n;
  if (steps_ > options_.max_loop_iterations)
    fail("loop iteration limit exceeded (" + std::to_string(options_.max_loop_iterations) + ")");
}

void Evaluator::check_size(size_t bytes) const {
  if (bytes > options_.max_output_bytes)
    fail("output size limit exceeded (" + std::to_string(options_.max_output_bytes) + " bytes)");
}

void Evaluator::emit(std::string& out, std::string_view text) {
  produced_ += text.size();
  check_size(produced_);
  out.append(text);
}

Evaluator::Flow Evaluator::exec(const Body& body, std::string& out) {
  for (const auto& s : body) {
    Flow flow = exec(*s, out);
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

Evaluator::Flow Evaluator::exec(const Stmt& s, std::string& out) {
  try {
    switch (s.kind) {
      case Stmt::Kind::kText:
        emit(out, s.text);
        return Flow::kNormal;
      case Stmt::Kind::kOutput:
        emit(out, eval(*s.expr).str());
        return Flow::kNormal;
      case Stmt::Kind::kIf:
        return exec_if(s, out);
      case Stmt::Kind::kFor:
        return exec_for(s, out);
      case Stmt::Kind::kSet:
        exec_set(s);
        return Flow::kNormal;
      case Stmt::Kind::kSetBlock:
        exec_set_block(s);
        return Flow::kNormal;
      case Stmt::Kind::kMacro:
        frame_->set(s.text, make_macro(s, nullptr));
        return Flow::kNormal;
      case Stmt::Kind::kCallBlock: {
        const Expr& call = *s.expr;
        Value callee = eval(*call.args[0]);
        CallArgs args = eval_args(call, 1);
        args.keyword.emplace_back("caller", make_macro(s, &s.body));
        emit(out, this->call(callee, args).str());
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak:
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        return Flow::kContinue;
      case Stmt::Kind::kScope:
        return exec(s.body, out);
    }
  } catch (RenderError& e) {
    if (e.line == 0) e.line = s.line;
    throw;
  }
  return Flow::kNormal;
}

Evaluator::Flow Evaluator::exec_if(const Stmt& s, std::string& out) {
  for (const auto& [condition, body] : s.branches)
    if (eval(*condition).truthy()) return exec(body, out);
  return exec(s.else_body, out);
}

void Evaluator::assign(const Target& target, const Value& value, Frame& frame) {
  if (!target.unpack) {
    frame.set(target.names[0], value);
    return;
  }
  List items = value.is_string() || value.is_sequence() || value.is_dict() || value.is_iterator()
                   ? iterate(value)
                   : (fail("cannot unpack non-iterable " + value.type_name()), List{});
  if (items.size() != target.names.size())
    fail(items.size() > target.names.size()
             ? "too many values to unpack (expected " + std::to_string(target.names.size()) + ")"
             : "not enough values to unpack (expected " + std::to_string(target.names.size()) +
                   ", got " + std::to_string(items.size()) + ")");
  for (size_t i = 0; i < items.size(); ++i) frame.set(target.names[i], items[i]);
}

namespace {

// jinja2's `loop` object, as a dict so that attribute access finds its fields.
Value loop_object(const List& items, size_t i, int depth) {
  auto d = std::make_shared<Dict>();
  auto n = static_cast<int64_t>(items.size());
  auto idx = static_cast<int64_t>(i);
  d->set(Value::string("index"), Value::integer(idx + 1));
  d->set(Value::string("index0"), Value::integer(idx));
  d->set(Value::string("revindex"), Value::integer(n - idx));
  d->set(Value::string("revindex0"), Value::integer(n - idx - 1));
  d->set(Value::string("first"), Value::boolean(i == 0));
  d->set(Value::string("last"), Value::boolean(idx == n - 1));
  d->set(Value::string("length"), Value::integer(n));
  d->set(Value::string("depth"), Value::integer(depth));
  d->set(Value::string("depth0"), Value::integer(depth - 1));
  if (i > 0) d->set(Value::string("previtem"), items[i - 1]);
  if (idx + 1 < n) d->set(Value::string("nextitem"), items[i + 1]);
  d->set(Value::string("cycle"), Value::callable("loop.cycle", [i](CallArgs& args) {
           if (args.positional.empty()) fail("no items for cycling given");
           return args.positional[i % args.positional.size()];
         }));
  return Value::dict(d);
}

}  // namespace

Evaluator::Flow Evaluator::exec_for(const Stmt& s, std::string& out) {
  Value iterable = eval(*s.expr);
  if (iterable.is_undefined() && iterable.undefined_hint().find("is unsafe") != std::string::npos)
    fail(iterable.undefined_hint());
  List items = iterate(iterable);
  std::shared_ptr<Frame> outer = frame_;
  if (s.filter) {
    List kept;
    for (const Value& item : items) {
      count_steps();
      auto frame = std::make_shared<Frame>();
      frame->parent = outer;
      assign(s.target, item, *frame);
      frame_ = frame;
      bool keep = eval(*s.filter).truthy();
      frame_ = outer;
      if (keep) kept.push_back(item);
    }
    items = std::move(kept);
  }
  // loop.depth counts recursive-loop levels, and recursive loops are not supported.
  const int depth = 1;
  Flow flow = Flow::kNormal;
  for (size_t i = 0; i < items.size(); ++i) {
    count_steps();
    auto frame = std::make_shared<Frame>();
    frame->parent = outer;
    assign(s.target, items[i], *frame);
    frame->set("loop", loop_object(items, i, depth));
    frame_ = frame;
    try {
      flow = exec(s.body, out);
    } catch (...) {
      frame_ = outer;
      throw;
    }
    frame_ = outer;
    if (flow == Flow::kBreak) break;
  }
  if (items.empty()) return exec(s.else_body, out);
  return Flow::kNormal;
}

void Evaluator::exec_set(const Stmt& s) {
  Value value = eval(*s.expr);
  if (s.target.attribute.empty()) return assign(s.target, value, *frame_);
  const Value* ns = frame_->find(s.target.names[0]);
  if (!ns || !ns->is_namespace())
    fail("cannot assign attribute on non-namespace object '" + s.target.names[0] + "'");
  ns->mapping().set(Value::string(s.target.attribute), std::move(value));
}

std::string Evaluator::render_scoped(const Body& body, std::shared_ptr<Frame> frame) {
  std::shared_ptr<Frame> saved = frame_;
  frame_ = std::move(frame);
  std::string out;
  try {
    exec(body, out);
  } catch (...) {
    frame_ = saved;
    throw;
  }
  frame_ = saved;
  return out;
}

void Evaluator::exec_set_block(const Stmt& s) {
  // A block set renders in the current scope (its sets are visible after it, as in jinja2).
  std::string text;
  exec(s.body, text);
  Value value = Value::string(std::move(text));
  for (const auto& f : s.filters) {
    CallArgs args = eval_args(*f, 1);
    value = apply_filter(f->name, value, args);
  }
  frame_->set(s.target.names[0], std::move(value));
}

Value Evaluator::make_macro(const Stmt& s, const Body* caller_body) {
  std::shared_ptr<Frame> defined_in = frame_;
  const Stmt* macro = &s;
  std::string name = caller_body ? "caller" : s.text;
  return Value::callable(name, [this, defined_in, macro, caller_body, name](CallArgs& args) {
    if (call_depth_ >= options_.max_call_depth)
      fail("macro call depth limit exceeded (" + std::to_string(options_.max_call_depth) + ")");
    struct DepthGuard {
      int& depth;
      explicit DepthGuard(int& d) : depth(++d) {}
      ~DepthGuard() { --depth; }
    } guard(call_depth_);
    auto frame = std::make_shared<Frame>();
    frame->parent = defined_in;
    const auto& params = macro->params;
    if (!macro->catch_varargs && args.positional.size() > params.size())
      fail(cat({"macro '", name, "' takes not more than ", std::to_string(params.size()),
                " argument(s)"}));
    List varargs;
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (i < params.size())
        frame->set(params[i].name, args.positional[i]);
      else
        varargs.push_back(args.positional[i]);
    }
    auto kwargs = std::make_shared<Dict>();
    for (auto& [key, value] : args.keyword) {
      bool is_param = false;
      for (const auto& p : params) is_param |= p.name == key;
      if (is_param || key == "caller") {
        frame->set(key, value);
      } else if (macro->catch_kwargs) {
        kwargs->set(Value::string(key), value);
      } else {
        fail(cat({"macro '", name, "' takes no keyword argument '", key, "'"}));
      }
    }
    std::shared_ptr<Frame> saved = frame_;
    frame_ = frame;
    try {
      for (const auto& p : params) {
        bool bound = false;
        for (const auto& [key, value] : frame->vars) bound |= key == p.name;
        if (!bound)
          frame->set(p.name, p.default_value
                                 ? eval(*p.default_value)
                                 : Value::undefined("parameter '" + p.name + "' was not provided"));
      }
    } catch (...) {
      frame_ = saved;
      throw;
    }
    frame_ = saved;
    frame->set("varargs", Value::tuple(std::move(varargs)));
    frame->set("kwargs", Value::dict(kwargs));
    return Value::string(render_scoped(caller_body ? *caller_body : macro->body, frame));
  });
}

}  // namespace moeline::tokenizer::jinja
