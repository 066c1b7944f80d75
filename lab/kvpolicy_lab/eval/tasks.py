"""Evaluation tasks: each turns (tokenizer, context length, seed) into deterministic samples.

Two kinds of samples:

- ``teacher_forced``: a token sequence; the first ``prefill`` tokens are the context, the rest are
  fed one at a time through the cache and scored against the uncompressed cache (ΔNLL, KL, top-1);
- ``generate``: a prompt answered greedily (``max_new_tokens``, optional stop at a newline) and
  scored by the task (passkey, key-value retrieval, line completion, GSM8K, LongBench).

Every sample is a pure function of the task's parameters, the tokenizer, the context length and the
seed. Text comes from the running Python's standard library (``sysconfig.get_paths()["stdlib"]``),
generated strings, local JSONL files (``gsm8k``, ``longbench``) or the pinned datasets of
:mod:`kvpolicy_lab.eval.data` (``lm-essays``, ``niah``, ``hotpotqa``, ``gsm8k-workload``), fetched into the
user cache on first use.
"""

from __future__ import annotations

import functools
import json
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval import data, scorers
from kvpolicy_lab.eval.data import read_jsonl
from kvpolicy_lab.eval.wheels import ChecksumMismatchError, FetchError

#: standard-library files for teacher-forced language modelling (present in Python 3.10-3.13)
LM_FILES = (
    "argparse.py", "inspect.py", "typing.py", "subprocess.py",
    "difflib.py", "configparser.py", "doctest.py", "tarfile.py",
)  # fmt: skip
#: standard-library files for choosing settings (``kvpolicy tune``, scripts/quantizer_quality.py), disjoint
#: from LM_FILES, whose first five the frontier reports on
CALIBRATION_FILES = ("enum.py", "dataclasses.py", "functools.py", "pickle.py", "zipfile.py")
#: standard-library files for line completion (disjoint from LM_FILES)
CODE_FILES = (
    "pydoc.py", "threading.py", "mailbox.py", "smtplib.py",
    "imaplib.py", "shutil.py", "statistics.py", "ftplib.py",
)  # fmt: skip


@dataclass(frozen=True)
class Sample:
    """One evaluation item.

    Attributes
    ----------
    task, sample_id : str
        Task name and a stable id within the task.
    kind : {"teacher_forced", "generate"}
    ids : list of int
        The token ids (the whole text for ``teacher_forced``, the prompt for ``generate``).
    prefill : int
        Context tokens (``teacher_forced``); ``len(ids)`` for ``generate``.
    answer : Any
        What the scorer compares the generation with.
    max_new_tokens : int
    stop_at_newline : bool
        Stop generating at the first newline after some text (line completion).
    against_reference : bool
        Scored against the uncompressed cache's own greedy continuation (:class:`GreedyAgreement`),
        which the reference run then generates.
    meta : dict
        Depth, file, prompt length... copied into the results.
    """

    task: str
    sample_id: str
    kind: str
    ids: list[int]
    prefill: int
    answer: Any = None
    max_new_tokens: int = 0
    stop_at_newline: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    against_reference: bool = False


