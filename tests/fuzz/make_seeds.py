"""Writes the committed seed corpora of the fuzz harnesses (tests/fuzz/corpus/NAME/) from the
test fixtures and a few hand-written inputs: `python3 tests/fuzz/make_seeds.py`. Each seed
starts with the selector byte its harness reads first (see the harness's header comment).
Re-run it when the fixtures change; libFuzzer only reads these files."""
import hashlib
import json
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def write(name, seeds):
    d = os.path.join(HERE, "corpus", name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    for s in seeds:
        with open(os.path.join(d, hashlib.sha1(s).hexdigest()[:16]), "wb") as f:
            f.write(s)
    print("%s: %d seeds" % (name, len(seeds)))


def http_seeds():
    reqs = [
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\r\nGET /v1/models?x=1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 17\r\nAuthorization: Bearer k\r\nExpect: 100-continue\r\n\r\n"
        b'{"prompt": "hi"}',
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\n{\"pro\r\n0a;ext=1\r\nmpt\": \"ab\"\r\n1\r\n}\r\n0\r\nX-T: y\r\n\r\n",
        b"GET http://example.com:8000/metrics HTTP/1.1\nHost: example.com\n\n",
        b"OPTIONS * HTTP/1.1\r\nHost: x\r\nContent-Length: 0, 0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 3"
        b"\r\n\r\nabc",
        b"GET / HTTP/1.1\r\nHost : x\r\nX: a\r\n b\r\n\r\n",
        b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: x\r\nx-api-key: k\r\n"
        b"anthropic-version: 2023-06-01\r\nContent-Length: 66\r\n\r\n"
        b'{"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}',
        b"DELETE /v1/responses/resp_1 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/responses/resp_1/cancel HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    ]
    return [bytes([step]) + r for r in reqs for step in (0, 6)]


def proto_seeds():
    bodies = [
        (0, {"prompt": "Hello", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "n": 2,
             "stop": ["\n", "END"], "stream": True, "stream_options": {"include_usage": True},
             "logprobs": 2, "echo": True, "seed": 3, "moe_top_k": 1, "ignore_eos": False}),
        (0, {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": None, "top_k": -1, "min_p": 0.1,
             "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1}),
        (0, {"prompt": ["a", "b"], "model": "m"}),
        (1, {"messages": [{"role": "system", "content": "s"},
                          {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                          {"role": "assistant", "content": None, "reasoning_content": "r"}],
             "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3,
             "add_generation_prompt": False}),
        (2, {"prompt": "tokenize me", "add_special_tokens": False}),
        (2, {"messages": [{"role": "user", "content": "hi"}]}),
        (3, {"tokens": [1, 2, 3, 400]}),
    ]
    # 4: Anthropic Messages, 5: its count_tokens, 6: OpenAI Responses (see fuzz_proto.c)
    tools_a = [{"name": "add", "description": "d", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}]
    bodies += [
        (4, {"model": "m", "max_tokens": 16, "system": [{"type": "text", "text": "s"}],
             "messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": [
                              {"type": "thinking", "thinking": "t", "signature": ""},
                              {"type": "text", "text": "x"},
                              {"type": "tool_use", "id": "toolu_1", "name": "add",
                               "input": {"a": 1}}]},
                          {"role": "user", "content": [
                              {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1",
                               "is_error": False}, {"type": "text", "text": "ok"}]}],
             "tools": tools_a, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
             "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 4, "stream": True,
             "thinking": {"type": "enabled", "budget_tokens": 8}, "metadata": {"user_id": "u"}}),
        (4, {"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": ""}}]}]}),
        (5, {"messages": [{"role": "user", "content": "hi"}], "tools": tools_a,
             "tool_choice": {"type": "tool", "name": "add"}}),
        (6, {"model": "m", "input": "hi", "instructions": "i", "max_output_tokens": 9,
             "text": {"format": {"type": "json_schema", "name": "n", "schema": {
                 "type": "object"}, "strict": True}}, "reasoning": {"effort": "low"},
             "store": False, "metadata": {"k": "v"}, "stream": True}),
        (6, {"input": [{"type": "reasoning", "id": "rs_1", "summary": [
                          {"type": "summary_text", "text": "s"}]},
                       {"type": "message", "role": "assistant", "content": [
                           {"type": "output_text", "text": "x", "annotations": []}]},
                       {"type": "function_call", "call_id": "call_2", "name": "add",
                        "arguments": "{\"a\": 1}"},
                       {"type": "function_call_output", "call_id": "call_2", "output": "1"},
                       {"role": "developer", "content": [{"type": "input_text", "text": "d"}]}],
             "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"},
                        "strict": True}], "tool_choice": {"type": "function", "name": "add"},
             "parallel_tool_calls": False}),
        (6, {"previous_response_id": "resp_x", "input": [
            {"type": "function_call_output", "call_id": "call_1", "output": "2"}]}),
    ]
    seeds = [bytes([k]) + json.dumps(b).encode() for k, b in bodies]
    seeds += [b"\x00{\"prompt\": \"\\u00e9\\ud83d\\ude00\", \"seed\": 1e400}", b"\x01[", b"\x03{}",
              b"\x06{\"input\": \"\\udfff\\u00ff\"}"]
    return seeds


