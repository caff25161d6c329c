#include "stages/http/stop_matcher.h"

#include <algorithm>

namespace moeline::stages::http {

StopMatcher::StopMatcher(std::vector<std::string> stops, std::vector<int32_t> stop_tokens,
                         bool include_stop, int64_t min_tokens)
    : stop_tokens_(std::move(stop_tokens)), include_stop_(include_stop), min_tokens_(min_tokens) {
  for (std::string& text : stops) {
    if (text.empty()) continue;
    Stop stop{std::move(text), {}, 0};
    stop.border.assign(stop.text.size(), 0);
    for (size_t i = 1, k = 0; i < stop.text.size(); ++i) {
      while (k > 0 && stop.text[i] != stop.text[k]) k = stop.border[k - 1];
      if (stop.text[i] == stop.text[k]) ++k;
      stop.border[i] = static_cast<uint32_t>(k);
    }
    stops_.push_back(std::move(stop));
  }
}

bool StopMatcher::stop_token(int32_t token) const {
  return std::find(stop_tokens_.begin(), stop_tokens_.end(), token) != stop_tokens_.end();
}

void StopMatcher::advance(Stop& stop, char byte) const {
  size_t k = stop.state;
  while (k > 0 && stop.text[k] != byte) k = stop.border[k - 1];
  if (stop.text[k] == byte) ++k;
  stop.state = k;
}

std::string StopMatcher::feed(const std::string& delta, int64_t tokens) {
  if (stopped_) return {};
  const size_t start = fed_;
  pending_ += delta;
  fed_ += delta.size();
  if (tokens <= min_tokens_) shielded_ = fed_;
  for (size_t i = 0; i < delta.size(); ++i) {
    const size_t end = start + i + 1;  // where a stop string completed by this byte ends
    const Stop* completed = nullptr;
    for (Stop& stop : stops_) {
      advance(stop, delta[i]);
      if (stop.state < stop.text.size()) continue;
      if (end <= shielded_)  // a match in min_tokens' text, passed over: its overlaps go on
        stop.state = stop.border[stop.state - 1];
      else if (completed == nullptr || stop.text.size() > completed->text.size())
        completed = &stop;
    }
    if (completed != nullptr) {
      stopped_ = true;
      matched_ = completed->text;
      // What is held back is the longest unfinished match, so the stop string begins in pending_.
      const size_t begin = std::max(end - completed->text.size(), pending_from_);
      const size_t keep = begin - pending_from_ + (include_stop_ ? completed->text.size() : 0);
      std::string out = pending_.substr(0, keep);
      pending_.clear();
      return out;
    }
  }
  // Hold back the longest tail that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const Stop& stop : stops_) hold = std::max(hold, stop.state);
  const size_t release = pending_.size() - std::min(hold, pending_.size());
  std::string out = pending_.substr(0, release);
  pending_.erase(0, release);
  pending_from_ += release;
  return out;
}

std::string StopMatcher::flush() {
  if (stopped_) return {};
  std::string out;
  out.swap(pending_);
  pending_from_ = fed_;
  return out;
}

}  // namespace moeline::stages::http
