"""Every field of OpenAI's and vLLM's completion and chat request schemas is either implemented
or refused with 400 naming it (`param`), never silently ignored; the fields moeserve accepts
with no effect are exactly README.md's allow-list. Then the behaviour of the sampling and
output fields, through the official openai client: logit_bias -100 changes the greedy output
and +100 forces a token, allowed_token_ids, stop_token_ids, min_tokens,
include_stop_str_in_output, best_of (the best of the samples n would return), prompt_logprobs
on both endpoints, echo with logprobs, return_tokens_as_token_ids, truncate_prompt_tokens,
cache_salt, GET /v1/models/{id}, /version and /tokenizer_info."""
import json
import os
import re
import unittest

import srvtest

try:
    import openai
except ImportError:  # pragma: no cover
    openai = None

NAME = "fixture-mixtral"
MSGS = [{"role": "user", "content": "Say hello."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# field -> (a value that asks for something, what the server does: "impl", "noop", "unsup")
COMMON = {
    "model": (NAME, "impl"), "frequency_penalty": (0.5, "impl"), "presence_penalty": (0.5, "impl"),
    "logit_bias": ({"5": 2}, "impl"), "max_tokens": (3, "impl"), "n": (2, "impl"),
    "seed": (7, "impl"), "stop": (["x"], "impl"), "stream": (False, "impl"),
    "temperature": (0.5, "impl"), "top_p": (0.9, "impl"), "best_of": (2, "impl"),
    "response_format": ({"type": "text"}, "impl"),
    "user": ("u-1", "noop"), "metadata": ({"k": "v"}, "noop"), "store": (True, "noop"),
    "service_tier": ("auto", "noop"), "safety_identifier": ("s", "noop"),
    "prompt_cache_key": ("k", "noop"), "prompt_cache_retention": ("in-memory", "noop"),
    # vLLM
    "top_k": (5, "impl"), "min_p": (0.1, "impl"), "repetition_penalty": (1.1, "impl"),
    "ignore_eos": (True, "impl"), "min_tokens": (1, "impl"), "stop_token_ids": ([3], "impl"),
    "include_stop_str_in_output": (True, "impl"), "skip_special_tokens": (False, "impl"),
    "spaces_between_special_tokens": (False, "noop"), "prompt_logprobs": (1, "impl"),
    "allowed_token_ids": ([3, 4, 5], "impl"), "truncate_prompt_tokens": (2, "impl"),
    "return_tokens_as_token_ids": (True, "impl"), "add_special_tokens": (False, "impl"),
    "cache_salt": ("salt", "impl"), "guided_json": ({"type": "integer"}, "impl"),
    "guided_regex": ("[ab]{2}", "impl"), "guided_choice": (["yes", "no"], "impl"),
    "guided_grammar": ('root ::= "a" | "b"', "impl"), "guided_decoding_backend": ("x", "noop"),
    "request_id": ("r-1", "noop"), "use_beam_search": (True, "unsup"),
    "length_penalty": (0.5, "unsup"), "bad_words": (["x"], "unsup"),
    "logits_processors": (["x"], "unsup"), "return_token_ids": (True, "unsup"),
    "priority": (1, "unsup"), "kv_transfer_params": ({"a": 1}, "unsup"),
    "vllm_xargs": ({"a": 1}, "unsup"), "guided_whitespace_pattern": (" ", "unsup"),
    "structural_tag": ("{}", "unsup"), "structured_outputs": ({"choice": ["a"]}, "unsup"),
    "moe_top_k": (1, "impl"), "moe_tag": ("math", "impl"),
    # continuous-experts budget: 400 naming the field on a model that is not continuous (the
    # fixture's mixtral); accepted on infmoe models (test_infmoe.py)
    "moe_samples": (2, "model"), "moe_neuron_fraction": (0.1, "model"),
    "moe_samples_adaptive": (True, "model"),
    # true asks for speculative decoding, which this server runs without (test_spec.py)
    "speculative": (True, "model"),
}
COMPLETIONS = dict(COMMON, **{
    "prompt": ("Hi", "impl"), "echo": (True, "impl"), "logprobs": (2, "impl"),
    "suffix": ("end", "unsup"), "prompt_embeds": ("AAAA", "unsup"),
    "stream_options": ({"include_usage": True}, "impl"),
})
CHAT = dict(COMMON, **{
    "messages": (MSGS, "impl"), "max_completion_tokens": (3, "impl"), "logprobs": (True, "impl"),
    "top_logprobs": (2, "impl"), "tools": (TOOLS, "impl"), "tool_choice": ("none", "impl"),
    "parallel_tool_calls": (False, "impl"), "functions": ([{"name": "f"}], "unsup"),
    "function_call": ("auto", "unsup"), "audio": ({"voice": "x"}, "unsup"),
    "modalities": (["text", "audio"], "unsup"), "prediction": ({"type": "content"}, "unsup"),
    # refused here: the fixture's ChatML template does not read it (test_templates.py passes it)
    "reasoning_effort": ("low", "unsup"), "web_search_options": ({}, "unsup"),
    "verbosity": ("low", "unsup"), "add_generation_prompt": (True, "impl"),
    "chat_template_kwargs": ({"enable_thinking": False}, "impl"),
    "continue_final_message": (True, "unsup"), "chat_template": ("{{ x }}", "unsup"),
    "documents": ([{"text": "x"}], "unsup"), "mm_processor_kwargs": ({"a": 1}, "unsup"),
    "echo": (True, "unsup"), "stream_options": ({"include_usage": True}, "impl"),
})
# fields that need a companion to mean something
NEEDS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
         "tool_choice": {"tools": TOOLS}, "parallel_tool_calls": {"tools": TOOLS},
         "include_stop_str_in_output": {"stop": ["x"]}, "best_of": {"n": 1}}


def readme_allow_list():
    with open(os.path.join(os.path.dirname(srvtest.tests_dir()), "README.md")) as f:
        text = f.read()
    m = re.search(r"accepted with no\s+effect[^:]*:\s*\n((?:.+\n)+?)\n", text)
    assert m, "README.md has no allow-list paragraph ('accepted with no effect ...:')"
    return set(re.findall(r"`([a-z_]+)`", m.group(1)))


@unittest.skipIf(openai is None, "the openai package is not installed (tools/setup.sh)")
class FieldsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(name=NAME).start()
        cls.port = cls.srv.port
        cls.client = openai.OpenAI(base_url=cls.srv.base + "/v1", api_key="unused",
                                   max_retries=0, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def post(self, path, body):
        return srvtest.post_json(self.port, path, body)

    def walk(self, path, fields, base):
        for field, (value, how) in sorted(fields.items()):
            body = dict(base, **NEEDS.get(field, {}))
            body[field] = value
            what = "%s %s=%r" % (path, field, value)
            if body.get("stream"):  # an event stream, not one JSON body
                st, _, raw = srvtest.request(self.port, "POST", path, json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
                out = json.loads(raw) if st != 200 else None
            else:
                st, _, out = self.post(path, body)
            if how in ("unsup", "model"):
                self.assertEqual(st, 400, what)
                self.assertEqual(out["error"]["param"], field, what)
            else:
                self.assertEqual(st, 200, "%s: %r" % (what, out))
        st, _, out = self.post(path, dict(base, no_such_field=1))
        self.assertEqual((st, out["error"]["param"]), (400, "no_such_field"))

    def test_every_field_implemented_or_refused(self):
        self.walk("/v1/completions", COMPLETIONS, {"prompt": "Hello", "max_tokens": 3})
        self.walk("/v1/chat/completions", CHAT, {"messages": MSGS, "max_tokens": 3})
        noop = {f for f, (_, how) in list(COMPLETIONS.items()) + list(CHAT.items())
                if how == "noop"}
        self.assertEqual(noop, readme_allow_list())

    def greedy(self, n_tok=6, **extra):
        extra.setdefault("ignore_eos", True)
        return self.client.completions.create(model=NAME, prompt="Once upon a time",
                                              max_tokens=n_tok, temperature=0, logprobs=1,
                                              extra_body=extra)

    def ids(self, r):
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]

    def test_logit_bias(self):
        base = self.ids(self.greedy(return_tokens_as_token_ids=True))
        banned = self.ids(self.client.completions.create(
            model=NAME, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=1,
            logit_bias={str(base[0]): -100},
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}))
        self.assertNotEqual(banned[0], base[0])
        self.assertNotIn(base[0], banned)
        forced = 7 if base[0] != 7 else 8
        r = self.client.completions.create(
            model=NAME, prompt="Once upon a time", max_tokens=4, temperature=1, seed=3,
            logprobs=1, logit_bias={str(forced): 100},
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        self.assertEqual(self.ids(r), [forced] * 4)

    def test_allowed_token_ids(self):
        r = self.greedy(n_tok=8, allowed_token_ids=[10, 11, 12], return_tokens_as_token_ids=True,
                        temperature=None)
        self.assertTrue(set(self.ids(r)) <= {10, 11, 12}, self.ids(r))

    def test_stop_token_ids_and_min_tokens(self):
        base = self.ids(self.greedy(return_tokens_as_token_ids=True))
        stop = base[-1]
        r = self.greedy(stop_token_ids=[stop], return_tokens_as_token_ids=True)
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(self.ids(r), base[:base.index(stop) + 1])
        # min_tokens: the stop token may not be drawn before 4 tokens exist
        r = self.greedy(n_tok=6, stop_token_ids=[base[0]], min_tokens=4,
                        return_tokens_as_token_ids=True)
        got = self.ids(r)
        self.assertNotIn(base[0], got[:4])
        self.assertGreaterEqual(len(got), 4)

    def test_include_stop_str(self):
        text = self.greedy(n_tok=12).choices[0].text
        stop = text[3:5]
        cut = self.greedy(n_tok=12, stop=[stop]).choices[0]
        kept = self.greedy(n_tok=12, stop=[stop], include_stop_str_in_output=True).choices[0]
        self.assertEqual(cut.finish_reason, "stop")
        self.assertEqual(kept.text, cut.text + stop)

    def test_best_of(self):
        kw = dict(model=NAME, prompt="Once upon a time", max_tokens=5, temperature=1, seed=11,
                  extra_body={"ignore_eos": True})
        samples = self.client.completions.create(n=4, logprobs=0, **kw).choices
        score = {c.text: sum(c.logprobs.token_logprobs) for c in samples}
        best = self.client.completions.create(n=1, best_of=4, **kw).choices
        self.assertEqual(len(best), 1)
        self.assertEqual(best[0].text, max(score, key=score.get))
        self.assertIsNone(best[0].logprobs)

    def test_prompt_logprobs_and_echo(self):
        st, _, r = self.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 0,
                                                 "echo": True, "logprobs": 2,
                                                 "prompt_logprobs": 1})
        self.assertEqual(st, 200, r)
        c = r["choices"][0]
        n = r["usage"]["prompt_tokens"]
        self.assertEqual(c["text"], "Once upon a time")
        self.assertEqual(len(c["logprobs"]["tokens"]), n)
        self.assertIsNone(c["logprobs"]["token_logprobs"][0])
        self.assertIsNone(c["logprobs"]["top_logprobs"][0])
        self.assertEqual(len(c["prompt_logprobs"]), n)
        self.assertIsNone(c["prompt_logprobs"][0])
        for q in range(1, n):
            lp = c["logprobs"]["token_logprobs"][q]
            self.assertLess(lp, 0)
            entry = c["prompt_logprobs"][q]
            mine = [v for v in entry.values() if v["rank"] >= 1 and
                    abs(v["logprob"] - lp) < 1e-5]
            self.assertTrue(mine, entry)
            self.assertIn(min(v["rank"] for v in entry.values()), (1,))
        self.assertEqual(c["finish_reason"], "length")
        self.assertEqual(r["usage"]["completion_tokens"], 0)
        # chat: at the top level, one entry per prompt token
        st, _, r = self.post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2,
                                                      "prompt_logprobs": 0})
        self.assertEqual(st, 200, r)
        self.assertEqual(len(r["prompt_logprobs"]), r["usage"]["prompt_tokens"])
        # streaming echo: the first chunk carries the prompt's logprobs
        stream = self.client.completions.create(model=NAME, prompt="Once upon a time",
                                                max_tokens=2, echo=True, logprobs=1, stream=True,
                                                temperature=0)
        first = next(iter(stream))
        self.assertTrue(first.choices[0].text.startswith("Once upon a time"))
        self.assertIsNone(first.choices[0].logprobs.token_logprobs[0])
        self.assertGreaterEqual(len(first.choices[0].logprobs.tokens), n)

    def test_truncate_and_cache_salt(self):
        r = self.greedy(truncate_prompt_tokens=2)
        self.assertEqual(r.usage.prompt_tokens, 2)
        long_prompt = "Once upon a time there was a little model " * 4
        def cached(salt):
            extra = {"cache_salt": salt} if salt else {}
            return self.client.completions.create(
                model=NAME, prompt=long_prompt, max_tokens=1,
                extra_body=extra).usage.prompt_tokens_details.cached_tokens
        cached("a")
        self.assertGreater(cached("a"), 0)
        self.assertEqual(cached("b"), 0)

    def test_routes(self):
        m = self.client.models.retrieve(NAME)
        self.assertEqual(m.id, NAME)
        with self.assertRaises(openai.NotFoundError):
            self.client.models.retrieve("no-such-model")
        st, _, v = srvtest.request(self.port, "GET", "/version")
        self.assertEqual(st, 200)
        v = json.loads(v)
        self.assertTrue(v["version"] and v["commit"] and "cuda" in v["build"])
        st, _, t = srvtest.request(self.port, "GET", "/tokenizer_info")
        self.assertEqual(st, 200)
        self.assertIn("eos_token", json.loads(t))


if __name__ == "__main__":
    srvtest.main()
