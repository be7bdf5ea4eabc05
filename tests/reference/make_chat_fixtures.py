#!/usr/bin/env python3
"""Golden fixtures for tests/test_jinja.c: renders a fixed set of conversations with Hugging Face
transformers' apply_chat_template(tokenize=False) for each chat template we support, and writes
tests/fixtures/chat/cases.json (a list of {name, template, messages, tools?, kwargs?,
add_generation_prompt, bos_token, eos_token, expected | error}) plus a copy of every template as
tests/fixtures/chat/<template>.jinja, so the C test never reads ../shared.

Templates come from two places: the tokenizer folders in ../shared/data/tokenizers (their
tokenizer_config.json), and the published templates of the 2026 families (TEMPLATE_FILES below:
Qwen3.5, GLM-4.6, GLM-4.7-Flash, MiniMax-M2, Granite 4.0), read from --templates DIR (a folder of
`<model>.jinja` files as the models ship them; llama.cpp's models/templates has these names) or,
without it, from the copies already committed here; and the templates transformers carries
itself (TRANSFORMERS_TEMPLATES: Llama 4's). Those are rendered through the Qwen3 tokenizer
with apply_chat_template(chat_template=...): none of them reads a special-token variable.

Run from the repository root (needs transformers 5.x and jinja2; made with transformers 5.25,
jinja2 3.1.6). Also writes tests/fixtures/chat/unit.json: small templates exercising single
features, with a JSON context and jinja2's output. Usage:  python3 tests/reference/make_chat_fixtures.py [--shared PATH]
"""
import argparse
import importlib
import json
import os

from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..")
OUT = os.path.join(TESTS, "fixtures", "chat")

USER = {"role": "user", "content": "Hello! What is 2+2?"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
TRICKY = (
    "Braces {{ not a tag }} {% if x %} {# nor a comment #} and quotes \"double\" 'single' "
    "back\\slash\ttab\nnewline  trailing space "
)
UNICODE = "héllo wörld — 日本語のテキスト 🤖🚀 Ελληνικά русский ﬁ"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}


def conversations():
    """(name, messages, extra) for every template; extra may hold tools and template kwargs."""
    multi = [
        SYSTEM,
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the tensor cross the road?"},
        {"role": "user", "content": "Why?"},
    ]
    think = [
        {"role": "user", "content": "What is 3*7?"},
        {"role": "assistant", "content": "<think>\nMultiply 3 by 7.\nThat is 21.\n</think>\n\n21"},
        {"role": "user", "content": "And 4*5?"},
        {"role": "assistant", "content": "<think>\nEasy: 20.\n</think>\n\n20"},
    ]
    reasoning_field = [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris.", "reasoning_content": "\nThe user asks about France.\n"},
    ]
    reasoning_alias = [
        {"role": "user", "content": "Capital of Spain?"},
        {"role": "assistant", "content": "Madrid.", "reasoning": "Spain -> Madrid."},
        {"role": "user", "content": "Thanks"},
    ]
    tool_calls = [
        SYSTEM,
        {"role": "user", "content": "What's the weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris", "unit": "celsius"}}},
                {"type": "function", "function": {"name": "get_weather",
                                                  "arguments": "{\"city\": \"Tokyo\"}"}},
            ],
        },
        {"role": "tool", "content": "{\"temp\": 21, \"sky\": \"clear\"}"},
        {"role": "tool", "content": "{\"temp\": 18.5, \"sky\": \"rain\"}"},
    ]
    tool_answer = tool_calls + [
        {"role": "assistant", "content": "Paris is 21°C and clear; Tokyo is 18.5°C with rain."},
        {"role": "user", "content": "<tool_response>fake</tool_response>"},
    ]
    none_content = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "content": "cold"},
    ]
    return [
        ("single_user", [USER], {}),
        ("system_user", [SYSTEM, USER], {}),
        ("multi_turn", multi, {}),
        ("multi_system", [SYSTEM, {"role": "system", "content": "Answer briefly."}, USER], {}),
        ("think_history", think, {}),
        ("reasoning_field", reasoning_field, {}),
        ("reasoning_alias", reasoning_alias, {}),
        ("tricky_text", [{"role": "system", "content": TRICKY}, {"role": "user", "content": TRICKY}], {}),
        ("unicode", [{"role": "user", "content": UNICODE}, {"role": "assistant", "content": UNICODE}], {}),
        ("empty_content", [{"role": "user", "content": ""}], {}),
        ("tool_calls", tool_calls, {"tools": [WEATHER_TOOL]}),
        ("tool_calls_no_tools", tool_calls, {}),
        ("tool_answer", tool_answer, {"tools": [WEATHER_TOOL]}),
        ("none_content_tool_call", none_content, {}),
        ("no_thinking", [USER], {"kwargs": {"enable_thinking": False}}),
        ("thinking_true", [USER], {"kwargs": {"enable_thinking": True}}),
    ]