# ---------------------------------------------------------------------- tokenizer helpers
def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_ids(tokenizer: Any, user: str) -> list[int]:
    """Ids of a one-turn chat ending where the assistant answers: the model's chat template when it
    has one, else ``"User: ...\\nAssistant:"``."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        ids = out["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)
    return encode(tokenizer, f"User: {user}\nAssistant:")


def stdlib_text(name: str) -> str:
    """Source text of a standard-library file."""
    path = Path(sysconfig.get_paths()["stdlib"]) / name
    if not path.is_file():
        raise ConfigError(f"standard-library file {name!r} not found in {path.parent}")
    return path.read_text(encoding="utf-8")


def _check_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{owner}: {name} must be an integer >= 1; got {name}={value!r}")


def _check_depths(owner: str, depths: tuple[float, ...]) -> None:
    if not depths or any(not isinstance(d, (int, float)) or not 0 <= d <= 1 for d in depths):
        raise ConfigError(f"{owner}: depths must be numbers in [0, 1]; got depths={depths!r}")


def _dataset(task: str, name: str, load: Any) -> Any:
    """``load()``, its fetch and checksum errors as a one-line :class:`ConfigError` naming ``task`` and
    ``name`` (the error's first line, which says what to fetch and how, and the last line of pip's
    output when it was captured)."""
    try:
        return load()
    except (FetchError, ChecksumMismatchError) as exc:
        first, *rest = str(exc).splitlines() or [""]
        said = next((line.strip() for line in reversed(rest) if line.strip() and not line.startswith("---")), "")
        raise ConfigError(
            f"task {task!r} needs dataset {name!r}, which is not available: {first}"
            + (f" (pip said: {said})" if said else "")
        ) from exc


@functools.lru_cache(maxsize=2)
def _read_essays(path: str, stamp: tuple[int, int]) -> str:
    """The essays of the cached file ``path`` as one text (``stamp``: its mtime and size, so that a
    changed file is read again)."""
    return "\n\n".join(data.essays(progress=False))


def essay_text(task: str, progress: bool = True) -> str:
    """The essays (dataset ``essays``) as one text: fetched on first use, kept in memory while the
    cached file is unchanged.

    Raises
    ------
    ConfigError
        The dataset cannot be fetched (the message names ``task`` and says how to fetch it).
    """
    p = _dataset(task, "essays", lambda: data.path("essays", progress))
    st = p.stat()
    return _read_essays(str(p), (st.st_mtime_ns, st.st_size))


# ---------------------------------------------------------------------- tasks
class Task:
    """Base class: ``samples(tokenizer, context, seed)`` and ``score(sample, text)`` (or
    ``score_against`` for samples scored against the uncompressed cache's own generation)."""

    name: ClassVar[str] = ""
    #: whether the samples depend on the context length (False: run once per cache)
    uses_context: ClassVar[bool] = True
    #: the datasets of :mod:`kvpolicy_lab.eval.data` the samples are drawn from
    datasets: ClassVar[tuple[str, ...]] = ()

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        raise NotImplementedError

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        """Scores of a generation in ``[0, 1]``; the first is the task's accuracy."""
        raise NotImplementedError

    def score_against(
        self, sample: Sample, tokens: list[int], reference: list[int], tokenizer: Any
    ) -> dict[str, float]:
        """Scores of the generated ``tokens`` of a sample with ``against_reference`` set, against the
        uncompressed cache's greedy ``reference`` tokens (both ``sample.max_new_tokens`` long, end of
        sequence included)."""
        raise NotImplementedError(f"task {self.name!r} has no samples scored against the reference")

    def fetch(self, progress: bool = True) -> None:
        """Fetch the task's :attr:`datasets` into the user cache (nothing for tasks without any).

        Raises
        ------
        ConfigError
            A dataset cannot be fetched or fails its checksum; the message names the task and the
            dataset and says what to fetch and how.
        """
        for name in self.datasets:
            _dataset(self.name, name, lambda name=name: data.path(name, progress))


@dataclass(frozen=True)
class _TeacherForcedText(Task):
    """Base of the teacher-forced tasks: ``samples_per_context`` texts of ``context + tokens`` tokens
    (:meth:`_texts`); the first ``context`` are the prefill, the next ``tokens`` are scored."""

    samples_per_context: int = 2
    tokens: int = 64

    def __post_init__(self) -> None:
        _check_positive(f"task {self.name!r}", samples_per_context=self.samples_per_context, tokens=self.tokens)

    def _texts(self, tokenizer: Any, need: int, seed: int) -> Iterator[tuple[list[int], str, dict[str, Any]]]:
        """``samples_per_context`` texts of at least ``need`` tokens: ``(ids, tag of the sample id, meta)``."""
        raise NotImplementedError

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        need = context + self.tokens
        return [Sample(self.name, f"{i}:{tag}", "teacher_forced", ids[:need], context, meta=meta)
                for i, (ids, tag, meta) in enumerate(self._texts(tokenizer, need, seed))]  # fmt: skip


@dataclass(frozen=True)
class LanguageModeling(_TeacherForcedText):
    """Teacher-forced language modelling on standard-library source files.

    Sample ``i`` concatenates files of ``files`` (a seeded permutation, starting at file ``i``) until
    ``context + tokens`` tokens; the first ``context`` are the prefill, the next ``tokens`` are scored.
    """

    files: tuple[str, ...] = LM_FILES

    name = "lm"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "files", tuple(self.files))
        if not self.files:
            raise ConfigError("task 'lm': files must name at least one standard-library file")

    def _texts(self, tokenizer: Any, need: int, seed: int) -> Iterator[tuple[list[int], str, dict[str, Any]]]:
        order = list(self.files)
        random.Random(seed).shuffle(order)
        for i in range(self.samples_per_context):
            ids: list[int] = []
            used = []
            for name in order[i % len(order) :] + order[: i % len(order)]:
                ids += encode(tokenizer, stdlib_text(name))
                used.append(name)
                if len(ids) >= need:
                    break
            if len(ids) < need:
                raise ConfigError(f"task 'lm': the files {list(self.files)} hold {len(ids)} tokens; {need} needed")
            yield ids, used[0], {"files": used}


