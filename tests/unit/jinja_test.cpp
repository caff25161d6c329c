// The Jinja engine (tokenizer/jinja) alone: each construct, each error value and each limit. Parity
// with Python's jinja2 over real chat templates is tests/parity/test_jinja_parity.py.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "tokenizer/jinja/template.h"

namespace moeline::tokenizer::jinja {
namespace {

using Json = nlohmann::ordered_json;

std::string render(const std::string& source, const Json& context = Json::object(),
                   const RenderOptions& options = {}) {
  auto t = Template::parse(source);
  if (!t.ok()) return "PARSE ERROR: " + t.error().message;
  auto out = t->render(context, options);
  if (!out.ok()) return "ERROR: " + out.error().message;
  return *out;
}

std::string error_of(const std::string& source, const Json& context = Json::object(),
                     const RenderOptions& options = {}) {
  auto t = Template::parse(source);
  if (!t.ok()) return t.error().message;
  auto out = t->render(context, options);
  return out.ok() ? "no error, rendered: " + *out : out.error().message;
}

const Json kChat = Json::parse(R"({
  "messages": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Hi ünï"},
               {"role": "assistant", "content": "Hello"}],
  "add_generation_prompt": true, "bos_token": "<s>", "xs": [3, 1, 2],
  "d": {"b": 2, "a": 1}})");

TEST(JinjaText, TextOutputAndComments) {
  EXPECT_EQ(render("plain"), "plain");
  EXPECT_EQ(render("a\n"), "a");  // jinja2 drops one trailing newline
  EXPECT_EQ(render("a\r\nb"), "a\nb");
  EXPECT_EQ(render("{{ bos_token }}x{# gone #}y", kChat), "<s>xy");
  EXPECT_EQ(render("{{ missing }}|"), "|");
}

TEST(JinjaText, WhitespaceControl) {
  EXPECT_EQ(render("a  {{- 1 -}}  b"), "a1b");
  EXPECT_EQ(render("a\n  {% if true %}\nx\n  {% endif %}\nb"), "a\nx\nb");  // trim + lstrip
  EXPECT_EQ(render("a\n  {%+ if true %}x{% endif %}"), "a\n  x");
  EXPECT_EQ(render("{% if true +%}\nx{% endif %}"), "\nx");
  EXPECT_EQ(render("a {%- if true -%} \n b {%- endif %}"), "ab");
  EXPECT_EQ(render("  {{ 1 }}\n"), "  1");  // lstrip_blocks leaves {{ }} alone
}

TEST(JinjaText, RawBlocks) {
  EXPECT_EQ(render("{% raw %}{{ x }}{% y %}{% endraw %}"), "{{ x }}{% y %}");
}

TEST(JinjaControl, IfElifElse) {
  const std::string t = "{% if n == 0 %}zero{% elif n < 0 %}neg{% else %}pos{% endif %}";
  EXPECT_EQ(render(t, {{"n", 0}}), "zero");
  EXPECT_EQ(render(t, {{"n", -3}}), "neg");
  EXPECT_EQ(render(t, {{"n", 4}}), "pos");
}

TEST(JinjaControl, ForLoopVariables) {
  EXPECT_EQ(render("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
                   "{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }},"
                   "{% endfor %}",
                   kChat),
            "1032TrueFalse3,2121FalseFalse3,3210FalseTrue3,");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.previtem }}>{{ loop.nextitem }} {% endfor %}", kChat),
            ">1 3>2 1> ");
  EXPECT_EQ(render("{% for x in xs %}{{ loop.cycle('a', 'b') }}{% endfor %}", kChat), "aba");
}

TEST(JinjaControl, ForElseFilterUnpackBreakContinue) {
  EXPECT_EQ(render("{% for x in [] %}x{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}"
                   "{{ m.role }} {% endfor %}",
                   kChat),
            "1/2user 2/2assistant ");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", kChat), "b=2;a=1;");
  EXPECT_EQ(render("{% for x in range(10) %}{% if x == 1 %}{% continue %}{% endif %}"
                   "{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}"),
            "023");
}

TEST(JinjaControl, SetScopingAndNamespace) {
  // A set inside a loop does not leak; that is what namespace() is for.
  EXPECT_EQ(render("{% set x = 0 %}{% for i in [1, 2] %}{% set x = i %}{% endfor %}{{ x }}"), "0");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in [1, 2] %}{% set ns.n = ns.n + i %}"
                   "{% endfor %}{{ ns.n }}"),
            "3");
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ b }}{{ a }}"), "21");
  EXPECT_EQ(render("{% set body %}hi {{ 1 }}{% endset %}[{{ body }}]"), "[hi 1]");
  EXPECT_EQ(render("{% set up | upper %}x{% endset %}{{ up }}"), "X");
}