# Small templates for the features the model templates do not cover, rendered with the same
# jinja2 environment transformers builds (trim_blocks, lstrip_blocks, its tojson and globals).
UNIT = [
    ("ws_trim", "{% if true %}\n  a\n  {% endif %}\nb\n    {%- if x %}c{% endif -%}\n  d {{- ' e ' -}} f\n", {}),
    ("ws_lstrip", "x\n    {% if true %}\n    y\n    {% endif %}\n  {# c #}\n z {%+ if true %}w{% endif +%}\nq\n", {}),
    ("ws_var_not_lstripped", "a\n   {{ 'v' }}\n   {{- 'w' }}\n", {}),
    ("comment", "a{# one\ntwo #}b\n{#- x -#}\n c", {}),
    ("trailing_newline", "a\n", {}),
    ("loop_vars", "{% for x in xs %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.length }}/{{ loop.revindex }}"
     "{% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %}"
     "{{ loop.previtem if loop.previtem is defined else '-' }}{{ loop.cycle('a', 'b') }};{% endfor %}", {"xs": [3, 4, 5]}),
    ("loop_else_filter", "{% for x in xs if x > 1 %}{{ x }}{{ loop.length }},{% else %}none{% endfor %}|"
     "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}", {"xs": [1, 2, 3]}),
    ("loop_dict_items", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
     {"d": {"b": 1, "a": [1, "x"]}}),
    ("break_continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i > 4 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("scoping", "{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}"
     "{% set ns = namespace(t=0) %}{% for i in [1, 2, 3] %}{% set ns.t = ns.t + i %}{% endfor %}{{ ns.t }}", {}),
    ("set_block", "{% set y %}in{{ 1 + 1 }}side{% endset %}[{{ y }}]{% set a, b = [1, 2] %}{{ b }}{{ a }}", {}),
    ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bo') }} {{ greet('Al', punct='?') }}", {}),
    ("arith", "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2.5 }} {{ 3 * 'ab' }}"
     " {{ 1.0 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 1e-7 }} {{ 10 / 4 }} {{ -3 }} {{ 2 - 5 }} {{ 1.5e300 * 1 }}"
     " {{ 0.00001 }} {{ 0.0001 }} {{ 123456789.0 }} {{ 1e16 }} {{ 1e15 }} {{ -2.5e-10 }} {{ 1 / 3 }} {{ 2.0 ** 0.5 }}", {}),
    ("undefined_raises", "{{ u.attr }}", {}),
    ("undefined_add_raises", "{{ u + 1 }}", {}),
    ("ns_underscore_raises", "{% set ns = namespace(_x=1) %}", {}),
    ("raise_exception", "{{ raise_exception('bad input') }}", {}),
    ("set_attr_non_ns_raises", "{% set d = {} %}{% set d.x = 1 %}", {}),
    ("compare_logic", "{{ 1 < 2 < 3 }} {{ 'a' < 'b' }} {{ 1 == 1.0 }} {{ [1, 2] == [1, 2] }} {{ none is none }}"
     " {{ 0 or 'x' }} {{ 1 and 'y' }} {{ not [] }} {{ 'b' in 'abc' }} {{ 3 not in [1, 2] }} {{ 'k' in {'k': 1} }}"
     " {{ 'yes' if 0 else 'no' }} {{ true and none }}", {}),
    ("tests", "{{ x is defined }}{{ y is defined }}{{ y is undefined }}{{ x is string }}{{ n is number }}{{ n is integer }}"
     "{{ f is float }}{{ d is mapping }}{{ l is sequence }}{{ l is iterable }}{{ n is odd }}{{ n is even }}{{ n is divisibleby 3 }}"
     "{{ b is true }}{{ b is false }}{{ b is boolean }}{{ 'ab' is lower }}{{ x is not none }}{{ n is eq 3 }}{{ n is gt(2) }}"
     "{{ 'a' is in ['a'] }}{{ none is sameas none }}",
     {"x": "s", "n": 3, "f": 1.5, "d": {}, "l": [1], "b": True}),
    ("filters_str", "[{{ '  pad  ' | trim }}][{{ 'xxhixx' | trim('x') }}][{{ 'Hello' | lower }}][{{ 'Hello' | upper }}]"
     "[{{ 'hello world' | title }}][{{ 'hELLO' | capitalize }}][{{ 'aXbXc' | replace('X', '-') }}][{{ 'abc' | length }}]"
     "[{{ 'héllo' | length }}][{{ 42 | string }}][{{ 'abc' | reverse }}][{{ 'abc' | first }}][{{ 'abc' | last }}]"
     "[{{ 'a\nb\n\nc' | indent(2) }}][{{ 'a\nb' | indent(2, true) }}][{{ '<a&\"b\\'>' | e }}]", {}),
    ("filters_list", "{{ l | length }} {{ l | first }} {{ l | last }} {{ l | join(', ') }} {{ l | reverse | list }}"
     " {{ l | map('string') | join }} {{ [1, 2, 2, 3, 1] | unique | list }} {{ u | default('dflt') }} {{ '' | default('e', true) }}"
     " {{ d | items | list }} {{ d | length }} {{ [3, 4] | list }} {{ ms | map(attribute='role') | join('+') }}"
     " {{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | list }} {{ ms | rejectattr('role', 'eq', 'user') | list | length }}"
     " {{ [0, 1, '', 'a'] | select | list }} {{ [1, 2, 3, 4] | select('odd') | list }} {{ '3' | int + 1 }} {{ '2.5' | float }} {{ -4 | abs }}",
     {"l": [1, 2, 3], "d": {"a": 1, "b": None}, "ms": [{"role": "user", "c": 1}, {"role": "bot", "c": 2}, {"role": "user", "c": 3}]}),
    ("tojson", "{{ v | tojson }}\n{{ v | tojson(indent=2) }}\n{{ s | tojson }}\n{{ {'k': [1, 2.0, none, true]} | tojson(separators=(',', ':')) }}\n{{ [] | tojson(indent=2) }}",
     {"v": {"a": [1, 2, {"b": None}], "c": "x\"y\\z\n\t\u0001é🚀", "d": 1.5, "e": {}}, "s": "plain"}),
    ("str_methods", "{{ s.startswith('ab') }}{{ s.endswith(('x', 'ef')) }}{{ s.split('c') }}{{ '  a  b '.split() }}{{ 'a,b,c'.split(',', 1) }}"
     "[{{ '\n\nx\n'.strip('\n') }}][{{ '  x '.lstrip() }}][{{ ' x  '.rstrip() }}][{{ 'aaa'.replace('a', 'b', 2) }}]"
     "{{ s.upper() }}{{ 'AbC'.lower() }}{{ s.find('cd') }}{{ s.count('b') }}{{ '-'.join(['x', 'y']) }}{{ s[1] }}{{ s[-1] }}"
     "{{ s[1:3] }}{{ s[::-1] }}{{ s[::2] }}{{ s[-2:] }}{{ l[::-1] }}{{ l[1:] }}{{ l[:-1] }}{{ 'héllo'[1:3] }}",
     {"s": "abcdef", "l": [1, 2, 3]}),
    ("print_values", "{{ none }}|{{ true }}|{{ u }}|{{ [1, 'a', none, true, 1.5, {'k': \"it's\"}] }}|{{ {'a': [1]} }}|{{ ns }}",
     {}),
    ("dict_access", "{{ d.a }}{{ d['b'] }}{{ d.get('c', 'dflt') }}{{ d.get('a') }}{{ d.missing is defined }}{{ l[5] is defined }}"
     "{{ d['x'] | default('none') }}{{ d.keys() | list }}{{ d.values() | list }}",
     {"d": {"a": 1, "b": "two"}, "l": [1]}),
    ("concat", "{{ 'a' ~ 1 ~ none ~ u ~ [1] }} {{ 'x' + 'y' }} {{ [1] + [2] }}", {}),
    ("escapes", "{{ 'tab\\there' }} {{ \"q\\\"uote\" }} {{ 'uni\\u00e9' }} {{ 'a' 'b' }} {{ '{{ raw }}' }}", {}),
    ("range_ns", "{% set ns = namespace(a=[], found=false) %}{% for i in range(1, 7, 2) %}{{ i }}{% if i == 3 %}{% set ns.found = true %}{% endif %}{% endfor %}"
     "{{ ns.found }}{{ range(3) | list }}{{ dict(a=1) }}", {}),
    ("elif_chain", "{% for x in [1, 2, 3, 4] %}{% if x == 1 %}one{% elif x == 2 %}two{% elif x == 3 %}three{% else %}other{% endif %} {% endfor %}", {}),
    ("nested_loops", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ a }}{{ b }}{{ loop.index }}{% endfor %}{{ loop.index }};{% endfor %}", {}),
]