@dataclass(frozen=True)
class EssayLanguageModeling(_TeacherForcedText):
    """Teacher-forced language modelling on English prose: the essays of dataset ``essays``.

    Sample ``i`` is a slice of the essays (one text) of ``context + tokens`` tokens starting at a
    seeded character offset (the first word boundary after it); the first ``context`` tokens are the
    prefill, the next ``tokens`` are scored, as in ``lm``.
    """

    name = "lm-essays"
    datasets = ("essays",)

    def _texts(self, tokenizer: Any, need: int, seed: int) -> Iterator[tuple[list[int], str, dict[str, Any]]]:
        text = essay_text(self.name)
        rng = random.Random(f"{seed}:{self.name}")
        for _ in range(self.samples_per_context):
            start = _word_start(text, rng.randrange(len(text)))
            ids = _slice_ids(tokenizer, text, start, need, self.name)
            yield ids, f"@{start}", {"offset": start}


_WORD = re.compile(r"(?<!\S)\S")


def _word_start(text: str, at: int) -> int:
    """The first character of the first word that starts at or after ``at`` (0 when none)."""
    match = _WORD.search(text, at)
    return match.start() if match else 0


def _slice_ids(tokenizer: Any, text: str, start: int, need: int, task: str) -> list[int]:
    """At least ``need`` token ids of ``text`` from character ``start`` on (continuing from its start
    at the end, once at most)."""
    cyclic = text[start:] + "\n\n" + text[:start]
    size = 6 * need + 64
    while True:
        ids = encode(tokenizer, cyclic[:size])
        if len(ids) >= need + 1 or size >= len(cyclic):  # one spare: the cut at the end may split a word
            break
        size *= 2
    if len(ids) < need:
        raise ConfigError(f"task {task!r}: the essays hold {len(ids)} tokens; {need} needed (context + tokens)")
    return ids


@dataclass(frozen=True)
class GreedyAgreement(LanguageModeling):
    """Greedy generation compared with the uncompressed cache's: the texts of :class:`LanguageModeling`,
    the first ``context`` tokens as the prompt, ``tokens`` greedy tokens.

    Scores: ``identical`` (share of the reference's tokens generated at the same place) and
    ``first_divergence`` (tokens generated before the first difference; ``tokens`` when none). Both
    runs generate all ``tokens`` tokens, through end-of-sequence tokens too.
    """

    tokens: int = 256

    name = "greedy"

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        out = []
        for text in super().samples(tokenizer, context, seed):
            out.append(Sample(self.name, text.sample_id, "generate", text.ids[:context], context,
                              max_new_tokens=self.tokens, meta=text.meta, against_reference=True))  # fmt: skip
        return out

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        raise ConfigError("task 'greedy' is scored against the reference's tokens: use score_tokens")

    def score_against(
        self, sample: Sample, tokens: list[int], reference: list[int], tokenizer: Any
    ) -> dict[str, float]:
        return self.score_tokens(tokens, reference)

    @staticmethod
    def score_tokens(tokens: list[int], reference: list[int]) -> dict[str, float]:
        """``identical`` and ``first_divergence`` of ``tokens`` against ``reference``."""
        longest = max(len(tokens), len(reference))
        if longest == 0:
            return {"identical": 1.0, "first_divergence": 0.0}
        same = [a == b for a, b in zip(tokens, reference, strict=False)]
        # where one stopped (end of sequence) and the other went on counts as the divergence
        first = next((i for i, ok in enumerate(same) if not ok), len(same))
        return {"identical": sum(same) / longest, "first_divergence": float(first)}


