#pragma once
// A chat answer's reasoning read out of its text, as vLLM's, SGLang's and llama.cpp's reasoning
// parsers read it for the models that think in <think> blocks (Qwen3, DeepSeek-R1, GLM-4.5):
//
//   <think>
//   The user wants ... so the answer is 42.
//   </think>
//
//   The answer is 42.
//
// becomes the message's `reasoning_content` ("The user wants ... so the answer is 42.") and its
// `content` ("The answer is 42."). Only a block at the very start of the answer (after
// whitespace) is reasoning: a <think> later in the text is the model's content. Where the
// prompt already opened the block (DeepSeek-R1's and Qwen3's thinking releases end the
// generation prompt with "<think>\n"), the answer starts inside it and only "</think>" closes
// it; an answer cut off before "</think>" is all reasoning. The reasoning's surrounding
// whitespace and the whitespace between "</think>" and the content are dropped, as the models'
// own cards strip them.

#include <string>
#include <string_view>

namespace moeline::stages::http {

inline constexpr std::string_view kThinkOpen = "<think>";
inline constexpr std::string_view kThinkClose = "</think>";

// Where a chat answer's reasoning can be.
enum class ReasoningStart {
  kOff,      // not read out: the answer is all content
  kAtStart,  // the answer may open a <think> block at its start
  kOpen,     // the prompt opened the block: the answer begins inside it
};

// Whether a rendered prompt leaves a <think> block open for the answer: it ends with "<think>"
// and whitespace.
bool prompt_opens_reasoning(std::string_view prompt);
// Whether it closed the block itself (Qwen3's enable_thinking=false writes an empty one): it ends
// with "</think>" and whitespace, and the answer does not think.
bool prompt_closes_reasoning(std::string_view prompt);

struct ReasoningParts {
  std::string reasoning;
  std::string content;
};

// A streamed answer split as it comes: feed() gives what is certain of each delta, holding back
// what could still be part of a marker (or whitespace that would be dropped); finish() gives
// the rest at the end. The whole text fed at once and finished gives split_reasoning's answer,
// and so does every split of it into deltas.
class ReasoningStream {
 public:
  explicit ReasoningStream(ReasoningStart start);
  ReasoningParts feed(std::string_view delta);
  ReasoningParts finish();

 private:
  enum class State { kStart, kReasoning, kAfterReasoning, kContent };
  void take(std::string_view text, ReasoningParts& out);

  State state_;
  bool reasoning_began_ = false;  // a non-space character of the reasoning was given out
  std::string held_;
};

// The whole answer split (ReasoningStart::kOff: all content).
ReasoningParts split_reasoning(std::string_view text, ReasoningStart start);

}  // namespace moeline::stages::http
