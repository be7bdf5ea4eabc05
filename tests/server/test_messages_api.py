"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` Python SDK on the bundled model: messages.create, messages.stream (text, tool use,
the SDK's accumulated final message equal to the non-streamed one), count_tokens equal to the
prompt a create counts, stop_sequences reported as stop_sequence with the one that matched, a
two-turn tool conversation (tool_use, tool_result), forced tool calls (any / tool) valid
against their input_schema at temperature 1 over many seeds, the SDK's tool runner, x-api-key
and Bearer auth, errors raised as the SDK's exception classes with Anthropic's error body
naming the field, the exact SSE event order, a client leaving mid-stream, and the per-route
metrics. Then Qwen3.5's template (which opens <think>): `thinking` enabled gives a thinking
block, disabled a text block, streamed as whole; a template without enable_thinking refuses it."""
import json
import os
import shutil
import socket
import unittest

import srvtest

try:
    import anthropic
    import jsonschema
except ImportError:  # pragma: no cover
    anthropic = None

NAME = "mohge-small"
KEY = "sk-test-messages"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
         {"name": "add", "description": "Adds two integers", "input_schema": ADD}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "ROMEO:"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def events(raw):
    """(event name, data) pairs of a named-event SSE body, checking the framing."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-80:]
    out = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = json.loads(lines[1][6:])
        assert data["type"] == lines[0][7:], block
        out.append((lines[0][7:], data))
    return out


