"""Drives moeserve through the official `openai` Python client, as users do: completions and
chat, streaming and not, n > 1, stop strings, seed reproducibility, logprobs, the moe_top_k
extension, max_tokens -> "length", usage against /tokenize, /v1/models, and errors surfacing
as the client's exception classes. Skips (exit 77) when the openai package is missing
(tools/setup.sh installs it)."""
import unittest

import srvtest

try:
    import openai
except ImportError:  # pragma: no cover
    openai = None

NAME = "fixture-mixtral"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."}]


def token_bytes(tok):
    """The bytes a logprob token stands for."""
    if tok.startswith("bytes:"):
        return bytes(int(h, 16) for h in tok[6:].split("\\x")[1:])
    return tok.encode("utf-8")


@unittest.skipIf(openai is None, "the openai package is not installed (tools/setup.sh)")
class OpenAIClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(name=NAME).start()
        cls.client = openai.OpenAI(base_url=cls.srv.base + "/v1", api_key="unused",
                                   max_retries=0, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def greedy(self, prompt=PROMPT, max_tokens=24, **kw):
        return self.client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, **kw)

    def test_models_lists_served_name(self):
        ids = [m.id for m in self.client.models.list().data]
        self.assertEqual(ids, [NAME])

    def test_completion_nonstream_and_usage(self):
        r = self.greedy(max_tokens=16, extra_body={"ignore_eos": True})
        self.assertEqual(r.object, "text_completion")
        self.assertTrue(r.id)
        self.assertEqual(r.model, NAME)
        self.assertEqual(len(r.choices), 1)
        c = r.choices[0]
        self.assertEqual(c.index, 0)
        self.assertEqual(c.finish_reason, "length")
        self.assertGreater(len(c.text), 0)
        n_prompt = len(srvtest.tokenize(self.srv.port, PROMPT))
        self.assertEqual(r.usage.prompt_tokens, n_prompt)
        self.assertEqual(r.usage.completion_tokens, 16)
        self.assertEqual(r.usage.total_tokens, n_prompt + 16)
        # greedy is deterministic
        self.assertEqual(self.greedy(max_tokens=16, extra_body={"ignore_eos": True})
                         .choices[0].text, c.text)

    def test_prefix_cache_reported_in_usage(self):
        # A prompt no other test sends, several KV blocks long: the second identical request
        # reuses its full blocks, says so in usage, and generates the same greedy text.
        prompt = ("Unique prefix for the cache test. " * 8).strip()
        first = self.greedy(prompt=prompt, max_tokens=8)
        second = self.greedy(prompt=prompt, max_tokens=8)
        self.assertEqual(first.usage.prompt_tokens_details.cached_tokens, 0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        self.assertGreater(cached, 0)
        self.assertLess(cached, second.usage.prompt_tokens)
        self.assertEqual(first.choices[0].text, second.choices[0].text)

    def test_completion_stream_matches_nonstream(self):
        want = self.greedy(max_tokens=20, extra_body={"ignore_eos": True}).choices[0].text
        text, finish, usage = "", None, None
        stream = self.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
                self.assertEqual(chunk.choices, [])
                continue
            self.assertEqual(len(chunk.choices), 1)
            text += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                self.assertIsNone(finish, "two finish chunks")
                finish = chunk.choices[0].finish_reason
        self.assertEqual(text, want)
        self.assertEqual(finish, "length")
        self.assertIsNotNone(usage, "no include_usage chunk")
        self.assertEqual(usage.completion_tokens, 20)
        self.assertEqual(usage.prompt_tokens, len(srvtest.tokenize(self.srv.port, PROMPT)))

    def test_chat_nonstream_and_stream(self):
        r = self.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12,
                                                temperature=0, extra_body={"ignore_eos": True})
        self.assertEqual(r.object, "chat.completion")
        msg = r.choices[0].message
        self.assertEqual(msg.role, "assistant")
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 12)
        # prompt tokens: the rendered template as /tokenize renders it
        st, _, tk = srvtest.post_json(self.srv.port, "/tokenize", {"messages": MESSAGES})
        self.assertEqual(st, 200, tk)
        self.assertEqual(r.usage.prompt_tokens, tk["count"])

        roles, text, finish = [], "", None
        for chunk in self.client.chat.completions.create(
                model=NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            self.assertEqual(chunk.object, "chat.completion.chunk")
            d = chunk.choices[0].delta
            if d.role:
                roles.append(d.role)
            text += d.content or ""
            finish = chunk.choices[0].finish_reason or finish
        self.assertEqual(roles, ["assistant"])
        self.assertEqual(text, msg.content)
        self.assertEqual(finish, "length")

    def test_n_choices(self):
        r = self.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, n=3,
                                           temperature=1, seed=7,
                                           extra_body={"ignore_eos": True})
        self.assertEqual(sorted(c.index for c in r.choices), [0, 1, 2])
        self.assertEqual(r.usage.completion_tokens, 24)
        # prompt counted once however many choices
        self.assertEqual(r.usage.prompt_tokens, len(srvtest.tokenize(self.srv.port, PROMPT)))
        r = self.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                                n=4, extra_body={"ignore_eos": True})
        self.assertEqual(sorted(c.index for c in r.choices), [0, 1, 2, 3])
        # streaming n > 1: every index finishes exactly once
        finished = {}
        for chunk in self.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6,
                                                    n=3, stream=True,
                                                    extra_body={"ignore_eos": True}):
            for c in chunk.choices:
                if c.finish_reason:
                    self.assertNotIn(c.index, finished)
                    finished[c.index] = c.finish_reason
        self.assertEqual(finished, {0: "length", 1: "length", 2: "length"})

    def test_stop(self):
        full = self.greedy(max_tokens=40, extra_body={"ignore_eos": True}).choices[0].text
        # a stop string from the middle of the greedy text: output ends right before it
        cut = None
        for i in range(3, len(full) - 3):
            piece = full[i:i + 2]
            if piece.strip() and full.find(piece) == i:
                cut = i
                break
        self.assertIsNotNone(cut, "greedy text too short to pick a stop string: %r" % full)
        stop = full[cut:cut + 2]
        r = self.greedy(max_tokens=40, stop=[stop], extra_body={"ignore_eos": True})
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.choices[0].text, full[:cut])
        # the same through streaming
        text = "".join(c.choices[0].text for c in self.client.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True,
            extra_body={"ignore_eos": True}) if c.choices)
        self.assertEqual(text, full[:cut])

    def test_seed_reproducible(self):
        def sample(seed):
            return self.client.completions.create(
                model=NAME, prompt=PROMPT, max_tokens=24, temperature=1, seed=seed,
                extra_body={"ignore_eos": True}).choices[0].text
        a, b = sample(1234), sample(1234)
        self.assertEqual(a, b)
        others = {sample(s) for s in (1, 2, 3)}
        self.assertGreater(len(others | {a}), 1, "different seeds all gave the same text")
        # chat too
        c1, c2 = (self.client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=16, temperature=1, seed=99,
            extra_body={"ignore_eos": True}).choices[0].message.content for _ in range(2))
        self.assertEqual(c1, c2)

    def test_logprobs(self):
        r = self.greedy(max_tokens=6, logprobs=3, extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        self.assertEqual(len(lp.tokens), 6)
        self.assertEqual(len(lp.token_logprobs), 6)
        self.assertEqual(len(lp.top_logprobs), 6)
        # Each token is its own bytes ("bytes:\\xNN" when not whole UTF-8): they join up to
        # the text, and text_offset counts the characters before each.
        joined = b"".join(token_bytes(t) for t in lp.tokens)
        self.assertEqual(joined.decode("utf-8", "replace"), r.choices[0].text)
        for i, off in enumerate(lp.text_offset):
            self.assertEqual(off, sum(1 for b in b"".join(token_bytes(t) for t in lp.tokens[:i])
                                      if b & 0xC0 != 0x80))
        for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            self.assertLessEqual(l, 0.0)
            self.assertLessEqual(len(top), 3)
            # greedy: the chosen token is the most likely one
            self.assertAlmostEqual(max(top.values()), l, places=4)
        r = self.client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 5)
        for item in content:
            self.assertLessEqual(item.logprob, 0.0)
            self.assertEqual(len(item.top_logprobs), 2)
            self.assertGreaterEqual(item.logprob, item.top_logprobs[-1].logprob - 1e-6)

    def test_moe_top_k(self):
        r = self.greedy(max_tokens=8, extra_body={"moe_top_k": 1, "ignore_eos": True})
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, 8)

        # it reaches the engine: one expert per token changes the first token's distribution;
        # the model's own top_k (2 for the fixture) is the default
        def first_logprobs(**extra):
            r = self.greedy(max_tokens=1, logprobs=5, extra_body=extra)
            return r.choices[0].logprobs.top_logprobs[0]
        default, k1, k2 = first_logprobs(), first_logprobs(moe_top_k=1), first_logprobs(moe_top_k=2)
        self.assertEqual(default, k2)
        self.assertNotEqual(default, k1)
        for bad in (99, -1, "two"):
            with self.assertRaises(openai.BadRequestError) as cm:
                self.greedy(max_tokens=8, extra_body={"moe_top_k": bad})
            self.assertEqual(cm.exception.status_code, 400)
            self.assertEqual(cm.exception.body.get("param"), "moe_top_k", cm.exception.body)

    def test_errors_are_typed(self):
        with self.assertRaises(openai.BadRequestError) as cm:
            self.client.completions.create(model=NAME, prompt=PROMPT, temperature=-1)
        self.assertEqual(cm.exception.body.get("param"), "temperature")
        with self.assertRaises(openai.NotFoundError) as cm:
            self.client.completions.create(model="no-such-model", prompt=PROMPT)
        self.assertEqual(cm.exception.body.get("param"), "model")
        with self.assertRaises(openai.NotFoundError):
            self.client.chat.completions.create(model="no-such-model", messages=MESSAGES)
        with self.assertRaises(openai.BadRequestError):
            self.client.chat.completions.create(model=NAME, messages=[])


