// Tokenizer properties that the parity test (tests/parity) does not reach: error values for bad
// input, streaming at UTF-8 boundaries, thread safety, and round trips on the generated models'
// tokenizers.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace moeline::tokenizer {
namespace {

std::string model_tokenizer(const char* name) {
  return std::string(MOELINE_TEST_MODELS) + "/" + name + "/tokenizer.json";
}

const std::vector<std::string> kSamples = {
    "Hello world", "  two  spaces\tand\ttabs\n\nnewlines",
    "你好，世界",  "日本語のテキスト",
    "한국어",      "🤷‍♂️👨‍👩‍👧‍👦 emoji",
    "café",        "x = f(1, 2) // code",
    "1234567890",  "",
};

TEST(Tokenizer, ByteLevelRoundTripsEveryValidText) {
  auto tok = Tokenizer::load(model_tokenizer("qwen3-f32"));
  ASSERT_TRUE(tok.ok()) << tok.error().message;
  for (const std::string& s : kSamples) {
    auto ids = tok->encode(s, {.add_special_tokens = false});
    ASSERT_TRUE(ids.ok()) << ids.error().message;
    auto back = tok->decode(*ids);
    ASSERT_TRUE(back.ok());
    // NFC leaves these samples unchanged, so byte-level BPE must give back the exact bytes.
    EXPECT_EQ(*back, s);
    for (int32_t id : *ids) EXPECT_LT(static_cast<std::size_t>(id), tok->vocab_size());
  }
}

// Token by token, a text's bytes come back whole: a token that holds part of a character gives
// that part (decode() of it alone replaces it with U+FFFD), every other token its decode().
TEST(Tokenizer, PartialCharacterBytesJoinBackIntoTheText) {
  auto tok = Tokenizer::load(model_tokenizer("qwen3-f32"));
  ASSERT_TRUE(tok.ok()) << tok.error().message;
  size_t partial = 0;
  for (const std::string& s : kSamples) {
    auto ids = tok->encode(s, {.add_special_tokens = false});
    ASSERT_TRUE(ids.ok());
    std::string joined;
    for (int32_t id : *ids) {
      const auto bytes = tok->partial_character_bytes(id);
      partial += bytes.has_value();
      joined += bytes ? *bytes : *tok->decode({id});
    }
    EXPECT_EQ(joined, s);
  }
  EXPECT_GT(partial, 0u) << "no sample split a character: the check above saw no partial token";
  // Byte fallback: the <0xXX> tokens of a character outside the vocabulary give its bytes.
  auto fallback = Tokenizer::load(model_tokenizer("mixtral-f32"));
  ASSERT_TRUE(fallback.ok()) << fallback.error().message;
  auto ids = fallback->encode("\xF0\x9F\xA4\xB7", {.add_special_tokens = false});
  ASSERT_TRUE(ids.ok());
  std::string bytes;
  for (int32_t id : *ids)
    if (auto part = fallback->partial_character_bytes(id)) bytes += *part;
  EXPECT_EQ(bytes, "\xF0\x9F\xA4\xB7");
  EXPECT_FALSE(fallback->partial_character_bytes(1).has_value()) << "<s> is a whole token";
}

TEST(Tokenizer, ByteFallbackRoundTripsAndAddsBos) {
  auto tok = Tokenizer::load(model_tokenizer("mixtral-f32"));
  ASSERT_TRUE(tok.ok()) << tok.error().message;
  for (const std::string& s : kSamples) {
    auto ids = tok->encode(s);
    ASSERT_TRUE(ids.ok());
    ASSERT_FALSE(ids->empty());
    EXPECT_EQ(ids->front(), 1) << "the post-processor adds <s>";
    auto back = tok->decode(*ids, {.skip_special_tokens = true});
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, s);
  }
}