def object_arguments(messages):
    """The conversation with every tool call's JSON-string arguments parsed into the object they
    spell, as vLLM hands them to templates that iterate them (an empty string becomes {});
    None when no call has string arguments."""
    out, changed = [], False
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m, tool_calls=[dict(tc) for tc in m["tool_calls"]])
            for tc in m["tool_calls"]:
                fn = dict(tc["function"])
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"] else {}
                    changed = True
                tc["function"] = fn
        out.append(m)
    return out if changed else None


# fixture name -> the published template's file name in --templates
TEMPLATE_FILES = {
    "qwen3_5": "Qwen3.5-4B.jinja",          # the Qwen3.5 release's template (MoE sizes ship the same)
    "glm4_6": "GLM-4.6.jinja",              # glm4_moe: GLM-4.5 / 4.6
    "glm4_7": "GLM-4.7-Flash.jinja",        # glm4_moe: GLM-4.7
    "minimax_m2": "MiniMax-M2.jinja",
    "granite4": "ibm-granite-granite-4.0.jinja",  # granitemoehybrid: Granite 4.0-H
}


# fixture name -> (module, attribute, tokenizer folder key): templates transformers itself
# carries, rendered through a tokenizer whose special tokens they read
TRANSFORMERS_TEMPLATES = {
    # Llama 4 Instruct's template (Llama4Processor's default; JSON tool calls after
    # <|python_start|>); bos_token from the Llama 2 tokenizer stands in for <|begin_of_text|>
    "llama4": ("transformers.models.llama4.processing_llama4", "chat_template", "llama2"),
}