@unittest.skipIf(openai is None, "the openai package is not installed (tools/setup.sh)")
class OpenAIAuthTest(unittest.TestCase):
    def test_api_key(self):
        with srvtest.Server("--api-key", "sekrit-key", name=NAME) as srv:
            good = openai.OpenAI(base_url=srv.base + "/v1", api_key="sekrit-key", max_retries=0)
            r = good.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
            self.assertEqual(len(r.choices), 1)
            self.assertEqual([m.id for m in good.models.list().data], [NAME])
            for key in ("wrong", "sekrit-ke", "sekrit-key2"):
                bad = openai.OpenAI(base_url=srv.base + "/v1", api_key=key, max_retries=0)
                with self.assertRaises(openai.AuthenticationError) as cm:
                    bad.completions.create(model=NAME, prompt=PROMPT, max_tokens=2)
                self.assertEqual(cm.exception.status_code, 401)
                with self.assertRaises(openai.AuthenticationError):
                    bad.models.list()
            # no key at all (raw request: the client always sends one)
            st, hdrs, body = srvtest.post_json(srv.port, "/v1/completions",
                                               {"prompt": PROMPT, "max_tokens": 2})
            self.assertEqual(st, 401)
            self.assertEqual(body["error"]["type"], "authentication_error")
            # health and metrics stay open for probes and scrapers
            self.assertEqual(srvtest.request(srv.port, "GET", "/health")[0], 200)
            self.assertEqual(srvtest.request(srv.port, "GET", "/metrics")[0], 200)


if __name__ == "__main__":
    srvtest.main()