TEST(Tokenizer, InvalidUtf8IsAnErrorNamingTheOffset) {
  auto tok = Tokenizer::load(model_tokenizer("qwen3-f32"));
  ASSERT_TRUE(tok.ok());
  for (const std::string& bad : {std::string("ok\xff"), std::string("ab\xe4\xbd"),
                                 std::string("\xc0\x80"), std::string("x\xed\xa0\x80")}) {
    auto ids = tok->encode(bad);
    ASSERT_FALSE(ids.ok());
    EXPECT_NE(ids.error().message.find("not valid UTF-8"), std::string::npos);
    EXPECT_NE(ids.error().message.find("offset"), std::string::npos);
  }
}

TEST(Tokenizer, UnknownIdIsAnError) {
  auto tok = Tokenizer::load(model_tokenizer("qwen3-f32"));
  ASSERT_TRUE(tok.ok());
  auto text = tok->decode({1, static_cast<int32_t>(tok->vocab_size()) + 5});
  ASSERT_FALSE(text.ok());
  EXPECT_NE(text.error().message.find("not in the tokenizer's vocabulary"), std::string::npos);
}

TEST(Tokenizer, StreamNeverSplitsACharacterAndJoinsToTheFullDecode) {
  for (const char* model : {"qwen3-f32", "mixtral-f32"}) {
    auto tok = Tokenizer::load(model_tokenizer(model));
    ASSERT_TRUE(tok.ok());
    for (const std::string& s : kSamples) {
      auto ids = tok->encode(s);
      ASSERT_TRUE(ids.ok());
      DecodeStream stream(*tok);
      std::string joined;
      for (int32_t id : *ids) {
        auto piece = stream.step(id);
        ASSERT_TRUE(piece.ok());
        EXPECT_EQ(text::find_invalid_utf8(*piece), std::string::npos);
        EXPECT_EQ(piece->find("\xEF\xBF\xBD"), std::string::npos) << model << ": " << s;
        joined += *piece;
      }
      auto rest = stream.finish();
      ASSERT_TRUE(rest.ok());
      joined += *rest;
      EXPECT_EQ(joined, *tok->decode(*ids)) << model << ": " << s;
    }
  }
}

TEST(Tokenizer, StreamHoldsAnIncompleteCharacterUntilItCompletes) {
  auto tok = Tokenizer::load(model_tokenizer("qwen3-f32"));
  ASSERT_TRUE(tok.ok());
  // One byte-level token per byte of a 4-byte emoji: nothing may come out before the fourth.
  std::vector<int32_t> ids;
  for (unsigned char b : std::string("\xF0\x9F\xA4\xB7")) {
    ids.push_back(*tok->token_to_id(text::byte_level_chars()[b]));
  }
  DecodeStream stream(*tok);
  for (std::size_t i = 0; i + 1 < ids.size(); ++i) EXPECT_EQ(*stream.step(ids[i]), "");
  EXPECT_EQ(*stream.step(ids.back()), "\xF0\x9F\xA4\xB7");
}

TEST(Tokenizer, MalformedFilesAreErrorsThatSayWhere) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "not valid JSON"},
      {"[]", "expected an object"},
      {R"({"model": {"type": "WordPiece", "vocab": {}}})", "unsupported model type \"WordPiece\""},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}})",
       "token \"b\" is not in the vocab"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a"]}})", "exactly one space"},
      {R"({"model": {"type": "BPE", "vocab": {"a": -1}, "merges": []}})", "id out of range"},
      {R"({"model": {"type": "BPE", "vocab": {"a": "x"}, "merges": []}})", "expected an integer"},
      {R"({"model": {"type": "BPE", "merges": []}})", "missing key \"vocab\""},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
           "normalizer": {"type": "Precompiled"}})",
       "unsupported normalizer type \"Precompiled\""},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
           "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(unclosed"},
                             "behavior": "Isolated"}})",
       "does not compile"},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
           "decoder": {"type": "Strip", "content": "ab", "start": 1, "stop": 0}})",
       "exactly one character"},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": [], "dropout": 0.1}})", "dropout"},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": [], "unk_token": "<unk>"}})",
       "unk_token"},
  };
  for (const auto& [json, expected] : cases) {
    auto tok = Tokenizer::from_json(json, "test.json");
    ASSERT_FALSE(tok.ok()) << json;
    EXPECT_NE(tok.error().message.find(expected), std::string::npos)
        << "got: " << tok.error().message;
    EXPECT_EQ(tok.error().message.rfind("test.json", 0), 0u) << tok.error().message;
  }
  EXPECT_FALSE(Tokenizer::load("/nonexistent/tokenizer.json").ok());
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  auto tok = Tokenizer::load(model_tokenizer("qwen3-f32"));
  ASSERT_TRUE(tok.ok());
  std::string text;
  for (int i = 0; i < 200; ++i) text += kSamples[i % kSamples.size()] + " ";
  const auto expected = *tok->encode(text);
  std::vector<std::thread> threads;
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      bool all = true;
      for (int k = 0; k < 20; ++k) all = all && *tok->encode(text) == expected;
      ok[t] = all;
    });
  }
  for (auto& th : threads) th.join();
  for (int v : ok) EXPECT_TRUE(v);
}