TEST(JinjaControl, MacrosAndCaller) {
  EXPECT_EQ(render("{% macro m(a, b='B') %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(1, b=2) }}"),
            "1B12");
  EXPECT_EQ(render("{% macro w() %}<{{ caller() }}>{% endmacro %}{% call w() %}in{% endcall %}"),
            "<in>");
  EXPECT_EQ(render("{% generation %}kept{% endgeneration %}"), "kept");
}

TEST(JinjaExpressions, LiteralsAndPythonStr) {
  EXPECT_EQ(
      render("{{ 'a\\tb\\u00e9' }}|{{ 1_000 }}|{{ 1.5e3 }}|{{ 2e-7 }}|{{ 1e16 }}|{{ 0.1 + 0.2 }}"),
      "a\tbé|1000|1500.0|2e-07|1e+16|0.30000000000000004");
  EXPECT_EQ(render("{{ true }} {{ None }} {{ [1, 'a', none] }} {{ (1,) }} {{ {'k': \"it's\"} }}"),
            "True None [1, 'a', None] (1,) {'k': \"it's\"}");
}

TEST(JinjaExpressions, ArithmeticAsPython) {
  EXPECT_EQ(
      render("{{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 6 / 3 }} {{ 2 ** 10 }} {{ -2 ** 2 }}"),
      "-4 2 3.5 2.0 1024 4");
  EXPECT_EQ(render("{{ 'ab' * 2 }} {{ [1] + [2] }} {{ 'a' ~ 1 ~ none }} {{ true + 1 }}"),
            "abab [1, 2] a1None 2");
}

TEST(JinjaExpressions, ComparisonsLogicConditional) {
  EXPECT_EQ(render("{{ 1 < 2 < 3 }} {{ 'a' in 'cat' }} {{ 2 not in [1] }} {{ 1 == 1.0 }}"),
            "True True True True");
  EXPECT_EQ(render("{{ 0 or 'x' }} {{ 1 and 'y' }} {{ not [] }} [{{ 'a' if false }}]"),
            "x y True []");
}

TEST(JinjaExpressions, AccessAndSlicing) {
  EXPECT_EQ(
      render("{{ messages[1].content }} {{ messages[-1]['role'] }} {{ d.get('z', 0) }}", kChat),
      "Hi ünï assistant 0");
  EXPECT_EQ(render("{{ xs[::-1] }} {{ xs[1:] }} {{ 'héllo'[1:3] }} {{ 'abc'[::-1] }}", kChat),
            "[2, 1, 3] [1, 2] él cba");
}

TEST(JinjaBuiltins, StringMethods) {
  EXPECT_EQ(
      render("{{ ' x '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ 'a,b,c'.split(',', 1) }}|"
             "{{ 'a b'.split() }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|"
             "{{ 'aXa'.replace('a', 'b') }}|{{ 'hi there'.title() }}|{{ 'abc'.find('c') }}"),
      "x|a|['a', 'b,c']|['a', 'b']|True|True|bXb|Hi There|2");
}

TEST(JinjaBuiltins, Filters) {
  EXPECT_EQ(render("{{ d | tojson }} {{ d | tojson(indent=1) }}", kChat),
            "{\"b\": 2, \"a\": 1} {\n \"b\": 2,\n \"a\": 1\n}");
  EXPECT_EQ(render("{{ xs | sort | join(',') }} {{ xs | max }} {{ xs | sum }} {{ xs | length }} "
                   "{{ d | dictsort }} {{ 'x' | default('y') }} {{ u | d('y') }}",
                   kChat),
            "1,2,3 3 6 3 [('a', 1), ('b', 2)] x y");
  EXPECT_EQ(render("{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') "
                   "| first }} {{ messages | rejectattr('role', 'in', ['user']) | list | length }}",
                   kChat),
            "Hi ünï 2");
  EXPECT_EQ(
      render("{{ ' a ' | trim }} {{ 'a\\nb' | indent(2) }} {{ 2.5 | round }} {{ '7' | int }}"),
      "a a\n  b 2.0 7");
}

TEST(JinjaBuiltins, Tests) {
  EXPECT_EQ(render("{{ x is defined }} {{ y is undefined }} {{ x is string }} {{ 3 is odd }} "
                   "{{ 4 is divisibleby 2 }} {{ none is none }} {{ {} is mapping }} "
                   "{{ 1 is integer }} {{ 1.0 is float }} {{ true is boolean }} {{ 2 is eq 2 }}",
                   {{"x", "s"}}),
            "True True True True True True True True True True True");
}

TEST(JinjaBuiltins, Globals) {
  EXPECT_EQ(render("{{ range(3) | list }} {{ dict(a=1) }}"), "[0, 1, 2] {'a': 1}");
  RenderOptions fixed;
  fixed.now = std::chrono::system_clock::from_time_t(86400 * 365);
  EXPECT_EQ(render("{{ strftime_now('%Y') }}", Json::object(), fixed).size(), 4u);
}

