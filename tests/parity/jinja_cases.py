"""Inputs of the Jinja parity test (test_jinja_parity.py): conversations rendered over real chat
templates, and small templates that each exercise a construct of the engine."""

U = lambda c: {"role": "user", "content": c}  # noqa: E731
A = lambda c: {"role": "assistant", "content": c}  # noqa: E731
S = lambda c: {"role": "system", "content": c}  # noqa: E731
T = lambda c: {"role": "tool", "content": c}  # noqa: E731

CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "id": "call_1",
                        "function": {"name": "get_weather",
                                     "arguments": {"city": "Paris", "unit": "celsius"}}}]}
CALL_STRING_ARGS = {"role": "assistant", "content": "let me check",
                    "tool_calls": [{"type": "function", "id": "call_2",
                                    "function": {"name": "get_time",
                                                 "arguments": "{\"tz\": \"UTC\"}"}}]}

# Plain-text conversations (also test_chat_template.py's, against @huggingface/jinja).
TEXT_CONVERSATIONS = [
    [U("Hello!")],
    [S("You are terse."), U("What is 2+2?")],
    [S("Sys"), U("first question"), A("first answer"), U("second question")],
    [U("Hi"), A("Hello, how can I help?")],
    [U("multi\nline\n\nwith  spaces "), A(" leading space"), U("ünïcödé 你好 🤷‍♂️")],
    [U("think"), A("<think>\nsome reasoning\n</think>\n\nthe answer"), U("again")],
    [U("think"), A("<think>\nreasoning\n</think>\n\nfinal")],
    [S("a"), S("b"), U("two system messages")],
    [U(""), A(""), U("empty turns")],
]

CONVERSATIONS = TEXT_CONVERSATIONS + [
    [U("weather?"), CALL, T("sunny"), T("22C"), U("thanks")],
    [U("time?"), CALL_STRING_ARGS, T("{\"time\": \"12:00\"}"), A("It is noon."), U("ok")],
    [U("q"), A("x"), U("<tool_response>\nr\n</tool_response>")],
    [S("  padded system  "), U("  padded user\n"), A("\tpadded assistant\n")],
    [U("quotes ' \" \\ {{ not a tag }} {% neither %}")],
    [A("assistant first"), U("then user")],
    [U("a"), U("b")],
    [],
    [{"role": "user", "content": "reasoning?"},
     {"role": "assistant", "content": "yes", "reasoning_content": "because"},
     {"role": "user", "content": "more"}],
]

TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather for a city",
                       "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string"},
                                                     "unit": {"type": "string",
                                                              "enum": ["celsius", "fahrenheit"]}},
                                      "required": ["city"]}}}]

C = {"messages": [U("hi"), A("yo")], "n": 3, "f": 2.5, "s": "Hello World", "xs": [3, 1, 2],
     "d": {"b": 2, "a": 1, "c": {"z": [1, 2]}}, "empty": [], "t": True, "none": None,
     "u": "ünïcödé 你好", "neg": -7, "big": 12345678901234, "words": "  a b\tc\n"}