TEST(ChatTemplate, JinjaTemplatesRenderAndUnsupportedConstructsAreNamed) {
  auto chat = ChatTemplate::from_template(
      "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}"
      "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}",
      "<s>", "</s>");
  ASSERT_TRUE(chat.ok()) << chat.error().message;
  EXPECT_EQ(chat->format(), ChatTemplate::Format::kJinja);
  EXPECT_EQ(*chat->render({{"system", " s "}, {"user", "hi"}}), "<s><system>s<user>hi<assistant>");
  EXPECT_EQ(
      *chat->render({{"user", "hi"}}, {.add_generation_prompt = false, .enable_thinking = false}),
      "<s><user>hi/no_think");
  // A request's other template variables (chat_template_kwargs) reach the template; the ones the
  // renderer sets itself are not replaced by them.
  auto thinking = ChatTemplate::from_template(
      "{% if thinking %}<think>{% endif %}{{ effort | default('none') }}{{ bos_token }}"
      "{{ messages | length }}",
      "<s>", "");
  ASSERT_TRUE(thinking.ok());
  EXPECT_EQ(*thinking->render({{"user", "hi"}},
                              {.template_kwargs_json = R"({"thinking": true, "effort": "high"})"}),
            "<think>high<s>1");
  EXPECT_EQ(*thinking->render({{"user", "hi"}}), "none<s>1");
  EXPECT_EQ(*thinking->render({{"user", "hi"}},
                              {.template_kwargs_json = R"({"bos_token": "X", "messages": []})"}),
            "none<s>1");
  EXPECT_FALSE(thinking->render({{"user", "hi"}}, {.template_kwargs_json = "[1]"}).ok());
  auto unsupported = ChatTemplate::from_template("{% extends 'base.html' %}", "", "");
  ASSERT_FALSE(unsupported.ok());
  EXPECT_NE(unsupported.error().message.find("extends"), std::string::npos)
      << unsupported.error().message;
  auto raising = ChatTemplate::from_template(
      "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}", "", "");
  ASSERT_TRUE(raising.ok());
  auto refused = raising->render({{"assistant", "x"}});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.error().message.find("user first"), std::string::npos);
}

TEST(ChatTemplate, BuiltInFormatsAreTheFallbackAndRefuseUnknownRoles) {
  auto mistral = ChatTemplate::builtin(ChatTemplate::Format::kMistral, "<s>", "</s>");
  EXPECT_FALSE(mistral.render({{"tool", "x"}}).ok());
  EXPECT_FALSE(mistral.render({}).ok());
  EXPECT_EQ(*mistral.render({{"user", "hi"}, {"assistant", "yo"}}), "<s>[INST] hi [/INST]yo</s>");
  // A system message goes before the first user turn's text, inside its [INST].
  EXPECT_EQ(
      *mistral.render({{"system", "sys"}, {"user", "hi"}, {"assistant", "yo"}, {"user", "ok"}}),
      "<s>[INST] sys\n\nhi [/INST]yo</s>[INST] ok [/INST]");
  // Tools need the model's own template: the built-in formats do not write them.
  auto qwen3 = ChatTemplate::builtin(ChatTemplate::Format::kQwen3, "", "<|im_end|>");
  const auto with_tools = qwen3.render({{"user", "hi"}}, {.tools_json = "[]"});
  ASSERT_FALSE(with_tools.ok());
  EXPECT_NE(with_tools.error().message.find("tools"), std::string::npos);
  ChatMessage called{"assistant", ""};
  called.tool_calls = {{"call_1", "f", "{}"}};
  EXPECT_FALSE(qwen3.render({{"user", "hi"}, called}).ok());
  EXPECT_EQ(qwen3.tool_call_format(), ToolCallFormat::kNone);
}

