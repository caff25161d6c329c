#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include "tokenizer/unicode.h"

namespace moeline::tokenizer::text {

struct Regex::Code {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Code() { pcre2_code_free(code); }
};

namespace {

std::string pcre2_message(int error) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(error, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread match state: one pair of offsets is all the iteration needs, and a JIT stack large
// enough that long runs of spaces or letters never exhaust it.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

}  // namespace

Regex::Regex(std::string_view pattern) : pattern_(pattern), code_(std::make_shared<Code>()) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code_->code == nullptr) {
    throw StatusError("regular expression " + std::string(pattern) +
                      " does not compile at offset " + std::to_string(offset) + ": " +
                      pcre2_message(error));
  }
  code_->jit = pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE) == 0;
}

void Regex::find_all(std::string_view text, std::vector<MatchSpan>& out) const {
  MatchState& state = match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  std::size_t search_from = 0;
  std::size_t last_match_end = std::string_view::npos;
  while (search_from <= text.size()) {
    const int rc = code_->jit ? pcre2_jit_match(code_->code, subject, text.size(), search_from, 0,
                                                state.data, state.context)
                              : pcre2_match(code_->code, subject, text.size(), search_from,
                                            PCRE2_NO_UTF_CHECK, state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) {
      throw StatusError("regular expression " + pattern_ + " failed: " + pcre2_message(rc));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const std::size_t begin = ovector[0], end = ovector[1];
    if (begin == end && end == last_match_end) {
      // An empty match where the previous one ended: move on one character and look again.
      if (search_from >= text.size()) return;
      search_from += sequence_length(static_cast<unsigned char>(text[search_from]));
      continue;
    }
    out.push_back({begin, end});
    last_match_end = end;
    if (begin == end) {
      if (end >= text.size()) return;
      search_from = end + sequence_length(static_cast<unsigned char>(text[end]));
    } else {
      search_from = end;
    }
  }
}

bool Regex::search(std::string_view text) const {
  MatchState& state = match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const int rc = code_->jit ? pcre2_jit_match(code_->code, subject, text.size(), 0, 0, state.data,
                                              state.context)
                            : pcre2_match(code_->code, subject, text.size(), 0, PCRE2_NO_UTF_CHECK,
                                          state.data, state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) throw StatusError("regular expression " + pattern_ + " failed: " + pcre2_message(rc));
  return true;
}

}  // namespace moeline::tokenizer::text