_FILLER = (
    "The river ran past the old mill and on toward the sea.",
    "A gardener planted rows of beans along the southern wall.",
    "Clouds gathered over the hills in the late afternoon.",
    "The library kept its maps in long, shallow drawers.",
    "Two cats slept on the warm stones of the courtyard.",
    "The baker opened the shop before the first train arrived.",
    "Wind moved through the tall grass at the edge of the field.",
    "Someone had left a lantern burning by the boathouse door.",
    "The market sold apples, cheese and bread every Saturday.",
    "An old clock in the hall struck the hour a little late.",
)


def _haystack(tokenizer: Any, budget: int, rng: random.Random) -> list[str]:
    """Filler sentences (seeded order) whose tokens add up to at most ``budget``."""
    costs = {s: len(encode(tokenizer, " " + s)) for s in _FILLER}
    out: list[str] = []
    used = 0
    while True:
        s = rng.choice(_FILLER)
        if used + costs[s] > budget:
            return out
        out.append(s)
        used += costs[s]


class _HiddenItem(Task):
    """Base of the retrieval tasks: ``samples_per_depth`` prompts per depth in ``depths``, each hiding
    an item (the answer) at that depth (:meth:`_hide`); correct when the generation contains the answer."""

    depths: tuple[float, ...]
    samples_per_depth: int
    max_new_tokens: int

    def _check(self, **positive: int) -> None:
        """Make ``depths`` a tuple and check it, then check ``positive`` (in order) are integers >= 1."""
        owner = f"task {self.name!r}"
        object.__setattr__(self, "depths", tuple(self.depths))
        _check_depths(owner, self.depths)
        _check_positive(owner, **positive)

    def _hide(self, tokenizer: Any, context: int, depth: float, rng: random.Random) -> tuple[list[int], str, dict]:
        """One prompt of about ``context`` tokens hiding an item at ``depth``: ``(ids, answer, meta)``."""
        raise NotImplementedError

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        rng = random.Random(f"{seed}:{self.name}:{context}")
        out = []
        for depth in self.depths:
            for j in range(self.samples_per_depth):
                ids, answer, meta = self._hide(tokenizer, context, depth, rng)
                meta = {"depth": depth, **meta, "prompt_tokens": len(ids)}
                out.append(Sample(self.name, f"d{depth}:{j}", "generate", ids, len(ids), answer, self.max_new_tokens,
                                  meta=meta))  # fmt: skip
        return out

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        return {"accuracy": float(str(sample.answer) in text)}


@dataclass(frozen=True)
class Passkey(_HiddenItem):
    """Passkey retrieval: a random ``digits``-digit key hidden at ``depth`` in filler text of about
    ``context`` tokens (chat template included); correct when the answer contains the key."""

    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    samples_per_depth: int = 1
    digits: int = 5
    max_new_tokens: int = 12

    name = "passkey"

    def __post_init__(self) -> None:
        self._check(samples_per_depth=self.samples_per_depth, digits=self.digits, max_new_tokens=self.max_new_tokens)

    def _prompt(self, haystack: list[str], key: str, depth: float) -> str:
        at = round(depth * len(haystack))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        text = " ".join([*haystack[:at], needle, *haystack[at:]])
        return (
            "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
            f"{text}\n\nWhat is the pass key? Answer with the number only."
        )

    def _hide(self, tokenizer: Any, context: int, depth: float, rng: random.Random) -> tuple[list[int], str, dict]:
        key = str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))
        overhead = len(chat_ids(tokenizer, self._prompt([], key, depth)))
        haystack = _haystack(tokenizer, max(0, context - overhead), rng)
        return chat_ids(tokenizer, self._prompt(haystack, key, depth)), key, {}


#: a piece of the essays: text up to the end of a sentence (and the whitespace after it) or of a line
_SENTENCE = re.compile(r".*?(?:[.!?][\"')\]]*\s+|\n)", re.S)


def _essay_haystack(tokenizer: Any, text: str, start: int, budget: int) -> list[str]:
    """Consecutive sentences of ``text`` from the first sentence start at or after ``start`` (continuing
    from its start at the end, once at most), whole, whose tokens add up to at most ``budget``."""
    first = _SENTENCE.match(text, start)
    begin = first.end() if first is not None and first.end() < len(text) else 0
    cyclic = text[begin:] + "\n\n" + text[:begin]
    out: list[str] = []
    used = pos = 0
    while used < budget:
        m = _SENTENCE.match(cyclic, pos)
        if m is None:
            break
        cost = len(encode(tokenizer, m.group()))
        if used + cost > budget:
            break
        out.append(m.group())
        used += cost
        pos = m.end()
    return out