// continue_final_message (vLLM's and transformers'): the chat rendered without the generation
// prompt and cut after the final message's content, in every format; an empty final message, or
// one the template does not write as it is (trimmed here), is an error, not a prompt that ends
// after the turn.
TEST(ChatTemplate, ContinuingTheFinalMessageEndsThePromptInsideIt) {
  const ChatOptions continued{.add_generation_prompt = false, .continue_final_message = true};
  const std::vector<ChatMessage> begun = {{"user", "hi"}, {"assistant", "Well, "}};
  auto chatml = ChatTemplate::builtin(ChatTemplate::Format::kChatML, "", "<|im_end|>");
  EXPECT_EQ(*chatml.render(begun, continued),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nWell, ");
  auto qwen3 = ChatTemplate::builtin(ChatTemplate::Format::kQwen3, "", "<|im_end|>");
  EXPECT_EQ(*qwen3.render(begun, continued),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nWell, ");
  auto mistral = ChatTemplate::builtin(ChatTemplate::Format::kMistral, "<s>", "</s>");
  EXPECT_EQ(*mistral.render(begun, continued), "<s>[INST] hi [/INST]Well, ");
  auto jinja = ChatTemplate::from_template(
      "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}",
      "", "");
  ASSERT_TRUE(jinja.ok());
  // The template trims "Well, ": the trimmed content is found instead.
  EXPECT_EQ(*jinja->render(begun, continued), "<user>hi</user><assistant>Well,");
  // The content's last occurrence: an earlier turn with the same words is not where it ends.
  EXPECT_EQ(*jinja->render({{"user", "ok"}, {"assistant", "ok"}}, continued),
            "<user>ok</user><assistant>ok");
  const auto empty = chatml.render({{"user", "hi"}, {"assistant", " "}}, continued);
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.error().message.find("continue_final_message"), std::string::npos);
  auto dropping = ChatTemplate::from_template(
      "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}", "",
      "");
  ASSERT_TRUE(dropping.ok());
  EXPECT_FALSE(dropping->render(begun, continued).ok());
}

// A Jinja template gets the tools, the calls (their arguments as objects where they are JSON,
// as vLLM passes them) and the tool turns' ids; a template that writes <tool_call> blocks says so.
TEST(ChatTemplate, ToolsAndCallsReachAJinjaTemplate) {
  auto chat = ChatTemplate::from_template(
      "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
      "{% for m in messages %}{{ m.role }}:{{ m.content }}"
      "{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} {{ c.function.arguments.city }}"
      " {{ c.id }}</tool_call>{% endfor %}"
      "{% if m.tool_call_id is defined %}({{ m.tool_call_id }}){% endif %};{% endfor %}",
      "", "");
  ASSERT_TRUE(chat.ok()) << chat.error().message;
  EXPECT_EQ(chat->tool_call_format(), ToolCallFormat::kHermes);
  ChatMessage called{"assistant", ""};
  called.tool_calls = {{"call_1", "get_weather", R"({"city": "Paris"})"}};
  ChatMessage answer{"tool", "sunny"};
  answer.tool_call_id = "call_1";
  auto text = chat->render(
      {{"user", "hi"}, called, answer},
      {.tools_json = R"([{"type": "function", "function": {"name": "get_weather"}}])"});
  ASSERT_TRUE(text.ok()) << text.error().message;
  EXPECT_EQ(*text,
            "[get_weather]user:hi;assistant:<tool_call>get_weather Paris call_1</tool_call>;"
            "tool:sunny(call_1);");
  EXPECT_EQ(ChatTemplate::from_template("{{ messages[0].content }}", "", "")->tool_call_format(),
            ToolCallFormat::kNone);
  // GLM-4.5's template writes each argument as <arg_key>/<arg_value> inside the block.
  EXPECT_EQ(ChatTemplate::from_template(
                "{% for c in messages[0].tool_calls %}<tool_call>{{ c.function.name }}"
                "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>"
                "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>{% endfor %}",
                "", "")
                ->tool_call_format(),
            ToolCallFormat::kGlm45);
}

// DeepSeek's templates write its <｜tool▁calls▁begin｜> markers and add the arguments to strings
// with '+' (the text, as the OpenAI message gives it); Mistral's write [TOOL_CALLS].
TEST(ChatTemplate, DeepSeekAndMistralTemplatesSayTheirFormat) {
  auto deepseek = ChatTemplate::from_template(
      "{% for m in messages %}{% for c in m.tool_calls %}"
      "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + c.type + '<｜tool▁sep｜>' + "
      "c.function.name + '\\n```json\\n' + c.function.arguments + '\\n```<｜tool▁call▁end｜>' }}"
      "{% endfor %}{% endfor %}",
      "", "");
  ASSERT_TRUE(deepseek.ok()) << deepseek.error().message;
  EXPECT_EQ(deepseek->tool_call_format(), ToolCallFormat::kDeepSeek);
  ChatMessage called{"assistant", ""};
  called.tool_calls = {{"call_1", "get_weather", R"({"city": "Paris"})"}};
  auto text = deepseek->render({called});
  ASSERT_TRUE(text.ok()) << text.error().message;
  EXPECT_EQ(
      *text,
      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>");
  EXPECT_EQ(
      ChatTemplate::from_template(
          "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS] {{ m.tool_calls | tojson }}"
          "{% endif %}{% endfor %}",
          "", "")
          ->tool_call_format(),
      ToolCallFormat::kMistral);
}

// Newer releases (GLM-4.5's) keep the template in chat_template.jinja beside tokenizer_config.json;
// transformers reads it first, over any chat_template in the JSON, and so does moeline.
TEST(ChatTemplate, AChatTemplateJinjaBesideTheConfigWins) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("moeline-chat-jinja-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto write = [&](const char* name, const std::string& text) {
    std::ofstream(dir / name) << text;
  };
  const std::string config = (dir / "tokenizer_config.json").string();
  write("config.json", R"({"model_type": "glm4_moe"})");
  write("tokenizer_config.json", R"({"eos_token": "<|endoftext|>"})");
  // No template anywhere, and no built-in format for the family: a clear error.
  auto none = ChatTemplate::load(config);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("chat_template"), std::string::npos);
  write("chat_template.jinja",
        "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}{{ eos_token }}");
  auto from_file = ChatTemplate::load(config);
  ASSERT_TRUE(from_file.ok()) << from_file.error().message;
  EXPECT_EQ(*from_file->render({{"user", "hi"}}),
            "[gMASK]<sop><|user|>hi<|assistant|><|endoftext|>");
  write("tokenizer_config.json", R"({"chat_template": "{{ 'from the JSON' }}"})");
  EXPECT_EQ(*ChatTemplate::load(config)->render({{"user", "hi"}}),
            "[gMASK]<sop><|user|>hi<|assistant|>");
  write("chat_template.jinja", "{% extends 'base.html' %}");
  auto broken = ChatTemplate::load(config);
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.error().message.find("chat_template.jinja"), std::string::npos)
      << broken.error().message;
  fs::remove_all(dir);
}

