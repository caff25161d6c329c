#include "base/environment.h"

#include <cstdlib>

namespace moeline::env {

const char* get(const Variable& variable) {
  return std::getenv(variable.name);  // NOLINT(concurrency-mt-unsafe): read before threads start
}

const char* get_setting(const char* variable_name) {
  return std::getenv(variable_name);  // NOLINT(concurrency-mt-unsafe)
}

}  // namespace moeline::env