@dataclass(frozen=True)
class NeedleInEssays(_HiddenItem):
    """Needle in a haystack: a sentence holding a random ``digits``-digit number hidden at ``depth`` in
    consecutive sentences of the essays (dataset ``essays``, from a seeded offset), the prompt about
    ``context`` tokens (chat template included); correct when the answer contains the number. Meant for
    contexts of 4k-16k tokens."""

    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    samples_per_depth: int = 1
    digits: int = 7
    max_new_tokens: int = 16

    name = "niah"
    datasets = ("essays",)

    def __post_init__(self) -> None:
        self._check(samples_per_depth=self.samples_per_depth, digits=self.digits, max_new_tokens=self.max_new_tokens)

    @staticmethod
    def _prompt(haystack: list[str], needle: str, depth: float) -> str:
        at = round(depth * len(haystack))
        text = "".join([*haystack[:at], needle, " ", *haystack[at:]]).strip()
        return (
            "Below is a long text taken from essays. A special magic number is hidden somewhere in it; find it "
            f"and remember it.\n\n{text}\n\nWhat is the special magic number mentioned in the text? Answer with "
            "the number only."
        )

    def _hide(self, tokenizer: Any, context: int, depth: float, rng: random.Random) -> tuple[list[int], str, dict]:
        text = essay_text(self.name)
        key = str(rng.randrange(10 ** (self.digits - 1), 10**self.digits))
        needle = f"The special magic number is {key}."
        overhead = len(chat_ids(tokenizer, self._prompt([], needle, depth)))
        start = rng.randrange(len(text))
        haystack = _essay_haystack(tokenizer, text, start, max(0, context - overhead))
        return chat_ids(tokenizer, self._prompt(haystack, needle, depth)), key, {"offset": start}


@dataclass(frozen=True)
class KeyValueRetrieval(_HiddenItem):
    """Key→value retrieval: a JSON object of random hex keys and values of about ``context`` tokens;
    the question asks for the value of the key at ``depth``; correct when the answer contains it."""

    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    samples_per_depth: int = 1
    max_new_tokens: int = 16

    name = "kv"

    def __post_init__(self) -> None:
        self._check(samples_per_depth=self.samples_per_depth, max_new_tokens=self.max_new_tokens)

    @staticmethod
    def _prompt(pairs: list[tuple[str, str]], key: str) -> str:
        body = json.dumps(dict(pairs), indent=0)
        return (
            f"Here is a JSON object of keys and values:\n{body}\n\n"
            f'What is the value of the key "{key}"? Answer with the value only.'
        )

    def _hide(self, tokenizer: Any, context: int, depth: float, rng: random.Random) -> tuple[list[int], str, dict]:
        pairs: list[tuple[str, str]] = []
        overhead = len(chat_ids(tokenizer, self._prompt([], "0" * 8)))
        pair_cost = None
        while True:
            pair = (f"{rng.getrandbits(32):08x}", f"{rng.getrandbits(32):08x}")
            if pair_cost is None:
                pair_cost = len(encode(tokenizer, json.dumps(dict([pair]), indent=0))) + 1
            if overhead + (len(pairs) + 1) * pair_cost > context and pairs:
                break
            pairs.append(pair)
            if overhead + len(pairs) * pair_cost > context:
                break
        key, value = pairs[min(len(pairs) - 1, round(depth * (len(pairs) - 1)))]
        return chat_ids(tokenizer, self._prompt(pairs, key)), value, {"pairs": len(pairs)}


