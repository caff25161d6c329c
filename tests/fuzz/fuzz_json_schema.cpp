// A JSON Schema from a request (response_format, a forced call's tools) and bytes run through its
// grammar: any schema compiles or is an Error, any byte is taken or refused, without a crash, an
// endless loop or a deep recursion. The input: a flags byte (bit 0: the document between tags, as
// a forced tool call), then frames (fuzz.h): the schema's text, then pieces of a document.
#include "fuzz.h"
#include "model/json_grammar.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool tags = (data[0] & 1) != 0;
  const auto parts = moeline::fuzz::frames(data + 1, size - 1);
  if (parts.empty()) return 0;
  auto grammar =
      moeline::model::JsonGrammar::compile(parts[0], tags ? "<t>" : "", tags ? "</t>" : "");
  if (!grammar) return 0;
  moeline::model::JsonMatcher matcher(*grammar);
  for (size_t i = 1; i < parts.size(); ++i) {
    // A piece whole (taken only if every byte is), then byte by byte.
    moeline::model::JsonMatcher whole = matcher;
    (void)whole.advance(parts[i]);
    for (char c : parts[i]) (void)matcher.advance(std::string_view(&c, 1));
    (void)matcher.can_end();
    (void)matcher.plain_string_room();
  }
  return 0;
}
