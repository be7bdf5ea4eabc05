"""OpenAI's Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}, POST
/v1/responses/{id}/cancel) through the official `openai` SDK on the bundled model:
responses.create plain and streamed (the SDK's accumulated response equal to the non-streamed
one, the event sequence numbered in order), a function tool round trip (forced call, then
function_call_output, whole input and previous_response_id alike), text.format json_schema
valid by jsonschema at temperature 1 over many seeds, the store (retrieve, delete, store
false, cancel of a running response), errors naming the field as the Responses API spells it,
and the `openai-agents` Agents SDK running a tool-calling agent over /v1/responses. Then the
gpt-oss fixture with a template that reads reasoning_effort (reasoning.effort reaches it) and
Qwen3.5's template, whose opened <think> comes back as a reasoning item."""
import json
import os
import shutil
import threading
import unittest

import srvtest

try:
    import openai
    import jsonschema
except ImportError:  # pragma: no cover
    openai = None
try:
    import agents
except ImportError:  # pragma: no cover
    agents = None

NAME = "mohge-small"
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "add", "description": "Adds", "parameters": ADD}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def named_events(raw):
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-80:]
    out = []
    for block in text[:-2].split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        d = json.loads(data[6:])
        assert d["type"] == name[7:], block
        out.append(d)
    return out


