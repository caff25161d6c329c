#pragma once
// A model's text side, whichever form the model comes in: tokenizer.json and tokenizer_config.json
// in a Hugging Face checkpoint folder, or the tokenizer.* metadata of a GGUF file.
//
// A GGUF's vocabulary becomes the tokenizer.json it stands for (gguf_tokenizer_json):
//   gpt2   byte-level BPE: the vocabulary and merges as stored, control and user-defined tokens as
//          added tokens, the pre-tokenizer of the family tokenizer.ggml.pre names (qwen2,
//          deepseek-v3, deepseek-llm, llama-bpe, gpt-2), a BOS post-processor when
//          add_bos_token says so;
//   llama  SentencePiece-style BPE with byte fallback: merges rebuilt from the piece scores as
//          transformers' SentencePieceExtractor builds them (every split of a piece into two
//          pieces, by the merged piece's score), so the ids are SentencePiece's.
// Errors name the file and the key.

#include <filesystem>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moeline::model {

using tokenizer::ChatTemplate;
using tokenizer::Tokenizer;

class GgufFile;

// Whether `model` names a GGUF file rather than a checkpoint folder.
bool is_gguf_model(const std::filesystem::path& model);

Expected<Tokenizer> load_model_tokenizer(const std::filesystem::path& model);
// The model's chat template (a GGUF's tokenizer.chat_template, else its family's built-in format).
Expected<ChatTemplate> load_model_chat_template(const std::filesystem::path& model);

// The tokenizer.json document of a GGUF's tokenizer metadata; throws StatusError.
nlohmann::json gguf_tokenizer_json(const GgufFile& gguf);

}  // namespace moeline::model
