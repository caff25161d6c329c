// tokenizer.json: any JSON a model folder may carry. What loads must encode and decode.
#include "fuzz.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tokenizer = moeline::tokenizer::Tokenizer::from_json(
      std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!tokenizer) return 0;
  auto ids = tokenizer->encode("Hello world, 12345 héllo\n\ttabs", {});
  if (ids) (void)tokenizer->decode(*ids, {});
  return 0;
}
