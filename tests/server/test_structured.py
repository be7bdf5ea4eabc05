"""Structured output on the bundled model through the official openai client: 50 random JSON
Schemas (nested objects, arrays with bounds, enums, anyOf, $ref/$defs, formats) each sampled at
temperature 1, half through chat response_format json_schema (strict) and half through
completions guided_json; every output must parse and validate with the jsonschema library
(formats checked). Then guided_choice always returns one of the choices, guided_regex outputs
match the whole pattern, guided_grammar (EBNF) outputs parse, response_format json_object
gives a JSON object, the client's Pydantic parse() works, a schema keyword the compiler lacks
is a 400 naming it, and a grammar that allows no token ends the output with "stop" and a
logged warning rather than a hang."""
import json
import random
import re
import unittest

import srvtest

try:
    import openai
    import jsonschema
except ImportError:  # pragma: no cover
    openai = None

NAME = "mohge-small"
N_SCHEMAS = 50



class SchemaMaker:
    """Random schemas of bounded output size (strings, arrays and nesting are capped, so a
    sample finishes well within max_tokens)."""

    WORDS = ["name", "city", "age", "score", "tags", "active", "id", "email", "kind", "items",
             "note", "when", "ref", "level", "count"]

    def __init__(self, seed):
        self.r = random.Random(seed)
        self.defs = {}

    def leaf(self):
        r = self.r
        k = r.choice(["string", "integer", "number", "boolean", "null", "enum", "const",
                      "date", "uuid"])
        if k == "string":
            return {"type": "string", "maxLength": r.randint(1, 10)}
        if k == "enum":
            return {"enum": r.sample(["red", "green", "blue", 1, 2, None, True], r.randint(1, 4))}
        if k == "const":
            return {"const": r.choice(["fixed", 7, False])}
        if k in ("date", "uuid"):
            return {"type": "string", "format": k}
        return {"type": k}

    def node(self, depth):
        r = self.r
        k = r.random()
        if depth >= 3 or k < 0.4:
            return self.leaf()
        if k < 0.6:
            return {"type": "array", "items": self.node(depth + 1), "minItems": r.randint(0, 1),
                    "maxItems": r.randint(1, 3)}
        if k < 0.7:
            return {"anyOf": [self.node(depth + 1), self.node(depth + 1)]}
        if k < 0.75 and depth > 0:
            name = "d%d" % len(self.defs)
            self.defs[name] = self.obj(depth + 1)
            return {"$ref": "#/$defs/" + name}
        return self.obj(depth + 1)

    def obj(self, depth):
        r = self.r
        names = r.sample(self.WORDS, r.randint(1, 4))
        props = {n: self.node(depth) for n in names}
        req = [n for n in names if r.random() < 0.6]
        return {"type": "object", "properties": props, "required": req,
                "additionalProperties": False}

    def make(self):
        s = self.obj(0)
        if self.defs:
            s["$defs"] = self.defs
        return s


