#include "stages/http/stop_matcher.h"

#include <algorithm>

namespace moeline::stages::http {

StopMatcher::StopMatcher(std::vector<std::string> stops, std::vector<int32_t> stop_tokens,
                         bool include_stop, int64_t min_tokens)
    : stop_tokens_(std::move(stop_tokens)), include_stop_(include_stop), min_tokens_(min_tokens) {
  for (std::string& stop : stops)
    if (!stop.empty()) stops_.push_back(std::move(stop));
}

bool StopMatcher::stop_token(int32_t token) const {
  return std::find(stop_tokens_.begin(), stop_tokens_.end(), token) != stop_tokens_.end();
}

std::string StopMatcher::feed(const std::string& delta, int64_t tokens) {
  if (stopped_) return {};
  pending_ += delta;
  if (tokens <= min_tokens_) shielded_ = pending_.size();
  // The earliest stop string wins (as the text would have been cut there).
  size_t cut = std::string::npos;
  const std::string* earliest = nullptr;
  for (const std::string& stop : stops_) {
    // A match must end past the shielded text: it begins at shielded_ - size + 1 or later.
    const size_t from = shielded_ >= stop.size() ? shielded_ - stop.size() + 1 : 0;
    const size_t at = pending_.find(stop, from);
    if (at < cut) {
      cut = at;
      earliest = &stop;
    }
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    matched_ = *earliest;
    std::string out = pending_.substr(0, cut + (include_stop_ ? matched_.size() : 0));
    pending_.clear();
    return out;
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    const size_t longest = std::min(stop.size() - 1, pending_.size());
    for (size_t n = longest; n > hold; --n) {
      if (pending_.compare(pending_.size() - n, n, stop, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  shielded_ -= std::min(shielded_, out.size());
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return {};
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace moeline::stages::http