// A list of named templates (Mixtral 8x22B's tokenizer_config.json): "default" renders a chat,
// and "tool_use", where there is one, a chat that offers tools, as transformers chooses; the
// calls are read back in the format the "tool_use" template writes.
TEST(ChatTemplate, AChatWithToolsIsRenderedWithTheToolUseTemplate) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("moeline-chat-tool-use-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string config = (dir / "tokenizer_config.json").string();
  std::ofstream(config) << R"({"bos_token": "<s>", "chat_template": [
      {"name": "default", "template": "{% for m in messages %}[INST]{{ m.content }}{% endfor %}"},
      {"name": "tool_use", "template": "[AVAILABLE_TOOLS]{{ tools | length }}[/AVAILABLE_TOOLS]{% for m in messages %}[INST]{{ m.content }}{% if m.tool_calls %}[TOOL_CALLS]{% endif %}{% endfor %}"}]})";
  auto chat = ChatTemplate::load(config);
  ASSERT_TRUE(chat.ok()) << chat.error().message;
  EXPECT_EQ(chat->tool_call_format(), ToolCallFormat::kMistral);
  EXPECT_EQ(*chat->render({{"user", "hi"}}), "[INST]hi");
  EXPECT_EQ(*chat->render({{"user", "hi"}}, {.tools_json = R"([{"type": "function"}])"}),
            "[AVAILABLE_TOOLS]1[/AVAILABLE_TOOLS][INST]hi");
  std::ofstream(config) << R"({"chat_template": [{"name": "default", "template": "x"},
      {"name": "tool_use", "template": "{% if %}"}]})";
  auto broken = ChatTemplate::load(config);
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.error().message.find("tool_use"), std::string::npos) << broken.error().message;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moeline::tokenizer