# (name, source, contexts): each renders with every context.
FEATURE_TEMPLATES = [
    ("text", "plain text\n", [{}]),
    ("trailing-newlines", "a\n\n", [{}]),
    ("crlf", "a\r\nb\r\n{% if true %}\r\nc\r\n{% endif %}\r\n", [{}]),
    ("output", "{{ n }} {{ f }} {{ s }} {{ t }} {{ none }} {{ xs }} {{ d }} {{ missing }}|", [C]),
    ("comment", "a {# comment #} b\n  {# own line #}\nc {#- strip -#}  d", [{}]),
    ("whitespace-control",
     "x  {{- n -}}  y\n  {%- if true -%}  z  {%- endif -%}\n w\n  {%+ if true %}k{% endif +%}\nend",
     [C]),
    ("trim-lstrip",
     "<ul>\n  {% for x in xs %}\n    <li>{{ x }}</li>\n  {% endfor %}\n</ul>\n  {# c #}\n  {{ n }}\n",
     [C]),
    ("raw", "{% raw %}{{ not }} {% evaluated %}{% endraw %}\n  {%- raw -%}  x  {%- endraw %}\nz",
     [{}]),
    ("if-elif-else",
     "{% for v in [0, 1, 2, 3] %}{% if v == 0 %}zero{% elif v == 1 %}one{% elif v > 2 %}big"
     "{% else %}two{% endif %},{% endfor %}", [{}]),
    ("for-else", "{% for x in empty %}{{ x }}{% else %}none{% endfor %}"
     "{% for x in xs if x > 1 %}{{ x }}{% else %}no{% endfor %}", [C]),
    ("loop-vars",
     "{% for x in xs %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/"
     "{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }}/"
     "{{ loop.previtem }}/{{ loop.nextitem }}/{{ loop.cycle('a', 'b') }}|{% endfor %}", [C]),
    ("loop-filter-length",
     "{% for m in messages if m.role == 'assistant' %}{{ loop.index }}{{ loop.length }}"
     "{{ m.content }}{% endfor %}", [C]),
    ("nested-loops",
     "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ a }}{{ b }}{{ loop.depth }} "
     "{% endfor %}{{ loop.index }};{% endfor %}", [{}]),
    ("break-continue",
     "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 5 %}{% break %}"
     "{% endif %}{{ x }}{% endfor %}", [{}]),
    ("unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}"
     "{% for (a, b) in [(1, 2), [3, 4]] %}{{ a + b }}{% endfor %}"
     "{% set p, q = 'ab' %}{{ q }}{{ p }}", [C]),
    ("set-scoping",
     "{% set x = 0 %}{% for i in range(3) %}{{ x }}{% set x = i %}{{ x }}{% endfor %}{{ x }}"
     "{% if true %}{% set y = 5 %}{% endif %}{{ y }}", [{}]),
    ("namespace",
     "{% set ns = namespace(count=0, found=false) %}{% for m in messages %}"
     "{% set ns.count = ns.count + 1 %}{% if m.role == 'assistant' %}{% set ns.found = true %}"
     "{% endif %}{% endfor %}{{ ns.count }} {{ ns.found }} {{ ns.missing }}", [C]),
    ("set-block",
     "{% set block %}\n  hello {{ n }}\n{% endset %}[{{ block }}]"
     "{% set up | upper %}quiet{% endset %}{{ up }}", [C]),
    ("macro-bad-defaults", "{% macro m(a=1, b) %}{% endmacro %}", [{}]),
    ("macro",
     "{% macro greet(name, greeting='Hello', punct='.') %}{{ greeting }}, {{ name }}{{ punct }}"
     "{% endmacro %}{{ greet('Ann') }}|{{ greet('Bob', 'Hi', '!') }}|"
     "{{ greet(name='Cy', punct='?') }}|{{ greet() }}|{{ greet('a', 'b', 'c', 'extra') }}", [{}]),
    ("macro-varargs",
     "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3) }}", [{}]),
    ("macro-caller",
     "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}"
     "{% call wrap('b') %}inside {{ n }}{% endcall %}", [C]),
    ("macro-recursion",
     "{% macro fact(k) %}{% if k <= 1 %}1{% else %}{{ k * fact(k - 1) | int }}{% endif %}"
     "{% endmacro %}{{ fact(5) }}", [{}]),
    ("literals",
     "{{ 'a\\tb\\n\\u00e9\\x41' }}|{{ \"it's\" }}|{{ 'x' 'y' }}|{{ 1_000 }}|{{ 1.5e3 }}|"
     "{{ 2e-7 }}|{{ True }}{{ False }}{{ None }}|{{ (1,) }}|{{ (1, 'a') }}|{{ [] }}|{{ {} }}|"
     "{{ {'k': [1, {'n': none}]} }}|{{ 0.1 + 0.2 }}|{{ 1e16 }}|{{ 123456789.0 }}|{{ -0.0 }}", [{}]),
    ("arithmetic",
     "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 6 / 3 }} {{ 2 ** 10 }} "
     "{{ 2 ** -1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 1 + 2 * 3 - 4 }} {{ -2 ** 2 }} "
     "{{ 'ab' * 3 }} {{ [1] * 2 }} {{ 'a' ~ 1 ~ none ~ missing }} {{ true + 1 }} {{ n * f }}",
     [C]),
    ("comparisons",
     "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }} "
     "{{ 'a' in 'cat' }} {{ 2 in xs }} {{ 'a' in d }} {{ 5 not in xs }} {{ none is none }} "
     "{{ missing == missing }} {{ 1 != 2 }} {{ true == 1 }}", [C]),
    ("logic",
     "{{ 0 or 'x' }} {{ 1 and 'y' }} {{ not empty }} {{ none or [] }} {{ '' and 1 }} "
     "{{ 'a' if t else 'b' }} {{ 'a' if not t else 'b' }} [{{ 'only' if false }}] "
     "{{ (1 if n > 2 else 2) + 1 }}", [C]),
    ("attributes",
     "{{ d.a }} {{ d['b'] }} {{ d.c.z[1] }} {{ d.get('a') }} {{ d.get('q', 'dflt') }} "
     "{{ d.get('q') }} {{ xs[0] }} {{ xs[-1] }} {{ xs[10] }} {{ s[0] }} {{ u[1] }} "
     "{{ messages[0].role }} {{ d.keys() | list }} {{ d.values() | list }} {{ xs.0 }}", [C]),
    ("slicing",
     "{{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} {{ xs[::2] }} {{ s[1:4] }} {{ s[-5:] }} "
     "{{ s[::-2] }} {{ u[2:5] }} {{ u[::-1] }} {{ xs[5:] }} {{ messages[1:] | length }} "
     "{{ xs[-100:100] }} {{ s[4:1:-1] }}", [C]),
    ("string-methods",
     "{{ s.startswith('Hell') }} {{ s.endswith(('x', 'ld')) }} [{{ words.strip() }}] "
     "[{{ words.lstrip() }}] [{{ words.rstrip() }}] {{ 'xxaxx'.strip('x') }} {{ s.split() }} "
     "{{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.split(',', 1) }} {{ 'a,b,c'.rsplit(',', 1) }} "
     "{{ words.split() }} {{ s.replace('l', 'L') }} {{ s.replace('l', 'L', 1) }} "
     "{{ s.upper() }} {{ s.lower() }} {{ 'hello wORLD'.title() }} {{ 'hELLO'.capitalize() }} "
     "{{ s.find('o') }} {{ s.find('z') }} {{ s.count('l') }} {{ '-'.join(['a', 'b']) }} "
     "{{ u.upper() }} {{ u.find('你') }} {{ 'ab\\ncd'.splitlines() }}", [C]),
    ("filters-strings",
     "[{{ words | trim }}] {{ s | length }} {{ u | length }} {{ s | upper }} {{ s | lower }} "
     "{{ 'hello world' | capitalize }} {{ 'hello-world foo(bar)' | title }} "
     "{{ s | replace('o', '0') }} {{ n | string }} {{ '42' | int }} {{ '4.7' | int }} "
     "{{ 'x' | int }} {{ 'x' | int(7) }} {{ '2.5' | float }} {{ 'q' | float }} {{ neg | abs }} "
     "{{ f | round }} {{ 3.14159 | round(2) }} {{ 2.5 | round }} {{ 3.5 | round }} "
     "{{ 2.1 | round(0, 'ceil') }} {{ 7 | round }} {{ s | wordcount }} {{ 'ab' | center(6) }}|"
     "{{ '<a href=\"x\">' | e }} {{ s | safe }} {{ u | reverse }} {{ s | first }} "
     "{{ s | last }}", [C]),
    ("filter-default",
     "{{ missing | default('dflt') }} {{ none | default('dflt') }} {{ '' | d('e', true) }} "
     "{{ 0 | default(5, boolean=true) }} {{ n | default(1) }} {{ missing | d }}|", [C]),
    ("filter-indent",
     "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|"
     "{{ 'a\\n\\nb' | indent(width='> ', blank=true) }}|", [{}]),
    ("filter-tojson",
     "{{ d | tojson }}\n{{ d | tojson(indent=2) }}\n{{ d | tojson(sort_keys=true) }}\n"
     "{{ xs | tojson(separators=(',', ':')) }}\n{{ u | tojson }}\n{{ 'q\"\\\\\\n\\t\\x01' | tojson }}"
     "\n{{ [1.0, 2.5, none, true, 'x'] | tojson }}\n{{ {1: 'int key'} | tojson }}\n"
     "{{ empty | tojson(indent=4) }}{{ {} | tojson(indent=4) }}\n{{ messages | tojson(indent='\\t') }}",
     [C]),
    ("filters-sequences",
     "{{ xs | first }} {{ xs | last }} {{ empty | first }} {{ xs | join(', ') }} "
     "{{ messages | map(attribute='role') | join('+') }} {{ xs | sort }} "
     "{{ xs | sort(reverse=true) }} {{ ['b', 'A', 'c'] | sort }} "
     "{{ ['b', 'A', 'c'] | sort(case_sensitive=true) }} {{ xs | sum }} {{ xs | min }} "
     "{{ xs | max }} {{ [1, 2, 1, 'a', 'A'] | unique | list }} {{ xs | reverse | list }} "
     "{{ d | dictsort }} {{ d | dictsort(reverse=true) }} {{ d | items | list }} {{ s | list }} "
     "{{ xs | count }} {{ range(5) | batch(2) | list }} {{ range(5) | batch(2, 0) | list }} "
     "{{ messages | sort(attribute='role') | map(attribute='content') | join }}", [C]),
    ("select-reject",
     "{{ messages | selectattr('role', 'equalto', 'user') | list | length }} "
     "{{ messages | rejectattr('role', 'eq', 'user') | map(attribute='content') | list }} "
     "{{ [0, 1, 2, 3] | select('odd') | list }} {{ [0, 1, 2, 3] | reject('even') | list }} "
     "{{ [0, 1, '', 'x'] | select | list }} {{ xs | select('gt', 1) | list }} "
     "{{ ['a', 'b'] | map('upper') | list }} {{ messages | selectattr('missing') | list }} "
     "{{ messages | map(attribute='nope', default='dflt') | list }}", [C]),
    ("tests",
     "{{ n is defined }} {{ missing is undefined }} {{ none is none }} {{ s is string }} "
     "{{ n is number }} {{ f is number }} {{ n is integer }} {{ f is float }} {{ t is integer }} "
     "{{ d is mapping }} {{ xs is iterable }} {{ s is sequence }} {{ n is sequence }} "
     "{{ t is boolean }} {{ t is true }} {{ t is false }} {{ range is callable }} "
     "{{ n is eq 3 }} {{ n is equalto 3 }} {{ n is ne 3 }} {{ n is gt 2 }} {{ n is ge 4 }} "
     "{{ n is lt 4 }} {{ n is le 2 }} {{ 2 is in xs }} {{ 9 is divisibleby 3 }} {{ n is odd }} "
     "{{ n is even }} {{ n is not none }} {{ 'abc' is lower }} {{ missing is iterable }}", [C]),
    ("generators",
     "{{ xs | map('string') | join }} {% if empty | select %}truthy{% endif %} "
     "{{ none | selectattr('x') | list }} {{ none | map(attribute='x') | list }} "
     "{% set g = xs | reverse %}{{ g | list }}{{ g | list }} {{ d | items | list }} "
     "{{ 3 in xs | select }} {{ xs | unique | list }} {{ xs | select is iterable }}", [C]),
    ("generator-tojson", "{{ xs | map('string') | tojson }}", [C]),
    ("generator-length", "{{ xs | select | length }}", [C]),
    ("generator-last", "{{ xs | select | last }}", [C]),
    ("markup",
     "{{ '<b>' | safe + '<i>' }} {{ '<i>' + '<b>' | safe }} {{ '<a>' | e }} {{ '<a>' | e | e }} "
     "{{ ('x' | safe) ~ '<y>' }}", [{}]),
    ("globals",
     "{{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ range(5, 0, -2) | list }} "
     "{{ dict(a=1, b='x') }} {% set j = joiner('; ') %}{% for x in xs %}{{ j() }}{{ x }}"
     "{% endfor %} {{ strftime_now('%Y') | length }}", [C]),
    ("raise", "{% if n > 2 %}{{ raise_exception('n is ' ~ n ~ ', too big!') }}{% endif %}ok",
     [C, {"n": 1}]),
    ("undefined-errors", "{{ missing.attr }}", [{}]),
    ("undefined-errors-2", "{{ missing + 1 }}", [{}]),
    ("undefined-errors-3", "{{ messages[5]['role'] }}", [C]),
    ("undefined-ok", "{{ missing }}{{ missing | length }}{% for x in missing %}x{% endfor %}"
     "{{ missing | list }}{{ d.nope }}{{ xs[9] }}{{ missing is not defined }}"
     "{{ missing | trim }}{{ missing | upper }}|", [C]),
    ("type-errors", "{{ 'a' + 1 }}", [{}]),
    ("type-errors-2", "{{ 1 < 'a' }}", [{}]),
    ("type-errors-3", "{{ xs | tojson }}{{ missing | tojson }}", [C]),
    ("sandbox", "{{ xs.append(4) }}", [C]),
    ("sandbox-2", "{{ d.update({'x': 1}) }}", [C]),
    ("syntax-error", "{% if %}", [{}]),
    ("syntax-error-2", "{% for x in xs %}", [C]),
    ("syntax-error-3", "{{ 1 + }}", [{}]),
    ("unknown-filter", "{{ 1 | nosuchfilter }}", [{}]),
    ("unknown-tag", "{% include 'x.html' %}", [{}]),
    ("unpack-error", "{% for a, b in [1, 2] %}{% endfor %}", [{}]),
    ("division-by-zero", "{{ 1 / 0 }}", [{}]),
    ("messages-shapes",
     "{% for m in messages %}{% if m.content is string %}{{ m.content | trim }}"
     "{% elif m.content is iterable %}{% for c in m.content %}{{ c.type }}:{{ c.text }}"
     "{% endfor %}{% endif %}{% if m.tool_calls is defined %}{% for tc in m.tool_calls %}"
     "{{ tc.function.name }}({{ tc.function.arguments | tojson }}){% endfor %}{% endif %}|"
     "{% endfor %}",
     [{"messages": [U("a"), {"role": "user", "content": [{"type": "text", "text": "multi"}]},
                    CALL]}]),
]
