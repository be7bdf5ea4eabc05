"""Tool calling through the official openai client on the bundled model: tool_choice
"required" and a named function (enforced by the grammar sampler, so even a model never trained
on tools answers with a well-formed call), streaming (delta.tool_calls) and not, the arguments
valid against the function's parameter schema, finish_reason "tool_calls", a role "tool"
round trip (assistant tool_calls + tool message with tool_call_id), tool_choice "none" and
"auto" answering in text, and refusals (a forced call with response_format, an unknown
function name). Then the XML-style syntaxes (--tool-call-parser qwen3_coder, glm45,
minimax_m2, and its environment variable): forced calls in each come back as typed arguments
valid against the schema, streamed and not alike; a bad parser name stops the server."""
import json
import subprocess
import unittest

import srvtest

try:
    import openai
    import jsonschema
except ImportError:  # pragma: no cover
    openai = None

NAME = "mohge-small"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]



@unittest.skipIf(openai is None, "openai and jsonschema are needed (tools/setup.sh)")
class ToolsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(model=srvtest.bundled_model(), name=NAME).start()
        cls.client = openai.OpenAI(base_url=cls.srv.base + "/v1", api_key="unused",
                                   max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def check_call(self, name, arguments, want=None):
        self.assertIn(name, PARAMS)
        if want:
            self.assertEqual(name, want)
        args = json.loads(arguments)
        jsonschema.validate(args, PARAMS[name])
        return args

    def test_required_non_streaming(self):
        for seed in range(4):
            r = self.client.chat.completions.create(
                model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=1,
                seed=seed, max_tokens=200, parallel_tool_calls=False)
            c = r.choices[0]
            self.assertEqual(c.finish_reason, "tool_calls")
            self.assertIsNone(c.message.content)
            self.assertEqual(len(c.message.tool_calls), 1)
            tc = c.message.tool_calls[0]
            self.assertEqual(tc.type, "function")
            self.assertTrue(tc.id.startswith("call_"))
            self.check_call(tc.function.name, tc.function.arguments)

    def test_named_streaming(self):
        stream = self.client.chat.completions.create(
            model=NAME, messages=MSGS, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}}, temperature=1,
            seed=5, max_tokens=200, parallel_tool_calls=False, stream=True)
        calls, content, finish = {}, "", None
        for chunk in stream:
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                cur = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                cur["id"] = tc.id or cur["id"]
                cur["name"] += tc.function.name or ""
                cur["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        self.assertEqual(finish, "tool_calls")
        self.assertEqual(content, "")
        self.assertEqual(list(calls), [0])
        self.check_call(calls[0]["name"], calls[0]["arguments"], want="add")

    def test_named_gives_one_call(self):
        # parallel_tool_calls left unset (true by default): a named choice still asks for that
        # one call, as vLLM answers it, never a run of repeats
        for seed in range(6):
            r = self.client.chat.completions.create(
                model=NAME, messages=MSGS, tools=TOOLS, temperature=1, seed=seed,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=300)
            c = r.choices[0]
            self.assertEqual(c.finish_reason, "tool_calls", "seed %d" % seed)
            self.assertEqual(len(c.message.tool_calls), 1, "seed %d" % seed)
            self.check_call(c.message.tool_calls[0].function.name,
                            c.message.tool_calls[0].function.arguments, want="get_weather")

    def test_streamed_forced_call_cut_by_length(self):
        # Issue 29's reproducer: a forced call still open when max_tokens ends the output is
        # flushed as content. The streamed flush once wrote past a buffer sized for the text
        # since the last chunk (it starts at the open marker, before that) and killed the
        # server; seed 3 did it every time. The stream must end cleanly and say what the
        # non-streamed answer says.
        tools = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}]
        for seed in list(range(8)) + [3, 11, 17]:
            body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                    "tool_choice": "required", "seed": seed, "temperature": 0.8,
                    "max_tokens": 100}
            st, _, whole = srvtest.post_json(self.srv.port, "/v1/chat/completions", body)
            self.assertEqual(st, 200, whole)
            st, _, raw = srvtest.request(self.srv.port, "POST", "/v1/chat/completions",
                                         dict(body, stream=True))
            self.assertEqual(st, 200, raw[:300])
            events = srvtest.sse_events(raw)
            self.assertEqual(events[-1], "[DONE]", "seed %d" % seed)
            content, names, finish = "", [], None
            for ev in events[:-1]:
                ch = json.loads(ev)["choices"][0]
                content += ch["delta"].get("content") or ""
                names += [t["function"]["name"] for t in ch["delta"].get("tool_calls") or []
                          if t["function"].get("name")]
                finish = ch["finish_reason"] or finish
            msg = whole["choices"][0]["message"]
            self.assertEqual(finish, whole["choices"][0]["finish_reason"], "seed %d" % seed)
            self.assertEqual(content.strip(), (msg.get("content") or "").strip(),
                             "seed %d" % seed)
            self.assertEqual(names, [t["function"]["name"] for t in msg.get("tool_calls") or []])
        st, _, _ = srvtest.request(self.srv.port, "GET", "/health")
        self.assertEqual(st, 200)

    def test_round_trip_and_text_modes(self):
        r = self.client.chat.completions.create(
            model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required", temperature=0,
            max_tokens=200, parallel_tool_calls=False)
        tc = r.choices[0].message.tool_calls[0]
        msgs = MSGS + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": tc.id, "type": "function",
                 "function": {"name": tc.function.name, "arguments": tc.function.arguments}}]},
            {"role": "tool", "tool_call_id": tc.id, "content": "sunny, 21 C"}]
        for choice in ("none", "auto"):
            r = self.client.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS,
                                                    tool_choice=choice, max_tokens=12,
                                                    temperature=0)
            c = r.choices[0]
            self.assertIn(c.finish_reason, ("stop", "length"))
            self.assertIsInstance(c.message.content, str)
        # the tool message reached the template: the prompt holds its content
        st, _, tok = srvtest.post_json(self.srv.port, "/tokenize", {"messages": msgs})
        self.assertEqual(st, 200)
        st, _, text = srvtest.post_json(self.srv.port, "/detokenize", {"tokens": tok["tokens"]})
        self.assertIn("sunny, 21 C", text["prompt"])

    def test_refusals(self):
        with self.assertRaises(openai.BadRequestError) as cm:
            self.client.chat.completions.create(
                model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=5,
                response_format={"type": "json_object"})
        self.assertIn("tool_choice", str(cm.exception))
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(
                model=NAME, messages=MSGS, tools=TOOLS, max_tokens=5,
                tool_choice={"type": "function", "function": {"name": "nope"}})