@dataclass(frozen=True)
class LineCompletion(Task):
    """Next-line completion on long Python files (LongBench LCC in miniature): the prefix is the
    file's first lines up to about ``context`` tokens, cut before a line with at least 8 characters of
    code; scores are exact match and edit similarity of the first generated line."""

    samples_per_context: int = 2
    max_new_tokens: int = 48
    files: tuple[str, ...] = CODE_FILES

    name = "lines"

    def __post_init__(self) -> None:
        _check_positive("task 'lines'", samples_per_context=self.samples_per_context,
                        max_new_tokens=self.max_new_tokens)  # fmt: skip
        object.__setattr__(self, "files", tuple(self.files))
        if not self.files:
            raise ConfigError("task 'lines': files must name at least one standard-library file")

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        order = list(self.files)
        random.Random(seed).shuffle(order)
        out = []
        for i in range(self.samples_per_context):
            name = order[i % len(order)]
            lines = stdlib_text(name).splitlines(keepends=True)
            lo, hi = 0, len(lines)  # largest k with tokens(lines[:k]) <= context
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if len(encode(tokenizer, "".join(lines[:mid]))) <= context:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
            while k > 0 and not _interesting(lines[k] if k < len(lines) else ""):
                k -= 1
            if k == 0:
                raise ConfigError(f"task 'lines': no line to complete in the first {context} tokens of {name}")
            ids = encode(tokenizer, "".join(lines[:k]))
            target = lines[k].rstrip("\n")
            meta = {"file": name, "line": k + 1, "prompt_tokens": len(ids)}
            out.append(Sample(self.name, f"{i}:{name}", "generate", ids, len(ids), target, self.max_new_tokens,
                              stop_at_newline=True, meta=meta))  # fmt: skip
        return out

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        line = text.lstrip("\n").split("\n")[0]
        return {
            "exact_match": float(line.strip() == str(sample.answer).strip()),
            "edit_similarity": scorers.edit_similarity(line.strip(), str(sample.answer).strip()),
        }


def _interesting(line: str) -> bool:
    s = line.strip()
    return len(s) >= 8 and not s.startswith(("#", '"""', "'''"))


def _gsm8k_user(question: str, prefix: str = "") -> str:
    """The user turn asking a GSM8K question (after ``prefix``: worked examples)."""
    return f"{prefix}Question: {question}\nSolve it step by step and end with 'The answer is <number>.'"


def _check_limit(owner: str, **values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{owner}: {name} must be an integer >= 0; got {name}={value!r}")


@dataclass(frozen=True)
class GSM8K(Task):
    """GSM8K from a local JSONL file in the published format (``{"question", "answer"}`` with
    ``#### <number>`` ending the answer); zero-shot chain of thought with the chat template, or
    ``shots`` worked examples taken from the first rows (which are then not scored)."""

    path: str = ""
    limit: int = 0
    shots: int = 0
    max_new_tokens: int = 256

    name = "gsm8k"
    uses_context = False

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("task 'gsm8k': path must name a local JSONL file (GSM8K's test.jsonl format)")
        _check_positive("task 'gsm8k'", max_new_tokens=self.max_new_tokens)
        _check_limit("task 'gsm8k'", limit=self.limit, shots=self.shots)

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        rows = read_jsonl(self.path, ("question", "answer"), "task 'gsm8k'")
        shots, rows = rows[: self.shots], rows[self.shots :]
        if self.limit:
            rows = rows[: self.limit]
        prefix = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in shots)
        out = []
        for i, row in enumerate(rows):
            ids = chat_ids(tokenizer, _gsm8k_user(row["question"], prefix))
            out.append(Sample(self.name, str(i), "generate", ids, len(ids), row["answer"], self.max_new_tokens,
                              meta={"prompt_tokens": len(ids)}))  # fmt: skip
        return out

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        return {"accuracy": scorers.gsm8k_score(text, sample.answer)}


@dataclass(frozen=True)
class GSM8KWorkload(Task):
    """A decoding workload: ``tokens`` greedy tokens after each of the first ``limit`` GSM8K questions
    (dataset ``gsm8k``; the prompt of task ``gsm8k``, through the chat template when the tokenizer has
    one; ``limit=0``: all 1,319), compared token by token with the uncompressed cache's continuation:
    ``identical`` and ``first_divergence`` as in ``greedy``."""

    limit: int = 4
    tokens: int = 256

    name = "gsm8k-workload"
    uses_context = False
    datasets = ("gsm8k",)

    def __post_init__(self) -> None:
        _check_limit(f"task {self.name!r}", limit=self.limit)
        _check_positive(f"task {self.name!r}", tokens=self.tokens)

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        rows = _dataset(self.name, "gsm8k", data.gsm8k)
        out = []
        for i, row in enumerate(rows[: self.limit or None]):
            ids = chat_ids(tokenizer, _gsm8k_user(row["question"]))
            out.append(Sample(self.name, str(i), "generate", ids, len(ids), row["answer"], self.tokens,
                              meta={"prompt_tokens": len(ids)}, against_reference=True))  # fmt: skip
        return out

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        raise ConfigError(f"task {self.name!r} is scored against the reference's tokens: use score_against")

    def score_against(
        self, sample: Sample, tokens: list[int], reference: list[int], tokenizer: Any
    ) -> dict[str, float]:
        return GreedyAgreement.score_tokens(tokens, reference)


