#!/usr/bin/env python3
"""Reference cases for the regex -> grammar converter (engine/grammar/grm_compile.c): random
regular expressions of the syntax it supports, each with strings and whether Python's
re.fullmatch takes them, written to tests/fixtures/regex_cases.txt for tests/test_grammar.c.

The regexes lean to what is easy to get wrong: quantifiers over groups that can match nothing
((a*)*, (a|b?)+), alternations with empty branches, optional groups, classes (ranges, negated,
escapes, ']' and '-' as members), lazy quantifiers, {m,n} in all of Python's forms, anchors at
the ends. The classes \\d \\w \\s are ASCII here (re.ASCII, as the converter and JSON Schema's
ECMA-262 patterns read them); '.' and negated classes are also tried on a two-byte character.
Strings are drawn from the regex itself (so about half match), then mutated, plus random ones.

Only the Python standard library; a fixed seed, so the file is the same on every run:
    python3 tests/reference/make_regex_cases.py
File format: a line "R <regex>" starts a case, then "Y <string>" (fullmatch) or "N <string>";
backslash escapes \\\\ \\n \\t \\r in regexes and strings keep one item a line."""
import os
import random
import re
import warnings

with warnings.catch_warnings():  # the parser of re, to draw matching strings; deprecated in 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import sre_constants as C
    import sre_parse

SEED = 20261203
N_REGEX = 300
PER_REGEX = 20
OUT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                                   "regex_cases.txt"))

LITERALS = ["a", "b", "c", "x", "0", "1", "-", " ", "\u00e9"]
ESCAPED = ["\\.", "\\*", "\\+", "\\?", "\\(", "\\)", "\\[", "\\|", "\\{", "\\-", "\\x61", "\\u00e9"]
SHORTHAND = ["\\d", "\\w", "\\s", "\\D", "\\W", "\\S", "."]
CLASSES = ["[ab]", "[a-c]", "[^a]", "[^a-b\\n]", "[\\da]", "[\\s]", "[a\\-b]", "[-a]", "[a-]",
           "[]a]", "[^]a]", "[0-9x]", "[\\w-]", "[^\\d]", "[a-c-x]", "[\u00e9a]"]
ALPHABET = "abcx01- \n\u00e9.*"


class Gen:
    def __init__(self, rng):
        self.rng = rng
        self.groups = 0

    def atom(self, depth):
        r = self.rng.random()
        if depth < 4 and r < 0.35:
            return self.group(depth + 1)
        if r < 0.6:
            return self.rng.choice(LITERALS)
        if r < 0.7:
            return self.rng.choice(ESCAPED)
        if r < 0.82:
            return self.rng.choice(SHORTHAND)
        return self.rng.choice(CLASSES)

    def group(self, depth):
        body = self.alts(depth)
        kind = self.rng.random()
        if kind < 0.15:
            return "(?:" + body + ")"
        if kind < 0.22:
            self.groups += 1
            return "(?P<g%d>%s)" % (self.groups, body)
        return "(" + body + ")"

    def quant(self):
        q = self.rng.choice(["*", "*", "+", "+", "?", "?", "{2}", "{0,2}", "{1,}", "{,2}",
                             "{1,3}", "{0}", "{,}"])
        if self.rng.random() < 0.15:
            q += "?"  # lazy: the same strings
        return q

    def item(self, depth):
        a = self.atom(depth)
        # bias: groups get quantifiers more often (nested quantifiers)
        p = 0.6 if a.startswith("(") else 0.3
        if self.rng.random() < p:
            a += self.quant()
        return a

    def seq(self, depth):
        n = self.rng.choice([0, 1, 1, 2, 2, 3, 4]) if depth else self.rng.choice([1, 2, 3, 4])
        return "".join(self.item(depth) for _ in range(n))

    def alts(self, depth):
        n = self.rng.choice([1, 1, 1, 2, 2, 3])
        return "|".join(self.seq(depth) for _ in range(n))

    def regex(self):
        self.groups = 0
        r = self.alts(0)
        if self.rng.random() < 0.15:
            r = "^" + r
        if self.rng.random() < 0.15:
            r = r + "$"
        return r