@unittest.skipIf(anthropic is None, "anthropic and jsonschema are needed (tools/setup.sh)")
class MessagesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server("--api-key", KEY, model=srvtest.bundled_model(), name=NAME).start()
        cls.client = anthropic.Anthropic(base_url=cls.srv.base, api_key=KEY, max_retries=0,
                                         timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def post(self, path, body, key=KEY):
        return srvtest.post_json(self.srv.port, path, body, headers={"x-api-key": key})

    def test_create(self):
        m = self.client.messages.create(model=NAME, max_tokens=16, messages=USER,
                                        system="You are a poet.", extra_body={"temperature": 0})
        self.assertEqual((m.type, m.role, m.model), ("message", "assistant", NAME))
        self.assertTrue(m.id.startswith("msg_"))
        self.assertEqual([b.type for b in m.content], ["text"])
        self.assertTrue(m.content[0].text)
        self.assertIn(m.stop_reason, ("end_turn", "max_tokens"))
        self.assertLessEqual(m.usage.output_tokens, 16)
        self.assertGreater(m.usage.input_tokens + m.usage.cache_read_input_tokens, 0)

    def test_stream_equals_create(self):
        kw = dict(model=NAME, max_tokens=24, messages=USER, extra_body={"temperature": 0})
        whole = self.client.messages.create(**kw)
        with self.client.messages.stream(**kw) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        self.assertEqual(text, whole.content[0].text)
        self.assertEqual(final.content[0].text, whole.content[0].text)
        self.assertEqual(final.stop_reason, whole.stop_reason)
        self.assertEqual(final.usage.output_tokens, whole.usage.output_tokens)

    def test_event_sequence(self):
        st, _, raw = srvtest.request(self.srv.port, "POST", "/v1/messages",
                                     {"max_tokens": 8, "messages": USER, "stream": True},
                                     headers={"x-api-key": KEY})
        self.assertEqual(st, 200, raw[:300])
        names = [n for n, _ in events(raw)]
        self.assertEqual(names[:3], ["message_start", "ping", "content_block_start"])
        self.assertEqual(names[-4:], ["content_block_delta", "content_block_stop", "message_delta",
                                      "message_stop"])
        self.assertEqual(set(names[3:-3]), {"content_block_delta"})

    def test_stop_sequence(self):
        base = self.client.messages.create(model=NAME, max_tokens=24, messages=USER,
                                           extra_body={"temperature": 0}).content[0].text
        stop = base[6:9]
        self.assertEqual(len(stop), 3, base)
        want = base[:base.index(stop)]
        m = self.client.messages.create(model=NAME, max_tokens=24, messages=USER,
                                        stop_sequences=["@@never@@", stop],
                                        extra_body={"temperature": 0})
        self.assertEqual((m.stop_reason, m.stop_sequence), ("stop_sequence", stop))
        self.assertEqual(m.content[0].text if m.content else "", want)
        with self.client.messages.stream(model=NAME, max_tokens=24, messages=USER,
                                         stop_sequences=[stop],
                                         extra_body={"temperature": 0}) as s:
            streamed = "".join(s.text_stream)
            final = s.get_final_message()
        self.assertEqual(streamed, want)
        self.assertEqual((final.stop_reason, final.stop_sequence), ("stop_sequence", stop))

    def check_tool(self, block, want=None):
        self.assertEqual(block.type, "tool_use")
        self.assertTrue(block.id.startswith("toolu_"))
        if want:
            self.assertEqual(block.name, want)
        jsonschema.validate(block.input, SCHEMAS[block.name])

    def test_forced_tools_many_seeds(self):
        for seed in range(8):
            m = self.client.messages.create(
                model=NAME, max_tokens=200, messages=USER, tools=TOOLS,
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                extra_body={"seed": seed, "temperature": 1})
            self.assertEqual(m.stop_reason, "tool_use", seed)
            uses = [b for b in m.content if b.type == "tool_use"]
            self.assertEqual(len(uses), 1, seed)
            self.check_tool(uses[0])

    def test_output_format_many_seeds(self):
        fmt = {"format": {"type": "json_schema", "schema": PERSON}}
        for seed in range(8):
            m = self.client.messages.create(model=NAME, max_tokens=200, messages=USER,
                                            output_config=fmt,
                                            extra_body={"seed": seed, "temperature": 1})
            self.assertEqual(m.stop_reason, "end_turn", seed)
            jsonschema.validate(json.loads(m.content[0].text), PERSON)
        st, _, out = self.post("/v1/messages", {"max_tokens": 4, "messages": USER,
                                                "output_config": {"format": {
                                                    "type": "json_schema",
                                                    "schema": {"type": "object", "not": {}}}}})
        self.assertEqual(st, 400, out)
        self.assertTrue(out["error"]["message"].startswith("output_config.format"), out)

    def test_limits_in_anthropic_shape(self):
        st, _, out = self.post("/v1/messages", {"max_tokens": 4, "messages": USER,
                                                "system": "x" * (1 << 20)})
        self.assertEqual(st, 413)
        self.assertEqual(out["error"]["type"], "request_too_large")
        # the access log has a line per request of these routes
        srvtest.wait_until(lambda: "/v1/messages" in self.srv.output(), 10, "an access-log line")

    def test_streamed_tool_use(self):
        with self.client.messages.stream(model=NAME, max_tokens=200, messages=USER, tools=TOOLS,
                                         extra_body={"seed": 3, "temperature": 1},
                                         tool_choice={"type": "tool", "name": "add"}) as s:
            kinds = [ev.type for ev in s]
            final = s.get_final_message()
        self.assertIn("input_json", kinds)
        self.assertEqual(final.stop_reason, "tool_use")
        self.assertEqual(len(final.content), 1)
        self.check_tool(final.content[0], want="add")

    def test_two_turns(self):
        m = self.client.messages.create(model=NAME, max_tokens=200, messages=USER, tools=TOOLS,
                                        tool_choice={"type": "tool", "name": "add"},
                                        extra_body={"seed": 1})
        use = m.content[-1]
        self.check_tool(use, want="add")
        history = USER + [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                          {"role": "user", "content": [
                              {"type": "tool_result", "tool_use_id": use.id,
                               "content": str(use.input["a"] + use.input["b"])},
                              {"type": "text", "text": "And so?"}]}]
        m2 = self.client.messages.create(model=NAME, max_tokens=12, messages=history, tools=TOOLS,
                                         tool_choice={"type": "none"})
        self.assertIn(m2.stop_reason, ("end_turn", "max_tokens"))
        self.assertEqual([b.type for b in m2.content], ["text"])
        # the tool result and the call are in the prompt: it is longer than the first turn's
        self.assertGreater(m2.usage.input_tokens + m2.usage.cache_read_input_tokens,
                           m.usage.input_tokens + m.usage.cache_read_input_tokens)
        n = self.client.messages.count_tokens(model=NAME, messages=history, tools=TOOLS)
        self.assertEqual(n.input_tokens,
                         m2.usage.input_tokens + m2.usage.cache_read_input_tokens)

    def test_count_tokens(self):
        n = self.client.messages.count_tokens(model=NAME, messages=USER, system="Be brief.")
        m = self.client.messages.create(model=NAME, max_tokens=1, messages=USER,
                                        system="Be brief.")
        self.assertEqual(n.input_tokens, m.usage.input_tokens + m.usage.cache_read_input_tokens)
        self.assertGreater(n.input_tokens, 0)

    def test_tool_runner(self):
        calls = []

        @anthropic.beta_tool
        def add(a: int, b: int) -> str:
            """Adds two integers.

            Args:
                a: the first
                b: the second
            """
            calls.append((a, b))
            return str(a + b)

        runner = self.client.beta.messages.tool_runner(
            model=NAME, max_tokens=300, tools=[add],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"seed": 2},
            messages=[{"role": "user", "content": "What is 2 + 3?"}], max_iterations=4,
            thread=False)  # server-side threads are refused by name: the plain loop
        replies = []
        for message in runner:
            replies.append(message)
            if len(replies) == 1:
                self.assertEqual(message.stop_reason, "tool_use", message)
                # the call ran; the next turn may answer in text
                runner.set_messages_params(lambda p: {**p, "tool_choice": {"type": "none"}})
        self.assertEqual(len(calls), 1)
        self.assertIsInstance(calls[0][0], int)
        self.assertEqual(len(replies), 2)
        self.assertNotEqual(replies[-1].stop_reason, "tool_use")

    def test_errors(self):
        with self.assertRaises(anthropic.BadRequestError) as cm:
            self.client.messages.create(model=NAME, messages=USER,
                                        max_tokens=anthropic.omit)  # type: ignore
        self.assertIn("max_tokens", str(cm.exception))
        self.assertEqual(cm.exception.body["type"], "error")
        self.assertEqual(cm.exception.body["error"]["type"], "invalid_request_error")
        for body, field in (
                ({"max_tokens": 4, "messages": USER, "n": 2}, "n"),
                ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": "AAAA"}}]}]},
                 "messages[0].content[0]"),
                ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "document", "source": {"type": "text", "data": "x"}}]}]},
                 "messages[0].content[0]"),
                ({"max_tokens": 4, "messages": [{"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}]},
                 "toolu_nope"),
                ({"max_tokens": 4, "messages": USER, "tools": [
                    {"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
                ({"max_tokens": 4, "messages": USER, "temperature": 500}, "temperature"),
                ({"max_tokens": 4, "messages": USER + [{"role": "assistant", "content": "Once"}]},
                 "messages[1]"),
                ({"max_tokens": 4, "messages": USER, "stop_sequences": "x"}, "stop_sequences"),
                ({"max_tokens": 4, "messages": USER, "thinking": {"type": "enabled",
                                                                 "budget_tokens": 2000}},
                 "thinking")):
            st, _, out = self.post("/v1/messages", body)
            self.assertEqual(st, 400, (body, out))
            self.assertEqual(out["type"], "error")
            self.assertEqual(out["error"]["type"], "invalid_request_error")
            self.assertIn(field, out["error"]["message"], body)
        with self.assertRaises(anthropic.NotFoundError):
            self.client.messages.create(model="claude-nope", max_tokens=4, messages=USER)
        bad = anthropic.Anthropic(base_url=self.srv.base, api_key="wrong", max_retries=0)
        with self.assertRaises(anthropic.AuthenticationError) as cm:
            bad.messages.create(model=NAME, max_tokens=4, messages=USER)
        self.assertEqual(cm.exception.body["error"]["type"], "authentication_error")
        with self.assertRaises(anthropic.AuthenticationError):
            bad.messages.count_tokens(model=NAME, messages=USER)

    def test_bearer_and_x_api_key(self):
        for hdr in ({"Authorization": "Bearer " + KEY}, {"x-api-key": KEY}):
            st, _, _ = srvtest.request(self.srv.port, "POST", "/v1/messages",
                                       {"max_tokens": 2, "messages": USER}, headers=hdr)
            self.assertEqual(st, 200, hdr)
            st, _, _ = srvtest.request(self.srv.port, "POST", "/v1/chat/completions",
                                       {"max_tokens": 2, "messages": USER}, headers=hdr)
            self.assertEqual(st, 200, hdr)
        st, h, _ = srvtest.request(self.srv.port, "GET", "/v1/messages",
                                   headers={"x-api-key": KEY})
        self.assertEqual((st, h.get("allow")), (405, "POST"))

    def test_disconnect_mid_stream(self):
        body = json.dumps({"max_tokens": 400, "messages": USER, "stream": True,
                           "extra": None}).encode()
        body = json.dumps({"max_tokens": 400, "messages": USER, "stream": True,
                           "min_tokens": 400}).encode()
        s = socket.create_connection(("127.0.0.1", self.srv.port), timeout=30)
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                  + body)
        got = b""
        while b"content_block_delta" not in got:
            chunk = s.recv(4096)
            self.assertTrue(chunk)
            got += chunk
        s.close()

        def idle():
            st, _, raw = srvtest.request(self.srv.port, "GET", "/metrics")
            m = srvtest.parse_metrics(raw.decode())
            return m.total("moeserve_num_requests_running") == 0
        srvtest.wait_until(idle, 60, "the abandoned stream's request to be cancelled")
        st, _, out = self.post("/v1/messages", {"max_tokens": 2, "messages": USER})
        self.assertEqual(st, 200, out)

    def test_metrics_per_route(self):
        self.post("/v1/messages/count_tokens", {"messages": USER})
        self.post("/v1/messages", {"messages": USER})  # 400: no max_tokens
        st, _, raw = srvtest.request(self.srv.port, "GET", "/metrics")
        m = srvtest.parse_metrics(raw.decode())
        self.assertGreaterEqual(m.total("moeserve_http_requests_total",
                                        route="/v1/messages/count_tokens", code="200"), 1)
        self.assertGreaterEqual(m.total("moeserve_http_requests_total", route="/v1/messages",
                                        code="400"), 1)


@unittest.skipIf(anthropic is None, "anthropic is needed (tools/setup.sh)")
class ThinkingTest(unittest.TestCase):
    """Qwen3.5's template opens <think> unless enable_thinking is false: `thinking` maps to it."""

    @classmethod
    def setUpClass(cls):
        from test_templates import fixture_copy
        with open(os.path.join(srvtest.tests_dir(), "fixtures", "chat", "qwen3_5.jinja"),
                  encoding="utf-8") as f:
            cls.folder = fixture_copy("qwen3_5_moe", f.read())
        cls.srv = srvtest.Server("--reasoning-parser", "qwen3", model=cls.folder,
                                 name="q").start()
        cls.client = anthropic.Anthropic(base_url=cls.srv.base, api_key="none", max_retries=0,
                                         timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)
        shutil.rmtree(cls.folder, ignore_errors=True)

    def test_thinking_switch(self):
        kw = dict(model="q", max_tokens=300, messages=[{"role": "user", "content": "Hi"}],
                  extra_body={"ignore_eos": True, "temperature": 0})
        # the reasoning never closes here: budget_tokens stops it, reported as max_tokens
        budget = {"type": "enabled", "budget_tokens": 20}
        on = self.client.messages.create(thinking=budget, **kw)
        self.assertEqual([b.type for b in on.content], ["thinking"])
        self.assertEqual(on.stop_reason, "max_tokens")
        self.assertTrue(20 <= on.usage.output_tokens <= 22, on.usage)
        thinking = ""
        with self.client.messages.stream(thinking=budget, **kw) as s:
            for ev in s:
                if ev.type == "thinking":
                    thinking += ev.thinking
            final = s.get_final_message()
        self.assertEqual(final.stop_reason, "max_tokens")
        self.assertTrue(20 <= final.usage.output_tokens <= 22, final.usage)
        self.assertEqual(final.content[0].thinking, thinking)
        short, long = sorted((thinking, on.content[0].thinking), key=len)
        self.assertTrue(long.startswith(short))
        kw["max_tokens"] = 12
        off = self.client.messages.create(thinking={"type": "disabled"}, **kw)
        self.assertEqual([b.type for b in off.content], ["text"])
        # a thinking block sent back reaches the template as reasoning_content
        hist = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "Hello"}]},
                {"role": "user", "content": "Again"}]
        n = self.client.messages.count_tokens(model="q", messages=hist)
        self.assertGreater(n.input_tokens, 0)


if __name__ == "__main__":
    srvtest.main()
