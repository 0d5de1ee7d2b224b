"""Synthetic user requests for drafter training data, made without any dataset download.

Two sources, mixed per shard (:func:`shard_requests`):

- **Self-synthesised instructions** (Magpie): the target is given only its chat template's user
  prefix and writes the user turn itself, sampled at temperature ~1. This module only provides the
  prefix (:func:`magpie_prefix`) and the filter (:func:`usable_magpie`); the sampling runs in
  :mod:`yggtree.offline.transcripts`.
- **Request templates around calibration text** (:func:`template_request`): explain, summarise,
  rewrite, review, test, fix a planted bug, write a function from a standard-library signature and
  docstring, step-by-step arithmetic word problems, role play, extraction, comparison, lists,
  letters and stories. The text comes from :func:`yggtree.data.calibration_corpus` (the stdlib
  sources and pydoc topics, already decontaminated verbatim against the evaluation sets).

Every request is checked against MT-Bench and HumanEval by word n-gram overlap
(:class:`Decontaminator`) and dropped on any shared n-gram; callers count the drops. Evaluation
prompts are never used for anything but that check.

Held-out requests (``split="heldout"``) draw from a disjoint part of the corpus and another seed
stream, so no training shard shares a template text with them.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from dataclasses import dataclass
from functools import lru_cache

from ..errors import YggError

SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.1  # of the corpus chunks and the stdlib functions, reserved for held-out requests
NGRAM = 8  # words in the decontamination n-gram


@dataclass(frozen=True)
class Request:
    """One synthetic user turn. ``kind`` names its source/template family."""

    kind: str
    text: str  # the user message (no chat template)
    follow_up: str | None = None  # a second user turn (multi-turn conversations), or None


# --------------------------------------------------------------------------- decontamination


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    w = _words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


class Decontaminator:
    """Word ``n``-gram overlap check against the evaluation texts (MT-Bench turns, HumanEval
    prompts): a request sharing any ``n``-gram with them is contaminated."""

    def __init__(self, texts: tuple[str, ...] | list[str], n: int = NGRAM) -> None:
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        for t in texts:
            self.grams |= ngrams(t, n)

    def contaminated(self, text: str) -> bool:
        w = _words(text)
        return any(tuple(w[i : i + self.n]) in self.grams for i in range(len(w) - self.n + 1))


def normalised(text: str) -> str:
    """The dedup key of a request: lower-case words only."""
    return " ".join(_words(text))


# --------------------------------------------------------------------------- Magpie


def magpie_prefix(tokenizer) -> str:
    """The chat template's text up to where the user's message starts (system turn included)."""
    marker = "\x00USER\x00"
    if not getattr(tokenizer, "chat_template", None):
        raise YggError("self-synthesised requests need a chat model: this tokenizer has no chat template")
    full = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False)
    if marker not in full:
        raise YggError("the chat template does not place the user message verbatim; cannot synthesise requests")
    return full[: full.index(marker)]


def usable_magpie(text: str) -> bool:
    """A sampled user turn worth answering: 3 to 200 words, mostly ASCII letters, no runaway
    repetition, no second speaker turn folded in."""
    t = text.strip()
    words = t.split()
    if not 3 <= len(words) <= 200:
        return False
    if sum(c.isascii() for c in t) < 0.95 * len(t):
        return False
    if len(set(words)) < 0.4 * len(words):
        return False
    return not re.search(r"(^|\n)\s*(A|Assistant|User|Q)\s*:", t)


# --------------------------------------------------------------------------- template sources


@lru_cache(maxsize=2)
def _corpus(seed: int):
    from ..data import calibration_corpus

    return calibration_corpus(None, seed)


def corpus_split(split: str, seed: int = 0) -> tuple[list, list]:
    """(code chunks, prose chunks) of ``split``: the last :data:`HELDOUT_FRACTION` of the seeded
    corpus order is held out."""
    if split not in SPLITS:
        raise YggError(f"unknown split {split!r}; expected one of {SPLITS}")
    chunks = list(_corpus(seed).chunks)
    cut = int(len(chunks) * (1 - HELDOUT_FRACTION))
    part = chunks[:cut] if split == "train" else chunks[cut:]
    return [c for c in part if c.is_code], [c for c in part if not c.is_code]


@lru_cache(maxsize=2)
def _stdlib_functions_all(seed: int) -> tuple[tuple[str, str, str], ...]:
    """(signature line, docstring, body) of documented top-level stdlib functions with short bodies, in a
    seeded order; signatures that name a HumanEval entry point are left out."""
    import sysconfig
    from pathlib import Path

    from ..data import evaluation_texts, stdlib_source_paths

    banned = {t[4:-1] for t in evaluation_texts() if t.startswith("def ") and t.endswith("(")}
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in stdlib_source_paths(root):
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = src.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.name in banned:
                continue
            doc = ast.get_docstring(node)
            if not doc or not 40 <= len(doc) <= 600 or not node.body or node.end_lineno is None:
                continue
            first = node.body[1] if len(node.body) > 1 else None
            if first is None or node.end_lineno - node.lineno > 30:
                continue
            header = lines[node.lineno - 1]
            if not header.rstrip().endswith(":") or node.decorator_list:
                continue
            body = "\n".join(lines[first.lineno - 1 : node.end_lineno])
            out.append((header.strip(), doc, textwrap.dedent(body)))
    random.Random(f"functions/{seed}").shuffle(out)
    return tuple(out)


def stdlib_functions(split: str, seed: int = 0) -> list[tuple[str, str, str]]:
    items = list(_stdlib_functions_all(seed))
    cut = int(len(items) * (1 - HELDOUT_FRACTION))
    return items[:cut] if split == "train" else items[cut:]


def _snippet(text: str, max_chars: int) -> str:
    if len(text) > max_chars:
        cut = text.rfind("\n", 0, max_chars)
        text = text[: cut + 1] if cut > 0 else text[:max_chars]
    return textwrap.dedent(text).strip("\n") + "\n"


_MUTATIONS = ((" == ", " != "), (" != ", " == "), (" < ", " <= "), (" > ", " >= "), (" + 1", " - 1"),
              (" and ", " or "), (" is None", " is not None"), ("[0]", "[1]"), (" += ", " -= "))


def plant_bug(code: str, rng: random.Random) -> str | None:
    """``code`` with one operator swapped (the first applicable mutation in a random order), or None."""
    muts = list(_MUTATIONS)
    rng.shuffle(muts)
    for a, b in muts:
        idx = [m.start() for m in re.finditer(re.escape(a), code)]
        if idx:
            i = rng.choice(idx)
            return code[:i] + b + code[i + len(a) :]
    return None


_CODE = (
    "Explain what this code does:\n```python\n{s}```",
    "Continue this code:\n```python\n{s}```",
    "Review this Python code and point out possible bugs:\n```python\n{s}```",
    "Write a short docstring for the following code:\n```python\n{s}```",
    "Write pytest unit tests for this code:\n```python\n{s}```",
    "Rewrite this code so that it is easier to read, and say what you changed:\n```python\n{s}```",
    "What does this code print or return? Think step by step:\n```python\n{s}```",
    "Translate this Python code into plain English, line by line:\n```python\n{s}```",
    "How could this code be made faster or shorter?\n```python\n{s}```",
    "I don't understand this part of my program. Can you walk me through it?\n\n{s}",
)
_BUG = (
    "This code has a bug. Find it and fix it:\n```python\n{s}```",
    "My function gives the wrong result. What is wrong with it?\n```python\n{s}```",
)
_FUNCTION = (
    "Write a Python function `{sig}` that does the following:\n{doc}",
    "Complete the following function.\n```python\n{sig}\n    \"\"\"{doc}\"\"\"\n```",
    "Implement this in Python and explain your solution:\n{sig}\n{doc}",
)
_PROSE = (
    "Summarise:\n{s}",
    "Explain the following in simple terms:\n{s}",
    "Write three questions a student could answer after reading this:\n{s}",
    "List the key points of this text as bullet points:\n{s}",
    "You are a patient teacher. Explain this to a 12-year-old, with an everyday analogy:\n{s}",
    "Draft a short email to a colleague that explains the following:\n{s}",
    "Extract the technical terms in this text and define each in one sentence:\n{s}",
    "Rewrite this text in a friendly, informal tone:\n{s}",
    "Write a Python example that demonstrates this, then explain it:\n{s}",
)
_TOPIC = (
    "Compare {a} and {b} in Python. When would you use each?",
    "What is the difference between {a} and {b}?",
    "Write a short blog post introducing {a} to beginners.",
    "Give me five tips for using {a} well.",
    "Write a short story in which a programmer learns about {a}.",
    "Pretend you are a senior engineer mentoring a junior. Explain {a}.",
    "What are common mistakes people make with {a}, and how can they be avoided?",
)
_MATH = (
    "A shop sells {a} notebooks for {b} dollars each and {c} pens for {d} dollars each. How much do they "
    "cost together? Answer step by step.",
    "A train travels {a} km in {b} hours. At the same speed, how far does it go in {c} hours? Show your work.",
    "If {a} workers finish a job in {b} days, how many days would {c} workers need? Explain.",
    "What is {a} multiplied by {b}, minus {c}? Think step by step.",
    "Anna has {a} apples. She gives {b} to Ben and buys {c} more. How many does she have now?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
)
_ROLES = ("a travel guide", "a chef", "a fitness coach", "a history teacher", "a detective", "a poet",
          "a customer support agent", "a job interviewer", "a museum curator", "a gardener")
_ROLE_TASKS = (
    "Pretend you are {r}. Introduce yourself and give me one piece of advice.",
    "Act as {r} and answer: what does a typical day look like for you?",
    "You are {r}. Write a short welcome message for a newcomer.",
    "Role-play as {r}: describe the most interesting thing that happened to you this week.",
)
FOLLOW_UPS = (
    "Can you make that shorter?",
    "Give me a concrete example.",
    "Now explain it to a complete beginner.",
    "Rewrite your answer as a bulleted list.",
    "What are the limitations of this?",
    "Can you add comments to the code?",
    "Thanks! Can you summarise that in one sentence?",
    "Why is that the case?",
    "What would you do differently?",
    "Can you give me two alternatives?",
)
MULTI_TURN_SHARE = 0.25
KINDS = ("magpie", "code", "bug", "function", "prose", "topic", "math", "role")
# share of each kind in a shard (magpie is sampled by the target; the rest come from templates)
MIX = {"magpie": 0.45, "code": 0.17, "bug": 0.05, "function": 0.08, "prose": 0.08, "topic": 0.07,
       "math": 0.05, "role": 0.05}


def _topics(prose_chunks) -> list[str]:
    names = sorted({c.source.split(":", 1)[1] for c in prose_chunks if ":" in c.source})
    return [n.replace("-", " ") for n in names if len(n) > 2]


def template_request(kind: str, rng: random.Random, split: str, seed: int = 0, snippet_chars: int = 600) -> Request | None:
    """One request of template family ``kind`` (not ``magpie``), or None when the draw is unusable."""
    code, prose = corpus_split(split, seed)
    if kind == "code":
        return Request(kind, rng.choice(_CODE).format(s=_snippet(rng.choice(code).text, snippet_chars)))
    if kind == "bug":
        fns = stdlib_functions(split, seed)
        sig, _, body = rng.choice(fns)
        bad = plant_bug(sig + "\n" + textwrap.indent(body, "    "), rng)
        return None if bad is None else Request(kind, rng.choice(_BUG).format(s=bad.rstrip("\n") + "\n"))
    if kind == "function":
        sig, doc, _ = rng.choice(stdlib_functions(split, seed))
        sig = sig[4:].rstrip(":") if sig.startswith("def ") else sig
        t = rng.choice(_FUNCTION)
        if t.startswith("Complete"):
            return Request(kind, t.format(sig="def " + sig + ":", doc=doc))
        return Request(kind, t.format(sig=sig, doc=doc))
    if kind == "prose":
        return Request(kind, rng.choice(_PROSE).format(s=_snippet(rng.choice(prose).text, snippet_chars)))
    if kind == "topic":
        names = _topics(prose) + sorted({c.source.split("/")[0].removesuffix(".py") for c in code})
        a, b = rng.sample(names, 2)
        return Request(kind, rng.choice(_TOPIC).format(a=a, b=b))
    if kind == "math":
        nums = {k: rng.randint(2, 60) for k in "abcd"}
        return Request(kind, rng.choice(_MATH).format(**nums))
    if kind == "role":
        return Request(kind, rng.choice(_ROLE_TASKS).format(r=rng.choice(_ROLES)))
    raise YggError(f"unknown request kind {kind!r}")


def draw_kinds(n: int, rng: random.Random) -> list[str]:
    """``n`` request kinds drawn by :data:`MIX`."""
    kinds = list(MIX)
    return rng.choices(kinds, weights=[MIX[k] for k in kinds], k=n)


def with_follow_up(req: Request, rng: random.Random) -> Request:
    """``req`` with a second user turn for a :data:`MULTI_TURN_SHARE` share of draws."""
    if rng.random() < MULTI_TURN_SHARE:
        return Request(req.kind, req.text, rng.choice(FOLLOW_UPS))
    return req
