#include "tokenizer/jinja/template.h"

#include "tokenizer/jinja/builtins.h"
#include "tokenizer/jinja/evaluator.h"
#include "tokenizer/jinja/parser.h"

namespace moeline::tokenizer::jinja {
namespace {

Error to_error(const RenderError& e) {
  std::string where = e.line > 0 ? " at line " + std::to_string(e.line) : "";
  if (e.raised) return Error{"raise_exception" + where + ": " + e.what()};
  return Error{std::string(e.what()) + where};
}

// Contexts come from users: bound their nesting so conversion, printing and destruction (all
// recursive) cannot exhaust the stack.
constexpr int kMaxContextDepth = 256;

Value from_json(const nlohmann::ordered_json& j, int depth = 0) {
  if (depth > kMaxContextDepth)
    fail("the context is nested too deeply (over " + std::to_string(kMaxContextDepth) + " levels)");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) fail("context integer too large");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<Dict>();
      d->entries.reserve(j.size());
      // ordered_json keys are unique already.
      for (const auto& [k, v] : j.items())
        d->entries.emplace_back(Value::string(k), from_json(v, depth + 1));
      return Value::dict(d);
    }
    default:
      fail("unsupported JSON value in the context");
  }
}

// Unknown filters and tests fail at compile time in jinja2, before anything renders; so here.
void check_names(const Expr& e) {
  if (e.kind == Expr::Kind::kFilter && !find_filter(e.name))
    throw RenderError("unsupported filter '" + e.name + "'", e.line);
  if (e.kind == Expr::Kind::kTest && !find_test(e.name))
    throw RenderError("unsupported test '" + e.name + "'", e.line);
  for (const auto& a : e.args)
    if (a) check_names(*a);
  for (const auto& [k, v] : e.kwargs) check_names(*v);
}

void check_names(const Body& body) {
  for (const auto& s : body) {
    if (s->expr) check_names(*s->expr);
    if (s->filter) check_names(*s->filter);
    for (const auto& f : s->filters) check_names(*f);
    for (const auto& p : s->params)
      if (p.default_value) check_names(*p.default_value);
    for (const auto& [condition, branch] : s->branches) {
      check_names(*condition);
      check_names(branch);
    }
    check_names(s->body);
    check_names(s->else_body);
  }
}

}  // namespace

Expected<Template> Template::parse(std::string_view source) {
  try {
    auto body = std::make_shared<Body>(parse_template(source));
    check_names(*body);
    return Template(std::move(body));
  } catch (const RenderError& e) {
    return to_error(e);
  } catch (const std::exception& e) {
    return Error{std::string("template error: ") + e.what()};
  }
}

Expected<std::string> Template::render(const nlohmann::ordered_json& context,
                                       const RenderOptions& options) const {
  try {
    if (!context.is_object()) return Error{"the template context must be a JSON object"};
    auto globals = std::make_shared<Frame>();
    Value values = from_json(context);
    Evaluator ev(options, globals);
    for (auto& [k, v] : values.mapping().entries) globals->set(k.as_string(), v);
    return ev.render(*body_);
  } catch (const RenderError& e) {
    return to_error(e);
  } catch (const std::exception& e) {
    return Error{std::string("template error: ") + e.what()};
  }
}

}  // namespace moeline::tokenizer::jinja