def sample(rng, node, budget):
    """A random string that the parsed pattern matches (sre_parse tree), or None."""
    out = []
    for op, av in node:
        if budget[0] <= 0:
            return None
        if op == C.LITERAL:
            out.append(chr(av))
        elif op == C.ANY:
            out.append(rng.choice("abx1 \u00e9"))
        elif op == C.IN:
            cands = [ch for ch in ALPHABET + "Z_9\t" if re.fullmatch(to_class(av), ch, re.ASCII)]
            if not cands:
                return None
            out.append(rng.choice(cands))
        elif op == C.SUBPATTERN:
            s = sample(rng, av[-1], budget)
            if s is None:
                return None
            out.append(s)
        elif op == C.BRANCH:
            s = sample(rng, rng.choice(av[1]), budget)
            if s is None:
                return None
            out.append(s)
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, sub = av
            hi = min(hi, lo + 3)
            for _ in range(rng.randint(lo, hi)):
                budget[0] -= 1
                s = sample(rng, sub, budget)
                if s is None:
                    return None
                out.append(s)
        elif op in (C.AT,):
            pass
        else:
            return None
    return "".join(out)


def to_class(av):
    """A one-character regex for an sre IN node (rebuilt from its parts)."""
    parts, neg = [], ""
    for op, a in av:
        if op == C.NEGATE:
            neg = "^"
        elif op == C.LITERAL:
            parts.append(re.escape(chr(a)))
        elif op == C.RANGE:
            parts.append(re.escape(chr(a[0])) + "-" + re.escape(chr(a[1])))
        elif op == C.CATEGORY:
            parts.append({C.CATEGORY_DIGIT: "\\d", C.CATEGORY_NOT_DIGIT: "\\D",
                          C.CATEGORY_WORD: "\\w", C.CATEGORY_NOT_WORD: "\\W",
                          C.CATEGORY_SPACE: "\\s", C.CATEGORY_NOT_SPACE: "\\S"}[a])
    return "[" + neg + "".join(parts) + "]"


def strings(rng, rx):
    tree = sre_parse.parse(rx)
    got = set()
    for _ in range(40):
        s = sample(rng, tree, [30])
        if s is not None and len(s) <= 12:
            got.add(s)
        if len(got) >= PER_REGEX // 2:
            break
    base = sorted(got)
    for s in base:  # one-character edits of matching strings: near misses
        if len(got) >= PER_REGEX * 3 // 4:
            break
        i = rng.randint(0, len(s))
        k = rng.random()
        if k < 0.4:
            got.add(s[:i] + rng.choice(ALPHABET) + s[i:])
        elif k < 0.7 and s:
            got.add(s[:i] + s[i + 1:])
        elif s:
            i = min(i, len(s) - 1)
            got.add(s[:i] + rng.choice(ALPHABET) + s[i + 1:])
    while len(got) < PER_REGEX:
        got.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))))
    return sorted(got)


def esc(s):
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def main():
    rng = random.Random(SEED)
    g = Gen(rng)
    lines = ["# Generated by tests/reference/make_regex_cases.py (seed %d): regexes, then strings "
             "with whether re.fullmatch(regex, s, re.ASCII) matches (Y/N)." % SEED]
    seen = set()
    n = 0
    while n < N_REGEX:
        rx = g.regex()
        if rx in seen:
            continue
        try:
            cre = re.compile(rx, re.ASCII)
        except re.error:
            continue  # e.g. a quantifier that Python refuses: not a test of ours
        seen.add(rx)
        lines.append("R " + esc(rx))
        for s in strings(rng, rx):
            lines.append(("Y " if cre.fullmatch(s) else "N ") + esc(s))
        n += 1
    with open(OUT, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    yes = sum(1 for ln in lines if ln.startswith("Y "))
    no = sum(1 for ln in lines if ln.startswith("N "))
    print("%s: %d regexes, %d matching and %d other strings" % (OUT, n, yes, no))


if __name__ == "__main__":
    main()
