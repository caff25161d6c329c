#pragma once
// Builders from tokenizer.json fragments. `where` is the dotted path used in error messages.

#include <memory>
#include <string>

#include "tokenizer/components.h"
#include "tokenizer/json_util.h"

namespace moeline::tokenizer::tok {

std::unique_ptr<Normalizer> make_normalizer(json::element e, const std::string& where);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(json::element e, const std::string& where);
std::unique_ptr<Decoder> make_decoder(json::element e, const std::string& where);
std::unique_ptr<PostProcessor> make_post_processor(json::element e, const std::string& where);

}  // namespace moeline::tokenizer::tok
