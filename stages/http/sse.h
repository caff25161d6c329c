#pragma once
// Server-sent events as the translations of the chat stream (responses.h, messages.h) read and
// write them: the chat stream's bytes arrive cut anywhere, and the APIs they are translated to
// name each event (`event: TYPE`) before its data.

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

#include "stages/http/openai.h"

namespace moeline::stages::http {

class SseEvents {
 public:
  // Appends `size` bytes, then passes each event now whole (its text without the blank line
  // that ends it) to `on_event`; false as soon as that returns false. The chat stream is this
  // server's own, so a field of an unexpected type is a bug here: an event whose handling throws
  // a JSON error is left out rather than thrown on (on the thread that delivers every stream).
  template <class OnEvent>
  bool feed(const char* data, size_t size, OnEvent&& on_event) {
    pending_.append(data, size);
    size_t end = 0;
    while ((end = pending_.find("\n\n")) != std::string::npos) {
      const std::string event = pending_.substr(0, end);
      pending_.erase(0, end + 2);
      try {
        if (!on_event(event)) return false;
      } catch (const nlohmann::json::exception&) {
        continue;
      }
    }
    return true;
  }

 private:
  std::string pending_;  // bytes of an event not yet complete
};

// `event: TYPE` and its JSON data, as one server-sent event.
inline std::string named_event(const char* type, const nlohmann::json& data) {
  return std::string("event: ") + type + "\ndata: " + to_text(data) + "\n\n";
}

}  // namespace moeline::stages::http