@unittest.skipIf(openai is None, "openai and jsonschema are needed (tools/setup.sh)")
class StructuredTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.srv = srvtest.Server(model=srvtest.bundled_model(), name=NAME).start()
        cls.client = openai.OpenAI(base_url=cls.srv.base + "/v1", api_key="unused",
                                   max_retries=0, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.srv.__exit__(None, None, None)

    def test_random_schemas_validate(self):
        stops = 0
        for i in range(N_SCHEMAS):
            schema = SchemaMaker(1000 + i).make()
            validator = jsonschema.Draft202012Validator(
                schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            if i % 2 == 0:
                r = self.client.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": "Give me a record."}],
                    temperature=1, seed=i, max_tokens=600,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "rec", "schema": schema, "strict": True}})
                text, fin = r.choices[0].message.content, r.choices[0].finish_reason
            else:
                r = self.client.completions.create(
                    model=NAME, prompt='{"id": 100000, "name": "', temperature=1, seed=i,
                    max_tokens=600, extra_body={"guided_json": schema})
                text, fin = r.choices[0].text, r.choices[0].finish_reason
            what = "schema %d %s -> %r (%s)" % (i, json.dumps(schema), text, fin)
            self.assertEqual(fin, "stop", what)
            stops += 1
            value = json.loads(text)
            errors = list(validator.iter_errors(value))
            self.assertEqual(errors, [], what)
        print("%d of %d random schemas: output parsed and validated" % (stops, N_SCHEMAS))

    def test_choice_regex_grammar_object(self):
        choices = ["yes", "no", "maybe not"]
        for seed in range(15):
            r = self.client.completions.create(model=NAME, prompt="Answer:", temperature=1,
                                               seed=seed, max_tokens=10,
                                               extra_body={"guided_choice": choices})
            self.assertIn(r.choices[0].text, choices)
            self.assertEqual(r.choices[0].finish_reason, "stop")
        pattern = r"[A-Z][a-z]{1,6} [0-9]{2,4}(-[a-z]+)?"
        grammar = ('root ::= expr\nexpr ::= term ( [+*-] term ){0,3}\n'
                   'term ::= [0-9]{1,3} | "(" expr ")"')
        for seed in range(8):
            r = self.client.completions.create(model=NAME, prompt="Code:", temperature=1,
                                               seed=seed, max_tokens=40,
                                               extra_body={"guided_regex": pattern})
            self.assertRegex(r.choices[0].text, "^(%s)$" % pattern)
            r = self.client.completions.create(model=NAME, prompt="12+", temperature=1,
                                               seed=seed, max_tokens=60,
                                               extra_body={"guided_grammar": grammar})
            text = r.choices[0].text
            if r.choices[0].finish_reason == "stop":
                self.assertRegex(text, r"^[0-9+*()\-]+$")
                eval(compile(text, "<expr>", "eval"), {"__builtins__": {}})  # parses
            r = self.client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": "json"}], temperature=1,
                seed=seed, max_tokens=300, response_format={"type": "json_object"})
            if r.choices[0].finish_reason == "stop":
                self.assertIsInstance(json.loads(r.choices[0].message.content), dict)

    def test_pydantic_parse(self):
        try:
            from pydantic import BaseModel
        except ImportError:  # pragma: no cover
            self.skipTest("pydantic (installed with openai) is missing")

        class Person(BaseModel):
            name: str
            age: int
            active: bool

        r = self.client.beta.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": "a person"}], temperature=1,
            seed=3, max_tokens=300, response_format=Person) if hasattr(self.client, "beta") and \
            hasattr(self.client.beta, "chat") else self.client.chat.completions.parse(
            model=NAME, messages=[{"role": "user", "content": "a person"}], temperature=1,
            seed=3, max_tokens=300, response_format=Person)
        p = r.choices[0].message.parsed
        self.assertIsInstance(p, Person)
        self.assertIsInstance(p.age, int)

    def test_refusals_and_dead_ends(self):
        st, _, out = srvtest.post_json(self.srv.port, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "n", "schema": {
                    "type": "object", "properties": {"n": {"type": "integer", "minimum": 3}}}}}})
        self.assertEqual(st, 400, out)
        self.assertEqual(out["error"]["param"], "response_format")
        self.assertEqual(out["error"]["code"], "unsupported_schema_keyword")
        self.assertIn("'minimum'", out["error"]["message"])
        st, _, out = srvtest.post_json(self.srv.port, "/v1/completions", {
            "prompt": "x", "guided_grammar": "root ::= root \"a\""})
        self.assertEqual((st, out["error"]["param"]), (400, "guided_grammar"), out)
        # the grammar wants "yes", allowed_token_ids leaves only "n": nothing is possible
        n_id = srvtest.tokenize(self.srv.port, "n")[0]
        st, _, out = srvtest.post_json(self.srv.port, "/v1/completions", {
            "prompt": "Answer:", "max_tokens": 5, "guided_choice": ["yes"],
            "allowed_token_ids": [n_id]})
        self.assertEqual(st, 200, out)
        self.assertEqual(out["choices"][0]["finish_reason"], "stop")
        self.assertEqual(out["choices"][0]["text"], "")
        srvtest.wait_until(lambda: re.search(r"warning .*no token is allowed", self.srv.output()),
                           10, "the warning in the server log")


if __name__ == "__main__":
    srvtest.main()