def streamed_calls(stream):
    calls, content, finish = {}, "", None
    for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            cur = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            cur["name"] += tc.function.name or ""
            cur["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [calls[i] for i in sorted(calls)], content, finish


@unittest.skipIf(openai is None, "openai and jsonschema are needed (tools/setup.sh)")
class XmlSyntaxesTest(unittest.TestCase):
    """The grammar writes each syntax's markup; the parser must read it back into calls whose
    typed arguments validate (days an integer, city a string of at most 16 characters)."""

    def run_parser(self, parser, env=None):
        extra = () if env else ("--tool-call-parser", parser)
        with srvtest.Server(*extra, model=srvtest.bundled_model(), name=NAME, env=env) as srv:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0,
                                   timeout=120)
            n_calls = 0
            for seed in range(3):
                kw = dict(model=NAME, messages=MSGS, tools=TOOLS, tool_choice="required",
                          temperature=1, seed=seed, max_tokens=400, parallel_tool_calls=False)
                r = client.chat.completions.create(**kw)
                c = r.choices[0]
                if c.finish_reason == "length":
                    continue  # free text ran past max_tokens: content, as for hermes
                self.assertEqual(c.finish_reason, "tool_calls", "%s seed %d" % (parser, seed))
                whole = [{"name": t.function.name, "arguments": t.function.arguments}
                         for t in c.message.tool_calls]
                for call in whole:
                    self.assertIn(call["name"], PARAMS)
                    jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])
                n_calls += len(whole)
                calls, content, finish = streamed_calls(
                    client.chat.completions.create(stream=True, **kw))
                self.assertEqual(finish, "tool_calls")
                self.assertEqual(content.strip(), (c.message.content or "").strip())
                self.assertEqual(calls, whole, "%s seed %d" % (parser, seed))
            named = client.chat.completions.create(
                model=NAME, messages=MSGS, tools=TOOLS, temperature=1, seed=7, max_tokens=200,
                tool_choice={"type": "function", "function": {"name": "add"}})
            tc = named.choices[0].message.tool_calls
            self.assertEqual(len(tc), 1)
            args = json.loads(tc[0].function.arguments)
            jsonschema.validate(args, ADD)
            self.assertIsInstance(args["a"], int)
            self.assertGreater(n_calls, 0, parser)

    def test_qwen3_coder(self):
        self.run_parser("qwen3_coder")

    def test_glm45(self):
        self.run_parser("glm45")

    def test_minimax_m2_from_env(self):
        self.run_parser("minimax_m2", env={"MOESERVE_TOOL_CALL_PARSER": "minimax_m2"})

    def test_bad_parser_name(self):
        r = subprocess.run([srvtest.binary(), "serve", "--tool-call-parser", "nope", "--port", "0"],
                           capture_output=True, text=True, timeout=60)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--tool-call-parser", r.stderr)


if __name__ == "__main__":
    srvtest.main()