def _first_line(tokens: list[int], tokenizer: Any) -> str:
    """The first non-empty line of the text of ``tokens`` up to the first end-of-sequence token."""
    eos = tokenizer.eos_token_id
    stops = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    text = tokenizer.decode(tokens[:end], skip_special_tokens=True).strip()
    return text.split("\n", 1)[0].strip()


@dataclass(frozen=True)
class HotpotQA(Task):
    """Multi-document question answering on HotpotQA (dataset ``hotpotqa``: dev, distractor setting).

    The prompt holds the question's paragraphs as the file has them (the two gold paragraphs among the
    distractors, in the file's order), then the question; the first ``limit`` questions (``0``: all
    7,405). Two samples per question:

    - the answer, ``max_new_tokens`` greedy tokens compared with the uncompressed cache's: ``agreement``
      (their first lines, up to the end of sequence, equal once normalized as SQuAD does) and ``f1``
      (token F1 of the first line against the reference answer);
    - the reference answer teacher-forced after the prompt: ``delta_nll``, ``kl`` and ``top1`` over its
      tokens (as in ``lm``).
    """

    limit: int = 8
    max_new_tokens: int = 32

    name = "hotpotqa"
    uses_context = False
    datasets = ("hotpotqa",)

    def __post_init__(self) -> None:
        _check_limit(f"task {self.name!r}", limit=self.limit)
        _check_positive(f"task {self.name!r}", max_new_tokens=self.max_new_tokens)

    @staticmethod
    def _prompt(row: dict[str, Any]) -> str:
        passages = "\n\n".join(f"Passage {k}: {title}\n{''.join(sentences).strip()}"
                                for k, (title, sentences) in enumerate(row["context"], 1))  # fmt: skip
        return (
            "Answer the question using the passages below. Reply with the answer only, in a few words.\n\n"
            f"{passages}\n\nQuestion: {row['question']}\nAnswer:"
        )

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        rows = _dataset(self.name, "hotpotqa", data.hotpotqa)
        # after a chat template the answer starts the assistant's turn; after "Assistant:" a space comes first
        space = "" if getattr(tokenizer, "chat_template", None) else " "
        out = []
        for i, row in enumerate(rows[: self.limit or None]):
            ids = chat_ids(tokenizer, self._prompt(row))
            meta = {"id": row.get("_id", str(i)), "type": row.get("type"), "prompt_tokens": len(ids)}
            out.append(Sample(self.name, str(i), "generate", ids, len(ids), row["answer"], self.max_new_tokens,
                              meta=meta, against_reference=True))  # fmt: skip
            answer = encode(tokenizer, space + row["answer"])
            if answer:
                out.append(Sample(self.name, f"{i}:answer", "teacher_forced", ids + answer, len(ids), row["answer"],
                                  meta=meta))  # fmt: skip
        return out

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        raise ConfigError(f"task {self.name!r} is scored against the reference's answer: use score_against")

    def score_against(
        self, sample: Sample, tokens: list[int], reference: list[int], tokenizer: Any
    ) -> dict[str, float]:
        mine, ref = _first_line(tokens, tokenizer), _first_line(reference, tokenizer)
        return {
            "agreement": float(scorers.normalize_answer(mine) == scorers.normalize_answer(ref)),
            "f1": scorers.qa_f1(mine, str(sample.answer)),
        }


#: LongBench dataset -> (instruction before the context, question after it, new tokens)
_LONGBENCH_PROMPTS = {
    "qa_f1": ("Read the text below and answer the question as briefly as possible.\n\n", "\n\nQuestion: {input}\n"
              "Answer (a few words):", 32),
    "rouge_l": ("Read the text below.\n\n", "\n\n{input}\nWrite a concise summary:", 128),
    "classification": ("Classify the question into one of the categories shown in the examples.\n\n",
                       "\n{input}", 16),
    "retrieval": ("Below are numbered paragraphs and a summary of one of them.\n\n", "\n\nSummary: {input}\n"
                  "Which paragraph is it? Answer like 'Paragraph 3'.", 16),
    "count": ("Below are paragraphs, some of them repeated.\n\n", "\n\nHow many distinct paragraphs are there? "
              "Answer with a number only.", 16),
    "code_sim": ("", "{input}", 64),
}  # fmt: skip
#: datasets whose prompt is raw text (no chat template), as in LongBench's own runs
_RAW = ("trec", "triviaqa", "samsum", "lcc", "repobench-p")