def safetensors(tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def model_file_seeds():
    seeds = []
    for d in sorted(os.listdir(os.path.join(TESTS, "fixtures", "models"))):
        for f in ("config.json", "generation_config.json"):
            p = os.path.join(TESTS, "fixtures", "models", d, f)
            if os.path.exists(p) and not d.endswith(("_bf16", "_sharded")):
                seeds.append(b"\x00" + open(p, "rb").read())
    seeds.append(b"\x01" + safetensors([("w", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
                                        ("b", "BF16", [3], b"\x80\x3f" * 3)],
                                       {"format": "pt"}))
    seeds.append(b"\x01" + safetensors([("a.weight", "F16", [1, 2, 1], b"\x00\x3c" * 2),
                                        ("i", "I64", [], struct.pack("<q", 7)),
                                        ("e", "F32", [0, 4], b"")]))
    return seeds


def jinja_seeds():
    seeds = []
    for f in ("chatml.jinja", "qwen3.jinja", "deepseek_v3.jinja"):
        seeds.append(open(os.path.join(TESTS, "fixtures", "chat", f), "rb").read())
    for case in json.load(open(os.path.join(TESTS, "fixtures", "chat", "unit.json"))):
        seeds.append(case["template"].encode())
    msgs = json.dumps([{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "x", "tool_calls": [
                           {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}])
    seeds.append(b"{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\x00" +
                 msgs.encode())
    return seeds


def tokenizer_seeds():
    texts = ["Hello world", "ROMEO: But soft, what light through yonder window breaks?",
             "  leading and  double  spaces\n\ttabs", "caf\u00e9 na\u00efve \u4f60\u597d \U0001F600",
             "<|im_start|>user\nhi<|im_end|>", "<s>[INST] x [/INST]</s>", "12345 3.14 1e9",
             "\u0cf3\u1c89 \U00031350"]
    seeds = []
    for mode in range(2):
        for tok in range(2):
            for t in texts:
                seeds.append(bytes([tok | (mode << 1)]) + t.encode())
    seeds.append(b"\x00\xff\xfe\xc3(\xe2\x82")  # invalid UTF-8
    seeds.append(b"\x04" + bytes(range(0, 96)))  # ids
    seeds.append(b"\x05" + bytes(range(96, 192)))
    return seeds


def output_seeds():
    ds = "<\uff5ctool\u2581calls\u2581begin\uff5c><\uff5ctool\u2581call\u2581begin\uff5c>function" \
         "<\uff5ctool\u2581sep\uff5c>f\n```json\n{\"a\": 1}\n```<\uff5ctool\u2581call\u2581end\uff5c>" \
         "<\uff5ctool\u2581calls\u2581end\uff5c>"
    texts = [
        (0, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": "x"}}\n</tool_call>'),
        (0, '<tool_call>\n{"name": "f", "arguments": {"a": "unfinished'),  # cut by length
        (0, 'a <tool_call>not json</tool_call> b <tool_call>{"name": "g"}</tool_call>'),
        (1, "ok" + ds),
        (1, ds[:40]),
        (2, "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
            "<|message|>Hi!<|return|>"),
        (2, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":1}<|call|>"),
        # the XML-style syntaxes (every input also goes through them): Qwen3 XML, GLM, MiniMax
        (0, "Ok.\n<tool_call>\n<function=f>\n<parameter=a>\n12\n</parameter>\n<parameter=d>\n"
            "{\"k\": [1]}\n</parameter>\n<parameter=s>\nx << y\n</parameter>\n</function>\n"
            "</tool_call>"),
        (0, "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2.5\n</function>"),
        (0, "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>3</arg_value>\n<arg_key>c</arg_key>"
            "<arg_value>true</arg_value>\n</tool_call><tool_call>g</tool_call>"),
        (0, "<minimax:tool_call>\n<invoke name=\"f\">\n<parameter name=\"e\">none</parameter>\n"
            "<parameter name=\"x\">y</parameter>\n</invoke>\n<invoke name=\"g\">\n</invoke>\n"
            "</minimax:tool_call>"),
    ]
    seeds = []
    for tok, t in texts:
        for flags in (0, 4 | 8, 16 | 32, 64):
            stops = b"" if not flags & 24 else b"</tool\x01\n\x01" if flags & 16 else b"}\x01"
            seeds.append(bytes([tok | flags, len(seeds)]) + stops + t.encode())
    return seeds


def grammar_seeds():
    """Selector byte 0 EBNF, 1 regex, 2 choices, 3 JSON Schema (fuzz_grammar.c), then the text;
    some carry a NUL and bytes for the matcher."""
    ebnf = [
        'root ::= "a" [0-9]+ ("x" | "yz")?  # comment\n',
        "root ::= item{2,3}\nitem ::= [a-b] | \"-\"",
        "root ::= [\\u00e9-\\u00fc]+ [^a-z]",
        'root ::= . "\\x01" ""',
        'root ::= ("a"*)*',
        'root ::= x* "a"\nx ::= "b"?',
        'root ::= (x y)+ "!"\nx ::= "a"* | ""\ny ::= z?\nz ::= "b" | x',
        'root ::= obj\nobj ::= "{" ws (pair ("," ws pair)*)? "}"\npair ::= [a-z]+ ":" ws obj\n'
        'ws ::= [ \\t]*',
        'root ::= ((("a"{0,1000}){0,1000}){0,1000})',
        "root ::= " + "(" * 256 + '"a"' + ")" * 256,
        "root ::= " + "(" * 257 + '"a"' + ")" * 257,
        "root ::= r0\n" + "".join('r%d ::= "x" | "<" r%d ">"\n' % (i, i + 1) for i in range(200)) +
        'r200 ::= "y"',
        "root ::= root \"a\" | \"b\"",
        "root ::= (root)* \"a\"",
    ]
    regexes = [
        "^[a-c]{2}\\d+(x|yz)?$", "(?P<year>[0-9]{4})-(?:0[1-9]|1[0-2])", "a.c|\\.\\*",
        "(a*)*b", "(.*)*x", "(a|b*)+c", "(a?)*", "((a*)*)*", "(a?b?)+c{2}", "a{,2}b{,}c{1,2,3}",
        "[]a]*[^]a-c\\d]", "\\x41\\u00e9[\\s\\w-]+?", "(|a|)*", "\\S\\W\\D",
        "(" * 256 + "a" + ")" * 256, "(" * 300 + "a" + ")" * 300, "a{1000}{1000}",
    ]
    here = os.path.join(TESTS, "fixtures", "regex_cases.txt")
    if os.path.exists(here):
        for line in open(here, encoding="utf-8"):
            if line.startswith("R ") and len(regexes) < 40:
                regexes.append(line[2:].rstrip("\n").replace("\\\\", "\\"))
    choices = ['["yes", "no", "n\\"a"]', '["", "a", "ab"]', "[]", '[1]']
    schemas = [
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                          "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                   "minItems": 1, "maxItems": 2},
                                          "when": {"type": "string", "format": "date"},
                                          "kind": {"anyOf": [{"const": 1}, {"type": "null"}]},
                                          "next": {"$ref": "#/$defs/node"}},
         "required": ["name", "tags"], "additionalProperties": False,
         "$defs": {"node": {"type": ["object", "null"],
                            "properties": {"next": {"$ref": "#/$defs/node"}}}}},
        {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
        {"type": "object", "properties": {"p%d" % i: {"type": "string"} for i in range(50)}},
        {"type": "array", "items": {"type": "number"}, "minItems": 2},
        {"type": "object", "additionalProperties": {"type": "boolean"}},
        {"type": "string", "format": "uuid"},
        {"type": "integer", "minimum": 3},
    ]
    seeds = [b"\x00" + e.encode() for e in ebnf]
    seeds += [b"\x01" + r.encode() for r in regexes]
    seeds += [b"\x02" + c.encode() for c in choices]
    seeds += [b"\x03" + json.dumps(s).encode() for s in schemas]
    # findings of earlier runs, minimized: a refused anyOf branch leaked the rule text
    seeds += [b'\x03{"anyOf":[{"const":1},{"t{1,}ype":"null"}]}']
    # ... and a grammar whose parse stacks multiply: the mask walk took seconds (timeout)
    seeds += [b'\x00root ::= (((."a"{0,1000}){0,1000}){0,1000})']
    seeds += [b"\x01(a|b*)+c\x00abbac", b"\x03" + json.dumps(schemas[0]).encode() +
              b'\x00{"name":"bob","tags":["a"]}', b'\x00root ::= [a-z]+ "!"\x00abc!']
    return seeds


if __name__ == "__main__":
    write("fuzz_output", output_seeds())
    write("fuzz_http", http_seeds())
    write("fuzz_proto", proto_seeds())
    write("fuzz_model_files", model_file_seeds())
    write("fuzz_jinja", jinja_seeds())
    write("fuzz_tokenizer", tokenizer_seeds())
    write("fuzz_grammar", grammar_seeds())