@unittest.skipIf(openai is None, "openai and jsonschema are needed (tools/setup.sh)")
class ResponsesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(model=srvtest.bundled_model(), name=NAME).start()
        cls.client = openai.OpenAI(base_url=cls.srv.base + "/v1", api_key="none", max_retries=0,
                                   timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def test_create(self):
        r = self.client.responses.create(model=NAME, input="ROMEO:", max_output_tokens=16,
                                         instructions="Answer in verse.", temperature=0)
        self.assertTrue(r.id.startswith("resp_"))
        self.assertEqual((r.object, r.model), ("response", NAME))
        self.assertIn(r.status, ("completed", "incomplete"))
        self.assertEqual([o.type for o in r.output], ["message"])
        self.assertTrue(r.output_text)
        self.assertEqual(r.instructions, "Answer in verse.")
        self.assertLessEqual(r.usage.output_tokens, 16)
        self.assertEqual(r.usage.total_tokens, r.usage.input_tokens + r.usage.output_tokens)
        if r.status == "incomplete":
            self.assertEqual(r.incomplete_details.reason, "max_output_tokens")

    def test_stream_equals_create(self):
        kw = dict(model=NAME, input=[{"role": "user", "content": "ROMEO:"}], temperature=0,
                  max_output_tokens=24)
        whole = self.client.responses.create(**kw)
        deltas = []
        with self.client.responses.stream(**kw) as s:
            for ev in s:
                if ev.type == "response.output_text.delta":
                    deltas.append(ev.delta)
                last = ev
            # the SDK's final response needs response.completed; a cut one ends incomplete
            final = s.get_final_response() if whole.status == "completed" else last.response
        self.assertEqual("".join(deltas), whole.output_text)
        self.assertEqual(final.output_text, whole.output_text)
        self.assertEqual(final.status, whole.status)
        st, _, raw = srvtest.request(self.srv.port, "POST", "/v1/responses", dict(kw, stream=True))
        evs = named_events(raw)
        self.assertEqual([e["sequence_number"] for e in evs], list(range(len(evs))))
        self.assertEqual([e["type"] for e in evs[:4]],
                         ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added"])
        self.assertEqual(evs[-1]["type"], "response." + ("incomplete" if whole.status ==
                                                           "incomplete" else "completed"))

    def call_of(self, r):
        calls = [o for o in r.output if o.type == "function_call"]
        self.assertEqual(len(calls), 1, r.output)
        c = calls[0]
        self.assertEqual(c.name, "add")
        jsonschema.validate(json.loads(c.arguments), ADD)
        return c

    def test_function_round_trip(self):
        inp = [{"role": "user", "content": "What is 2 + 3?"}]
        r = self.client.responses.create(model=NAME, input=inp, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_output_tokens=200, temperature=1,
                                         extra_body={"seed": 4})
        c = self.call_of(r)
        args = json.loads(c.arguments)
        out = {"type": "function_call_output", "call_id": c.call_id,
               "output": str(args["a"] + args["b"])}
        # the whole conversation sent again
        r2 = self.client.responses.create(model=NAME, input=inp + [o.model_dump() for o in r.output]
                                          + [out], tools=TOOLS, tool_choice="none",
                                          max_output_tokens=8)
        self.assertEqual([o.type for o in r2.output], ["message"])
        # or continued from the store
        r3 = self.client.responses.create(model=NAME, previous_response_id=r.id, input=[out],
                                          tools=TOOLS, tool_choice="none", max_output_tokens=8)
        self.assertEqual(r3.previous_response_id, r.id)
        self.assertEqual(r3.usage.input_tokens, r2.usage.input_tokens)
        # streamed forced call: the arguments arrive as function_call_arguments events
        with self.client.responses.stream(model=NAME, input=inp, tools=TOOLS,
                                          tool_choice={"type": "function", "name": "add"},
                                          max_output_tokens=200, temperature=1,
                                          extra_body={"seed": 7}) as s:
            kinds = [ev.type for ev in s]
            final = s.get_final_response()
        self.assertIn("response.function_call_arguments.delta", kinds)
        self.call_of(final)

    def test_forced_tools_many_seeds(self):
        for seed in range(8):
            r = self.client.responses.create(model=NAME, input="What is 2 + 3?", tools=TOOLS,
                                             tool_choice="required", parallel_tool_calls=False,
                                             max_output_tokens=200, temperature=1,
                                             extra_body={"seed": seed})
            self.assertEqual(r.status, "completed", seed)
            self.call_of(r)

    def test_json_schema_many_seeds(self):
        for seed in range(8):
            r = self.client.responses.create(
                model=NAME, input="A person:", temperature=1, max_output_tokens=200,
                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                 "strict": True}}, extra_body={"seed": seed})
            self.assertEqual(r.status, "completed", seed)
            jsonschema.validate(json.loads(r.output_text), PERSON)
            self.assertEqual(r.text.format.type, "json_schema")

    def test_store(self):
        r = self.client.responses.create(model=NAME, input="ROMEO:", max_output_tokens=4,
                                         metadata={"k": "v"})
        got = self.client.responses.retrieve(r.id)
        self.assertEqual((got.id, got.output_text, got.metadata), (r.id, r.output_text, {"k": "v"}))
        self.client.responses.delete(r.id)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(r.id)
        r = self.client.responses.create(model=NAME, input="ROMEO:", max_output_tokens=4,
                                         store=False)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.retrieve(r.id)
        with self.assertRaises(openai.NotFoundError):
            self.client.responses.create(model=NAME, input="x", previous_response_id=r.id,
                                         max_output_tokens=2)
        st, h, _ = srvtest.request(self.srv.port, "PUT", "/v1/responses/" + r.id)
        self.assertEqual((st, h.get("allow")), (405, "GET, HEAD, DELETE"))

    def test_cancel_running(self):
        # one sequence at a time, three long requests ahead: the streamed one is in progress
        # (queued) for as long as they run, and is cancelled from another connection
        import http.client
        with srvtest.Server("--max-num-seqs", "1", model=srvtest.bundled_model(),
                            name=NAME) as srv:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
            long = {"model": NAME, "input": "ROMEO:", "max_output_tokens": 400, "min_tokens": 400}
            ahead = [threading.Thread(target=srvtest.post_json,
                                      args=(srv.port, "/v1/responses", long)) for _ in range(3)]
            for t in ahead:
                t.start()
            srvtest.wait_until(lambda: srvtest.parse_metrics(srvtest.request(
                srv.port, "GET", "/metrics")[2].decode()).total("moeserve_num_requests_running")
                + srvtest.parse_metrics(srvtest.request(srv.port, "GET", "/metrics")[2].decode())
                .total("moeserve_num_requests_waiting") >= 3, 60, "three requests ahead")
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
            c.request("POST", "/v1/responses", json.dumps(dict(long, stream=True)),
                      {"Content-Type": "application/json"})
            resp = c.getresponse()
            self.assertEqual(resp.status, 200)
            first = b""
            while b"response.in_progress" not in first:
                chunk = resp.read1(4096)
                self.assertTrue(chunk, first)
                first += chunk
            rid = json.loads(first.split(b"\n")[1][6:])["response"]["id"]
            self.assertEqual(client.responses.retrieve(rid).status, "in_progress")
            cancelled = client.responses.cancel(rid)
            self.assertEqual(cancelled.status, "cancelled")
            rest = first + resp.read()
            c.close()
            for t in ahead:
                t.join()
            evs = named_events(rest)
            self.assertEqual(evs[-1]["type"], "response.failed")
            self.assertEqual(evs[-1]["response"]["status"], "cancelled")
            self.assertLess(evs[-1]["response"]["usage"]["output_tokens"], 400)
            self.assertEqual(client.responses.retrieve(rid).status, "cancelled")
            with self.assertRaises(openai.BadRequestError):
                client.responses.cancel(rid)

    def test_errors(self):
        for body, param, status in (
                ({"input": "x", "n": 2}, "n", 400),
                ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", 400),
                ({"input": [{"role": "user", "content": [
                    {"type": "input_image", "image_url": "http://x/y.png"}]}]},
                 "input[0].content[0]", 400),
                ({"input": [{"type": "function_call_output", "call_id": "call_nope",
                             "output": "1"}]}, "input[0]", 400),
                ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", 400),
                ({"input": "x", "background": True}, "background", 400),
                ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", 400),
                ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary", 400),
                ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                   "schema": {"type": "object", "not": {}}}}},
                 "text.format", 400),
                ({}, "input", 400),
                ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id",
                 404)):
            st, _, out = srvtest.post_json(self.srv.port, "/v1/responses", body)
            self.assertEqual(st, status, (body, out))
            self.assertEqual(out["error"]["param"], param, (body, out))
        with self.assertRaises(openai.BadRequestError) as cm:
            self.client.responses.create(model=NAME, input="x", max_output_tokens=100000)
        self.assertEqual(cm.exception.body["param"], "max_output_tokens")