@dataclass(frozen=True)
class LongBench(Task):
    """LongBench (English datasets) from a local JSONL file in the published format (``input``,
    ``context``, ``answers``, ``dataset``, optional ``all_classes``). The context is truncated in the
    middle so that the prompt fits ``context`` tokens; scoring per dataset (:mod:`scorers`)."""

    path: str = ""
    limit: int = 0
    max_new_tokens: int = 0

    name = "longbench"

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("task 'longbench': path must name a local JSONL file (LongBench's data/*.jsonl format)")
        for name in ("limit", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"task 'longbench': {name} must be an integer >= 0; got {name}={value!r}")

    def samples(self, tokenizer: Any, context: int, seed: int) -> list[Sample]:
        rows = read_jsonl(self.path, ("input", "context", "answers", "dataset"), "task 'longbench'")
        if self.limit:
            rows = rows[: self.limit]
        out = []
        for i, row in enumerate(rows):
            dataset = str(row["dataset"]).removesuffix("_e")
            metric = scorers.LONGBENCH_METRIC.get(dataset)
            if metric is None:
                scorers.longbench_score(dataset, "", [])  # raises the error naming the supported datasets
            head, tail, new = _LONGBENCH_PROMPTS[metric]
            new = self.max_new_tokens or new
            tail = tail.format(input=row["input"])
            ids = self._fit(tokenizer, head, row["context"], tail, context - new, dataset in _RAW)
            meta = {"dataset": dataset, "prompt_tokens": len(ids)}
            answer = {"answers": list(row["answers"]), "all_classes": row.get("all_classes") or [], "dataset": dataset}
            out.append(Sample(self.name, str(row.get("_id", i)), "generate", ids, len(ids), answer, new,
                              stop_at_newline=dataset in ("lcc", "repobench-p"), meta=meta))  # fmt: skip
        return out

    @staticmethod
    def _fit(tokenizer: Any, head: str, body: str, tail: str, budget: int, raw: bool) -> list[int]:
        def build(text: str) -> list[int]:
            return encode(tokenizer, head + text + tail) if raw else chat_ids(tokenizer, head + text + tail)

        ids = build(body)
        if len(ids) <= budget:
            return ids
        body_ids = encode(tokenizer, body)
        keep = max(0, len(body_ids) - (len(ids) - budget))
        while True:
            half = keep // 2
            text = tokenizer.decode(body_ids[:half]) + tokenizer.decode(body_ids[len(body_ids) - (keep - half) :])
            ids = build(text)
            if len(ids) <= budget or keep == 0:
                return ids
            keep = max(0, keep - (len(ids) - budget) - 8)

    def score(self, sample: Sample, text: str) -> dict[str, float]:
        a = sample.answer
        return {"score": scorers.longbench_score(a["dataset"], text, a["answers"], a["all_classes"])}


TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (LanguageModeling, GreedyAgreement, Passkey, KeyValueRetrieval, LineCompletion, GSM8K, LongBench,
                EssayLanguageModeling, NeedleInEssays, HotpotQA, GSM8KWorkload)
}  # fmt: skip


def make_task(name: str, **params: Any) -> Task:
    """Build a task by name with its parameters; unknown names or parameters raise ConfigError."""
    cls = TASKS.get(name)
    if cls is None:
        from kvpolicy.errors import did_you_mean

        raise ConfigError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}{did_you_mean(name, TASKS)}")
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        from kvpolicy.errors import did_you_mean

        raise ConfigError(
            f"task {name!r}: unknown parameter(s) {unknown}; accepted: {sorted(known)}{did_you_mean(unknown[0], known)}"
        )
    tuple_fields = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, tuple)}
    fixed = {}
    for k, v in params.items():
        if k in tuple_fields and isinstance(v, str):
            v = tuple(parse_number(x.strip()) for x in v.split(",") if x.strip())
        elif k in tuple_fields and not isinstance(v, (list, tuple)):
            v = (v,)
        fixed[k] = tuple(v) if isinstance(v, list) else v
    return cls(**fixed)


def parse_number(text: str) -> Any:
    """``"12"`` -> 12, ``"0.5"`` -> 0.5, anything else stays a string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
