"""The continuous-experts budget through the HTTP API, on the tiny infmoe fixture
(tests/fixtures/models/infmoe_tiny): greedy continuations of a prompt given as token ids equal
the PyTorch reference's (reference.safetensors, read here without torch) at the default K = 4,
with moe_samples = 1, and as the server default (--moe-samples 1); budgets outside the model's
bounds and moe_top_k (the model has no routed experts) get 400 naming the field; out-of-range
serve flags stop the server with a message naming the flag. (Fields on a model that is not
continuous: test_fields.py.)"""
import json
import os
import struct
import subprocess
import unittest

import srvtest

MODEL = srvtest.fixture_model("infmoe_tiny")


def read_reference(path):
    """safetensors -> {name: list of ints} for the int32 tensors."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] != "I32":
            continue
        a, b = t["data_offsets"]
        out[name] = list(struct.unpack("<%di" % ((b - a) // 4), data[a:b]))
    return out


REF = read_reference(os.path.join(MODEL, "reference.safetensors"))


class InfmoeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(model=MODEL, name="infmoe").start()

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def complete(self, port, **extra):
        body = dict(prompt=REF["prompt1.ids"], max_tokens=32, temperature=0, ignore_eos=True,
                    logprobs=1, return_tokens_as_token_ids=True)
        body.update(extra)
        return srvtest.post_json(port, "/v1/completions", body)

    def greedy(self, port, **extra):
        st, _, out = self.complete(port, **extra)
        self.assertEqual(st, 200, out)
        return [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]

    def test_budget_matches_reference(self):
        self.assertEqual(self.greedy(self.srv.port), REF["prompt1.greedy"])
        self.assertEqual(self.greedy(self.srv.port, moe_samples=4), REF["prompt1.greedy"])
        self.assertEqual(self.greedy(self.srv.port, moe_samples=1), REF["prompt1.greedy_k1"])
        self.assertNotEqual(REF["prompt1.greedy"], REF["prompt1.greedy_k1"])
        # a smaller fraction and the adaptive budget are accepted
        st, _, out = self.complete(self.srv.port, moe_samples=2, moe_neuron_fraction=0.0625)
        self.assertEqual(st, 200, out)
        st, _, out = self.complete(self.srv.port, moe_samples=2, moe_samples_adaptive=True)
        self.assertEqual(st, 200, out)

    def test_neurons_metric(self):
        """The budget is visible in /metrics: K = 1 costs N neurons per token and layer (32 x 2
        layers for the fixture), the default K = 4 more. A server of its own: the shared one's
        last step of an earlier test may still be counted after that test's response."""
        with srvtest.Server(model=MODEL, name="infmoe-metric") as srv:
            def total():
                return srv.metrics().total("moeserve_continuous_neurons_total")

            def spent(**extra):  # a cache_salt of its own: the whole prompt is computed
                before = total()
                st, _, out = self.complete(srv.port, max_tokens=1, cache_salt=repr(extra), **extra)
                self.assertEqual(st, 200, out)
                # the counters are copied after the step, which may end after the response: the
                # request's one step (the prompt's prefill) shows up as one change
                return srvtest.wait_until(lambda: total() - before or None, 10, "the neuron counter")
            n_prompt = len(REF["prompt1.ids"])
            self.assertEqual(spent(moe_samples=1), n_prompt * 32 * 2)
            self.assertGreater(spent(moe_samples=4), n_prompt * 32 * 2)

    def test_bad_budget(self):
        for field, value in (("moe_samples", 9), ("moe_samples", -1), ("moe_samples", "2"),
                             ("moe_samples", 1.5), ("moe_neuron_fraction", 0.25),
                             ("moe_neuron_fraction", 1.5), ("moe_neuron_fraction", "x"),
                             ("moe_samples_adaptive", 1),
                             ("moe_top_k", 1)):
            st, _, out = self.complete(self.srv.port, **{field: value})
            self.assertEqual(st, 400, (field, value, out))
            self.assertEqual(out["error"]["param"], field, out)

    def test_server_default(self):
        with srvtest.Server("--moe-samples", "1", model=MODEL) as srv:
            self.assertEqual(self.greedy(srv.port), REF["prompt1.greedy_k1"])
            self.assertEqual(self.greedy(srv.port, moe_samples=4), REF["prompt1.greedy"])

    def test_bad_flags(self):
        for flags, want in ((["--moe-samples", "9"], "--moe-samples 9 exceeds"),
                            (["--moe-neuron-fraction", "0.5"], "--moe-neuron-fraction 0.5 exceeds"),
                            (["--moe-neuron-fraction", "abc"], "--moe-neuron-fraction must be")):
            p = subprocess.run([srvtest.binary(), "serve", "--model", MODEL, "--port", "0"] + flags,
                               capture_output=True, text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0, flags)
            self.assertIn(want, p.stdout + p.stderr, flags)


if __name__ == "__main__":
    srvtest.main()
