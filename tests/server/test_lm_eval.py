"""lm-evaluation-harness against the server, as its users run it: `lm-eval run --model
local-completions` (echo + logprobs loglikelihood requests, token ids from the server's own
/tokenize through lm-eval's remote tokenizer) on the bundled model and three small local tasks
in tests/lm_eval: multiple choice over held-out arithmetic, the same questions with every
question's choices rotated, and rolling loglikelihood over held-out Shakespeare lines.

Checks: every loglikelihood lm-eval records equals the engine's own, computed directly by
build/logprob_ref from the token ids lm-eval's own encoder makes (within 1e-4); rotating the
choices changes no chosen answer (and so not the accuracy); accuracy beats chance. Skips (77)
when lm-eval is missing (tools/setup.sh installs it)."""
import glob
import json
import os
import subprocess
import sys
import tempfile
import unittest

import srvtest

try:
    import lm_eval  # noqa: F401
except ImportError:  # pragma: no cover
    lm_eval = None

NAME = "mohge-small"
TASKS = ["moeserve_mc", "moeserve_mc_rot", "moeserve_rolling"]


def task_dir():
    return os.path.join(srvtest.tests_dir(), "lm_eval")



def args_of(sample):
    """[(context, continuation)] of a logged sample, in either lm-eval layout."""
    a = sample["arguments"]
    if isinstance(a, dict):
        return [(v["arg_0"], v["arg_1"]) for _, v in sorted(a.items(),
                                                            key=lambda kv: int(kv[0].split("_")[-1]))]
    return [tuple(x) for x in a]


def lls_of(sample):
    """The loglikelihood of each request of a logged sample."""
    out = []
    for r in sample["resps"]:
        v = r[0]
        out.append(float(v[0] if isinstance(v, (list, tuple)) else v))
    return out


@unittest.skipIf(lm_eval is None, "lm-eval is not installed (tools/setup.sh)")
class LmEvalTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(model=srvtest.bundled_model(), name=NAME).start()
        cls.tmp = tempfile.TemporaryDirectory(prefix="moeserve-lmeval-")
        try:
            cls.run_lm_eval()
        except BaseException:
            cls.tearDownClass()  # unittest skips it when setUpClass fails
            raise

    @classmethod
    def run_lm_eval(cls):
        out = os.path.join(cls.tmp.name, "out")
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                   HF_HOME=os.path.join(cls.tmp.name, "hf"), TOKENIZERS_PARALLELISM="false")
        cls.model_args = ("base_url=%s/v1/completions,model=%s,tokenizer_backend=remote,"
                          "tokenized_requests=True,num_concurrent=1,max_retries=1"
                          % (cls.srv.base, NAME))
        cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
               "--model_args", cls.model_args, "--tasks", ",".join(TASKS),
               "--include_path", task_dir(), "--log_samples", "--output_path", out,
               "--batch_size", "1"]
        p = subprocess.run(cmd, cwd=task_dir(), env=env, capture_output=True, text=True,
                           timeout=600)
        cls.log = p.stdout + p.stderr
        if p.returncode != 0:
            raise AssertionError("lm-eval failed (%d):\n%s" % (p.returncode, cls.log[-4000:]))
        cls.samples = {}
        for t in TASKS:
            files = glob.glob(os.path.join(out, "**", "samples_%s_[0-9]*.jsonl" % t), recursive=True)
            assert len(files) == 1, (t, files)
            with open(files[0]) as f:
                cls.samples[t] = sorted((json.loads(l) for l in f), key=lambda s: s["doc_id"])
        res = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
        with open(res[0]) as f:
            cls.results = json.load(f)["results"]
        # lm-eval's own encoder (remote tokenizer: the server's /tokenize), for the reference
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        kw = dict(kv.split("=", 1) for kv in cls.model_args.split(","))
        kw["tokenized_requests"] = True
        cls.lm = LocalCompletionsAPI(**kw)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)
        cls.tmp.cleanup()

    def reference(self, lines):
        """Engine loglikelihoods of "ctxlen ids..." lines, by build/logprob_ref."""
        ref = os.path.join(os.path.dirname(srvtest.binary()), "logprob_ref")
        p = subprocess.run([ref, srvtest.bundled_model()], input="".join(l + "\n" for l in lines),
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        return [float(x) for x in p.stdout.split()]

    def check_multiple_choice(self, task):
        lines, got = [], []
        for s in self.samples[task]:
            for (ctx, cont), ll in zip(args_of(s), lls_of(s)):
                c, k = self.lm._encode_pair(ctx, cont)
                lines.append("%d %s" % (len(c), " ".join(map(str, c + k))))
                got.append(ll)
        want = self.reference(lines)
        self.assertEqual(len(want), len(got))
        worst = max(abs(a - b) for a, b in zip(got, want))
        print("%s: %d loglikelihoods, worst |lm-eval - engine| %.2e" % (task, len(got), worst))
        self.assertLess(worst, 1e-4)
        self.assertTrue(all(g < 0 for g in got), "a loglikelihood of 0: prompt logprobs missing")

    def test_multiple_choice_matches_engine(self):
        self.check_multiple_choice("moeserve_mc")
        self.check_multiple_choice("moeserve_mc_rot")

    def test_rotation_keeps_answers(self):
        chosen = {}
        for t in ("moeserve_mc", "moeserve_mc_rot"):
            picks = []
            for s in self.samples[t]:
                lls = lls_of(s)
                conts = [c for _, c in args_of(s)]
                picks.append(conts[max(range(len(lls)), key=lambda i: lls[i])])
            chosen[t] = picks
        self.assertEqual(chosen["moeserve_mc"], chosen["moeserve_mc_rot"])
        acc = [self.results[t]["acc,none"] for t in ("moeserve_mc", "moeserve_mc_rot")]
        print("accuracy: %.3f and %.3f rotated (chance 0.25)" % tuple(acc))
        self.assertEqual(acc[0], acc[1])
        self.assertGreater(acc[0], 0.25)

    def test_rolling_matches_engine(self):
        eot = self.lm.eot_token_id
        lines, got = [], []
        for s in self.samples["moeserve_rolling"]:
            text = s["doc"]["text"]
            ids = self.lm.tok_encode(text)
            self.assertLess(len(ids) + 1, self.lm.max_length)  # one window: [eot] + the line
            lines.append("1 %d %s" % (eot, " ".join(map(str, ids))))
            got.append(lls_of(s)[0])
        want = self.reference(lines)
        worst = max(abs(a - b) for a, b in zip(got, want))
        r = self.results["moeserve_rolling"]
        print("rolling: %d lines, worst |lm-eval - engine| %.2e, word_perplexity %.2f, "
              "bits_per_byte %.3f" % (len(got), worst, r["word_perplexity,none"],
                                      r["bits_per_byte,none"]))
        self.assertLess(worst, 1e-4)


if __name__ == "__main__":
    srvtest.main()
