#include "stages/http/reasoning.h"

#include "stages/http/markers.h"

namespace moeline::stages::http {
namespace {

constexpr std::string_view kSpace = " \t\r\n";

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

std::string_view trim_right(std::string_view text) {
  const size_t last = text.find_last_not_of(kSpace);
  return last == std::string_view::npos ? std::string_view() : text.substr(0, last + 1);
}

}  // namespace

bool prompt_opens_reasoning(std::string_view prompt) {
  return trim_right(prompt).ends_with(kThinkOpen);
}

bool prompt_closes_reasoning(std::string_view prompt) {
  return trim_right(prompt).ends_with(kThinkClose);
}

ReasoningStream::ReasoningStream(ReasoningStart start)
    : state_(start == ReasoningStart::kOff    ? State::kContent
             : start == ReasoningStart::kOpen ? State::kReasoning
                                              : State::kStart) {}

ReasoningParts ReasoningStream::feed(std::string_view delta) {
  ReasoningParts out;
  if (state_ == State::kContent) {  // the common case once reasoning is over: no copy
    out.content = delta;
    return out;
  }
  std::string text = std::move(held_);
  held_.clear();
  text += delta;
  take(text, out);
  return out;
}

void ReasoningStream::take(std::string_view text, ReasoningParts& out) {
  auto give_reasoning = [&](std::string_view part) {
    if (part.empty()) return;
    out.reasoning.append(part);
    reasoning_began_ = true;
  };
  for (;;) {
    switch (state_) {
      case State::kStart: {
        const size_t first = text.find_first_not_of(kSpace);
        const std::string_view rest =
            first == std::string_view::npos ? std::string_view() : text.substr(first);
        if (rest.starts_with(kThinkOpen)) {
          state_ = State::kReasoning;
          text = rest.substr(kThinkOpen.size());
          continue;
        }
        if (kThinkOpen.starts_with(rest)) {  // whitespace, or what may still become "<think>"
          held_ = text;
          return;
        }
        state_ = State::kContent;  // no reasoning block: the text as it is
        continue;
      }
      case State::kReasoning: {
        if (!reasoning_began_) {  // the whitespace before the reasoning is dropped
          const size_t first = text.find_first_not_of(kSpace);
          if (first == std::string_view::npos) return;
          text = text.substr(first);
        }
        if (const size_t close = text.find(kThinkClose); close != std::string_view::npos) {
          give_reasoning(trim_right(text.substr(0, close)));
          state_ = State::kAfterReasoning;
          text = text.substr(close + kThinkClose.size());
          continue;
        }
        // Held: what may still become "</think>", and the whitespace before it (dropped if the
        // block ends there, given out if more reasoning follows).
        size_t keep = partial_marker(text, kThinkClose);
        while (keep < text.size() && is_space(text[text.size() - keep - 1])) ++keep;
        give_reasoning(text.substr(0, text.size() - keep));
        held_ = text.substr(text.size() - keep);
        return;
      }
      case State::kAfterReasoning: {
        const size_t first = text.find_first_not_of(kSpace);
        if (first == std::string_view::npos) return;
        state_ = State::kContent;
        text = text.substr(first);
        continue;
      }
      case State::kContent:
        out.content.append(text);
        return;
    }
  }
}

ReasoningParts ReasoningStream::finish() {
  ReasoningParts out;
  if (state_ == State::kStart) {
    out.content = std::move(held_);  // no block began: the text as it is
  } else if (state_ == State::kReasoning) {
    out.reasoning = trim_right(held_);  // cut off inside the block: a partial "</think>" is text
  }
  held_.clear();
  return out;
}

ReasoningParts split_reasoning(std::string_view text, ReasoningStart start) {
  ReasoningStream stream(start);
  ReasoningParts whole = stream.feed(text);
  ReasoningParts rest = stream.finish();
  whole.reasoning += rest.reasoning;
  whole.content += rest.content;
  return whole;
}

}  // namespace moeline::stages::http