@unittest.skipIf(openai is None, "openai is needed (tools/setup.sh)")
class StoreBoundsTest(unittest.TestCase):
    """--response-store-size evicts the oldest finished responses; --response-store-ttl
    expires them; size 0 stores nothing."""

    def test_size_and_ttl(self):
        with srvtest.Server("--response-store-size", "2", "--response-store-ttl", "2",
                            model=srvtest.bundled_model(), name=NAME) as srv:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
            ids = [client.responses.create(model=NAME, input="ROMEO:", max_output_tokens=2).id
                   for _ in range(3)]
            with self.assertRaises(openai.NotFoundError):
                client.responses.retrieve(ids[0])
            self.assertEqual([client.responses.retrieve(i).id for i in ids[1:]], ids[1:])

            def expired():
                try:
                    client.responses.retrieve(ids[2])
                    return False
                except openai.NotFoundError:
                    return True
            srvtest.wait_until(expired, 30, "the stored response to expire", interval=0.2)
        with srvtest.Server("--response-store-size", "0", model=srvtest.bundled_model(),
                            name=NAME) as srv:
            client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
            r = client.responses.create(model=NAME, input="ROMEO:", max_output_tokens=2)
            with self.assertRaises(openai.NotFoundError):
                client.responses.retrieve(r.id)