TEST(JinjaErrors, RaiseExceptionCarriesTheMessage) {
  std::string e = error_of("line one\n{{ raise_exception('Roles must alternate!') }}");
  EXPECT_NE(e.find("Roles must alternate!"), std::string::npos) << e;
  EXPECT_NE(e.find("raise_exception"), std::string::npos) << e;
  EXPECT_NE(e.find("line 2"), std::string::npos) << e;
}

TEST(JinjaErrors, UnsupportedConstructsAreNamedWithTheirLine) {
  EXPECT_EQ(error_of("a\n\n{{ x | xmlattr }}"), "unsupported filter 'xmlattr' at line 3");
  EXPECT_EQ(error_of("{{ x is startingwith 'a' }}"), "unsupported test 'startingwith' at line 1");
  EXPECT_EQ(error_of("\n{% include 'other.j2' %}"), "unsupported tag 'include' at line 2");
  EXPECT_EQ(error_of("{% for x in xs recursive %}{% endfor %}"),
            "unsupported: recursive for loops at line 1");
  EXPECT_NE(error_of("{{ '%s' % 1 }}").find("printf-style"), std::string::npos);
}

TEST(JinjaErrors, SyntaxErrors) {
  EXPECT_NE(error_of("{% if x %}").find("unexpected end of template"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 + }}").find("line 1"), std::string::npos);
  EXPECT_NE(error_of("{{ 'open }}").find("unterminated string"), std::string::npos);
  EXPECT_NE(error_of("{# never closed").find("comment"), std::string::npos);
  EXPECT_NE(error_of("{% macro m(a=1, b) %}{% endmacro %}").find("non-default"), std::string::npos);
}

TEST(JinjaErrors, RuntimeErrorsAsJinja2) {
  EXPECT_EQ(error_of("{{ nope.attr }}"), "'nope' is undefined at line 1");
  EXPECT_NE(error_of("{{ 'a' + 1 }}").find("unsupported operand"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 / 0 }}").find("division by zero"), std::string::npos);
  EXPECT_NE(error_of("{{ [1].append(2) }}").find("unsafe"), std::string::npos);
  EXPECT_NE(error_of("{{ u | tojson }}").find("not JSON serializable"), std::string::npos);
  EXPECT_NE(error_of("{% for a, b in [1] %}{% endfor %}").find("unpack"), std::string::npos);
  EXPECT_NE(error_of("{{ 9223372036854775807 + 1 }}").find("overflow"), std::string::npos);
  EXPECT_EQ(error_of("x", Json::array()), "the template context must be a JSON object");
}

TEST(JinjaLimits, OutputSize) {
  RenderOptions small;
  small.max_output_bytes = 100;
  EXPECT_NE(error_of("{% for i in range(1000) %}xx{% endfor %}", Json::object(), small)
                .find("output size limit"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 1000 }}", Json::object(), small).find("output size limit"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 10000000000000 }}").find("output size limit"), std::string::npos);
}

TEST(JinjaLimits, LoopIterations) {
  RenderOptions few;
  few.max_loop_iterations = 50;
  EXPECT_NE(error_of("{% for i in range(40) %}{% for j in range(40) %}{% endfor %}{% endfor %}",
                     Json::object(), few)
                .find("loop iteration limit"),
            std::string::npos);
  // The sandbox's own bound on range().
  EXPECT_NE(error_of("{{ range(1000000) | length }}").find("MAX_RANGE"), std::string::npos);
}

TEST(JinjaLimits, RecursionDepth) {
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
                .find("macro call depth limit"),
            std::string::npos);
  std::string deep = std::string(100000, '(') + "1" + std::string(100000, ')');
  EXPECT_NE(error_of("{{ " + deep + " }}").find("nesting too deep"), std::string::npos);
  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if true %}";
  EXPECT_NE(error_of(blocks).find("nesting too deep"), std::string::npos);
}

TEST(JinjaLimits, ContextDepth) {
  Json deep = Json::array();
  for (int i = 0; i < 1000; ++i) deep = Json::array({deep});
  EXPECT_NE(error_of("{{ x }}", {{"x", deep}}).find("nested too deeply"), std::string::npos);
}

TEST(JinjaTemplate, RendersFromManyThreads) {
  auto t = Template::parse("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}");
  ASSERT_TRUE(t.ok());
  std::vector<std::thread> threads;
  std::vector<std::string> out(8);
  for (size_t i = 0; i < out.size(); ++i)
    threads.emplace_back([&, i] { out[i] = t->render(kChat).value(); });
  for (auto& th : threads) th.join();
  for (const auto& o : out) EXPECT_EQ(o, "system:Be brief.;user:Hi ünï;assistant:Hello;");
}

}  // namespace
}  // namespace moeline::tokenizer::jinja
