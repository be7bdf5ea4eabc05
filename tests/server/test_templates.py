"""Chat templates through the server. A DeepSeek-V3 fixture served with DeepSeek-V3's real chat
template renders every conversation of tests/fixtures/chat/cases.json exactly as transformers'
apply_chat_template (compared through /tokenize: byte-level BPE ids determine the text), and a
chat completion counts the same prompt tokens. The gpt-oss fixture (MXFP4 experts) answers chat
completions; `reasoning_effort` reaches a template that reads it (chat_template_kwargs winning
over it), and is refused with 400 by one that does not."""
import json
import os
import shutil
import tempfile
import unittest

import srvtest

# Only reasoning_effort is read: a stand-in for gpt-oss's harmony template, whose file the
# shared data does not carry (see the issue-10 note).
EFFORT_TEMPLATE = ("{{ 'Reasoning: ' + (reasoning_effort | default('medium')) + '\\n' }}"
                   "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")


def fixture_copy(name, template_text):
    """A temporary copy of a fixture folder with chat_template.jinja set."""
    d = tempfile.mkdtemp(prefix="moeserve_tpl_")
    src = srvtest.fixture_model(name)
    for f in os.listdir(src):
        if f != "reference.safetensors":
            shutil.copy(os.path.join(src, f), d)
    with open(os.path.join(d, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template_text)
    return d


class Base(unittest.TestCase):
    folder = None

    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(model=cls.folder).start()

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def post(self, path, body):
        return srvtest.post_json(self.srv.port, path, body)

    def ids(self, body):
        st, _, out = self.post("/tokenize", body)
        self.assertEqual(st, 200, out)
        return out["tokens"]

    def text_ids(self, text):
        return self.ids({"prompt": text, "add_special_tokens": False})

    def decode(self, ids):
        st, _, out = self.post("/detokenize", {"tokens": ids})
        self.assertEqual(st, 200, out)
        return out["prompt"]


class DeepSeekTemplate(Base):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(srvtest.tests_dir(), "fixtures", "chat", "deepseek_v3.jinja"),
                  encoding="utf-8") as f:
            cls.folder = fixture_copy("deepseek_v3", f.read())
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        shutil.rmtree(cls.folder, ignore_errors=True)

    def test_renders_as_transformers(self):
        with open(os.path.join(srvtest.tests_dir(), "fixtures", "chat", "cases.json"),
                  encoding="utf-8") as f:
            cases = [c for c in json.load(f) if c["template"] == "deepseek_v3"]
        self.assertGreater(len(cases), 20)
        checked = 0
        for c in cases:
            body = {"messages": c["messages"], "add_generation_prompt": c["add_generation_prompt"]}
            for k in ("tools",):
                if k in c:
                    body[k] = c[k]
            if c.get("kwargs"):
                body["chat_template_kwargs"] = c["kwargs"]
            if "error" in c:  # the raw template raises (test_jinja); the server first turns
                continue        # a null content into "", as OpenAI's API allows it
            # the fixture's tokenizer has no BOS token: the template's bos_token renders empty
            want = c["expected"]
            self.assertTrue(want.startswith(c["bos_token"]), c["name"])
            want = want[len(c["bos_token"]):]
            got = self.ids(body)
            if got != self.text_ids(want):
                self.assertEqual(self.decode(got), want, c["name"])
            checked += 1
        self.assertGreater(checked, 20)

    def test_chat_completion_prompt(self):
        msgs = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]
        want = "Be brief.<｜User｜>Hello there<｜Assistant｜>"
        st, _, out = self.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
        self.assertEqual(st, 200, out)
        self.assertEqual(out["usage"]["prompt_tokens"], len(self.text_ids(want)))
        self.assertEqual(self.ids({"messages": msgs, "add_generation_prompt": True}),
                         self.text_ids(want))


class GptOssServed(Base):
    @classmethod
    def setUpClass(cls):
        cls.folder = srvtest.fixture_model("gpt_oss")
        super().setUpClass()

    def test_chat_and_refused_effort(self):
        msgs = [{"role": "user", "content": "Hi"}]
        st, _, out = self.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4,
                                                        "temperature": 0})
        self.assertEqual(st, 200, out)
        self.assertIsInstance(out["choices"][0]["message"]["content"], str)
        self.assertEqual(out["usage"]["prompt_tokens"],
                         len(self.text_ids("<|im_start|>user\nHi<|im_end|>\n"
                                           "<|im_start|>assistant\n")))
        # its ChatML template does not read reasoning_effort: no effect is refused
        st, _, out = self.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 4,
                                                        "reasoning_effort": "low"})
        self.assertEqual((st, out["error"]["param"]), (400, "reasoning_effort"))


class ReasoningEffort(Base):
    @classmethod
    def setUpClass(cls):
        cls.folder = fixture_copy("gpt_oss", EFFORT_TEMPLATE)
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        shutil.rmtree(cls.folder, ignore_errors=True)

    def test_effort_reaches_the_template(self):
        msgs = [{"role": "user", "content": "Hi"}]
        for extra, effort in (({}, "medium"), ({"reasoning_effort": "high"}, "high"),
                              ({"reasoning_effort": "high",
                                "chat_template_kwargs": {"reasoning_effort": "low"}}, "low")):
            want = self.text_ids("Reasoning: %s\nuser: Hi\n" % effort)
            self.assertEqual(self.ids(dict({"messages": msgs}, **extra)), want, extra)
            st, _, out = self.post("/v1/chat/completions",
                                   dict({"messages": msgs, "max_tokens": 2}, **extra))
            self.assertEqual(st, 200, out)
            self.assertEqual(out["usage"]["prompt_tokens"], len(want), extra)
        st, _, out = self.post("/v1/chat/completions", {"messages": msgs,
                                                        "reasoning_effort": "extreme"})
        self.assertEqual((st, out["error"]["param"]), (400, "reasoning_effort"))


if __name__ == "__main__":
    srvtest.main()