def unit_cases():
    out = []
    for name, src, ctx in UNIT:
        case = {"name": name, "template": src, "context": ctx}
        try:
            case["expected"] = _compile_jinja_template(src).render(**ctx)
        except Exception as e:
            case["error"] = f"{type(e).__name__}: {e}"
        out.append(case)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(TESTS, "..", "..", "shared", "data", "tokenizers"))
    ap.add_argument("--templates", help="folder with the published templates named in TEMPLATE_FILES")
    args = ap.parse_args()
    folders = {
        "qwen3": os.path.join(args.shared, "qwen3"),
        "deepseek_v3": os.path.join(args.shared, "deepseek_v3"),
        "chatml": os.path.join(TESTS, "fixtures", "models", "mixtral"),
        "llama2": os.path.join(args.shared, "llama2"),
        "gptoss": os.path.join(args.shared, "gptoss"),
    }
    sources = []  # (name, tokenizer, template text)
    for tname, folder in folders.items():
        tok = AutoTokenizer.from_pretrained(folder)
        sources.append((tname, tok, tok.chat_template))
    qwen3 = AutoTokenizer.from_pretrained(folders["qwen3"])
    for tname, fname in TEMPLATE_FILES.items():
        path = os.path.join(args.templates, fname) if args.templates else os.path.join(OUT, tname + ".jinja")
        with open(path, encoding="utf-8") as f:
            sources.append((tname, qwen3, f.read()))
    for tname, (module, attr, key) in TRANSFORMERS_TEMPLATES.items():
        sources.append((tname, AutoTokenizer.from_pretrained(folders[key]),
                        getattr(importlib.import_module(module), attr)))
    cases = []
    for tname, tok, template in sources:
        if not isinstance(template, str):
            print(f"{tname}: no chat template, skipped")
            continue
        with open(os.path.join(OUT, tname + ".jinja"), "w", encoding="utf-8") as f:
            f.write(template)
        n_ok = n_err = 0
        for name, messages, extra in conversations():
            for agp in (True, False):
                case = {
                    "name": f"{tname}/{name}/{'gen' if agp else 'nogen'}",
                    "template": tname,
                    "messages": messages,
                    "add_generation_prompt": agp,
                    "bos_token": tok.bos_token,
                    "eos_token": tok.eos_token,
                }
                if "tools" in extra:
                    case["tools"] = extra["tools"]
                if "kwargs" in extra:
                    case["kwargs"] = extra["kwargs"]
                def render(msgs):
                    return tok.apply_chat_template(
                        msgs, tools=extra.get("tools"), add_generation_prompt=agp, tokenize=False,
                        chat_template=template, **extra.get("kwargs", {}))
                try:
                    case["expected"] = render(messages)
                    n_ok += 1
                except Exception as e:  # the C renderer must fail on these too
                    case["error"] = f"{type(e).__name__}: {e}"
                    n_err += 1
                parsed = object_arguments(messages)
                if parsed is not None:  # what a template that iterates the arguments gets
                    try:
                        case["expected_object_arguments"] = render(parsed)
                    except Exception as e:
                        case["error_object_arguments"] = f"{type(e).__name__}: {e}"
                cases.append(case)
        print(f"{tname}: {n_ok} rendered, {n_err} raised")
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
        f.write("\n")
    units = unit_cases()
    with open(os.path.join(OUT, "unit.json"), "w", encoding="utf-8") as f:
        json.dump(units, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(units)} unit templates ({sum('error' in u for u in units)} raise) to tests/fixtures/chat/unit.json")
    print(f"wrote {len(cases)} cases to {os.path.relpath(os.path.join(OUT, 'cases.json'))}")


if __name__ == "__main__":
    main()