namespace moeline::tokenizer {
namespace {

// Seeded random inputs: arbitrary bytes into encode, arbitrary ids into decode and the stream,
// and corrupted tokenizer files into the loader. None may crash; every failure is an Error.
TEST(TokenizerRobustness, RandomBytesIdsAndCorruptFilesNeverCrash) {
  std::mt19937_64 rng(1234);
  for (const char* name : {"qwen3-f32", "mixtral-f32"}) {
    auto tok = Tokenizer::load(model_tokenizer(name));
    ASSERT_TRUE(tok.ok());
    for (int i = 0; i < 2000; ++i) {
      std::string bytes(rng() % 64, '\0');
      for (char& c : bytes) c = static_cast<char>(rng() % 256);
      auto ids = tok->encode(bytes);
      const bool valid = text::find_invalid_utf8(bytes) == std::string::npos;
      ASSERT_EQ(ids.ok(), valid) << "encode must fail exactly on invalid UTF-8";
      if (valid) {
        auto back = tok->decode(*ids, {.skip_special_tokens = true});
        ASSERT_TRUE(back.ok());
      }
      std::vector<int32_t> random_ids(rng() % 16);
      for (int32_t& id : random_ids) id = static_cast<int32_t>(rng() % (tok->vocab_size() + 8));
      auto text = tok->decode(random_ids);
      bool all_known = true;
      for (int32_t id : random_ids) all_known = all_known && tok->id_to_token(id).has_value();
      ASSERT_EQ(text.ok(), all_known);
      if (all_known) {
        DecodeStream stream(*tok);
        std::string joined;
        for (int32_t id : random_ids) joined += *stream.step(id);
        joined += *stream.finish();
        ASSERT_EQ(joined, *text);
      }
    }
  }
  std::ifstream in(model_tokenizer("qwen3-f32"));
  const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  int loaded = 0;
  for (int i = 0; i < 300; ++i) {
    std::string bad = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !bad.empty(); ++e) {
      const std::size_t at = rng() % bad.size();
      switch (rng() % 3) {
        case 0:
          bad[at] = static_cast<char>(rng() % 256);
          break;
        case 1:
          bad.erase(at, 1 + rng() % 32);
          break;
        default:
          bad.resize(at);
          break;
      }
    }
    auto tok = Tokenizer::from_json(bad, "corrupt.json");
    if (tok.ok()) {
      ++loaded;  // a corruption that still parses (inside a token's text, say) must still encode
      EXPECT_TRUE(tok->encode("Hello world \xE4\xBD\xA0\xE5\xA5\xBD").ok());
    } else {
      EXPECT_EQ(tok.error().message.rfind("corrupt.json", 0), 0u) << tok.error().message;
    }
  }
  std::cout << "corrupt files that still loaded: " << loaded << " of 300\n";
}

}  // namespace
}  // namespace moeline::tokenizer
