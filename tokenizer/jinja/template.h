#pragma once
// A Jinja template, rendered as Hugging Face transformers renders chat templates: jinja2's
// ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls, the globals
// raise_exception() and strftime_now(), and a tojson filter that is json.dumps without HTML
// escaping. See tokenizer/jinja/README.md for what is supported.
//
// Templates come from model files and contexts from users, so every render is bounded (output
// size, loop iterations, macro call depth) and every failure is an Error value naming the construct
// and the line; nothing throws out of this API. A parsed Template is immutable and may render from
// several threads at once.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"

namespace moeline::tokenizer::jinja {

struct Stmt;

struct RenderOptions {
  size_t max_output_bytes = 16u << 20;  // all text produced, macro and block-set bodies included
  int64_t max_loop_iterations = 1'000'000;  // for-loop iterations and filter steps, all together
  int max_call_depth = 64;                  // nested macro calls
  // The time strftime_now() formats (local time); unset = the clock at the call.
  std::optional<std::chrono::system_clock::time_point> now;
};

class Template {
 public:
  static Expected<Template> parse(std::string_view source);

  // The context's keys are the template's variables. An ordered_json keeps the key order that
  // json.dumps (tojson) and dict iteration show; a plain nlohmann::json converts to it.
  Expected<std::string> render(const nlohmann::ordered_json& context,
                               const RenderOptions& options = {}) const;

 private:
  explicit Template(std::shared_ptr<const std::vector<std::unique_ptr<Stmt>>> body)
      : body_(std::move(body)) {}
  std::shared_ptr<const std::vector<std::unique_ptr<Stmt>>> body_;
};

}  // namespace moeline::tokenizer::jinja