@unittest.skipIf(openai is None or agents is None, "openai-agents is needed (tools/setup.sh)")
class AgentsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(model=srvtest.bundled_model(), name=NAME).start()

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def test_agent_with_tool(self):
        agents.set_tracing_disabled(True)
        calls = []

        @agents.function_tool
        def add(a: int, b: int) -> int:
            """Adds two integers."""
            calls.append((a, b))
            return a + b

        client = openai.AsyncOpenAI(base_url=self.srv.base + "/v1", api_key="none",
                                    max_retries=0, timeout=120)
        model = agents.OpenAIResponsesModel(model=NAME, openai_client=client)
        # the turn must call the tool (this model is not trained for tools: a forced call), and
        # its result is the run's output
        agent = agents.Agent(name="adder", instructions="Use the add tool.", tools=[add],
                             model=model, tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_tokens=120, temperature=1, extra_body={"seed": 1}))
        result = agents.Runner.run_sync(agent, "What is 2 + 3?", max_turns=4)
        self.assertEqual(len(calls), 1)
        self.assertEqual(result.final_output, str(sum(calls[0])))
        kinds = [item.type for item in result.new_items]
        self.assertEqual(kinds, ["tool_call_item", "tool_call_output_item"])
        # streamed, the same loop over the SDK's event stream (a client of its own event loop)
        calls.clear()

        async def streamed_run():
            c2 = openai.AsyncOpenAI(base_url=self.srv.base + "/v1", api_key="none",
                                    max_retries=0, timeout=120)
            a2 = agent.clone(model=agents.OpenAIResponsesModel(model=NAME, openai_client=c2))
            run = agents.Runner.run_streamed(a2, "What is 4 + 4?", max_turns=4)
            async for _ in run.stream_events():
                pass
            return run
        import asyncio
        streamed = asyncio.run(streamed_run())
        self.assertEqual(len(calls), 1)
        self.assertEqual(streamed.final_output, str(sum(calls[0])))


@unittest.skipIf(openai is None, "openai is needed (tools/setup.sh)")
class ReasoningTest(unittest.TestCase):
    """reasoning.effort on the gpt-oss fixture (a stand-in template that reads it, as harmony's
    does), and a Qwen3.5 template's opened <think> as a reasoning item."""

    def test_effort_reaches_the_template(self):
        from test_templates import EFFORT_TEMPLATE, fixture_copy
        folder = fixture_copy("gpt_oss", EFFORT_TEMPLATE)
        try:
            with srvtest.Server(model=folder, name="g") as srv:
                client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
                for effort in ("low", "high"):
                    want = srvtest.tokenize(srv.port, "Reasoning: %s\nuser: Hi\n" % effort)
                    r = client.responses.create(model="g", input="Hi", max_output_tokens=2,
                                                reasoning={"effort": effort})
                    self.assertEqual(r.usage.input_tokens, len(want), effort)
                    self.assertEqual(r.reasoning.effort, effort)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def test_reasoning_item(self):
        from test_templates import fixture_copy
        with open(os.path.join(srvtest.tests_dir(), "fixtures", "chat", "qwen3_5.jinja"),
                  encoding="utf-8") as f:
            folder = fixture_copy("qwen3_5_moe", f.read())
        try:
            with srvtest.Server("--reasoning-parser", "qwen3", model=folder, name="q") as srv:
                client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
                kw = dict(model="q", input="Hi", max_output_tokens=40, temperature=0,
                          extra_body={"ignore_eos": True})
                r = client.responses.create(**kw)
                self.assertEqual([o.type for o in r.output], ["reasoning"])
                text = r.output[0].content[0].text
                self.assertTrue(text)
                self.assertGreater(r.usage.output_tokens_details.reasoning_tokens, 0)
                streamed = ""
                with client.responses.stream(**kw) as s:
                    for ev in s:
                        if ev.type == "response.reasoning_text.delta":
                            streamed += ev.delta
                        last = ev
                final = last.response  # cut by max_output_tokens: response.incomplete
                self.assertEqual(final.status, "incomplete")
                self.assertEqual(streamed, text)
                self.assertEqual(final.output[0].content[0].text, text)
                # the reasoning item goes back into the next turn's input
                r2 = client.responses.create(model="q", max_output_tokens=4, input=[
                    {"role": "user", "content": "Hi"}] + [o.model_dump() for o in r.output] +
                    [{"role": "user", "content": "Go on"}])
                self.assertIn(r2.status, ("completed", "incomplete"))
        finally:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    srvtest.main()
