"""Answer scorers of the published benchmarks (written from their definitions, not copied).

- GSM8K: the final number of the model's answer against the number after ``####`` in the reference
  (numeric equality; commas, ``$`` and a trailing ``.`` ignored) — the "flexible extract" rule.
- LongBench (English datasets): token F1 on normalized answers (QA), ROUGE-L F1 on whitespace tokens
  (summarization), class match (TREC), paragraph-number match (retrieval), count match
  (passage_count) and edit similarity of the first code line (LCC, RepoBench-P); the score of a
  prediction is its best score over the reference answers, in ``[0, 1]``.
- Line completion: exact match and edit similarity of one line.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from difflib import SequenceMatcher

from kvpolicy.errors import ConfigError

_NUMBER = re.compile(r"-?[$]?\d[\d,]*(?:\.\d+)?")


# ---------------------------------------------------------------------- GSM8K
def gsm8k_reference(answer: str) -> str:
    """The number after ``####`` of a GSM8K reference answer (commas removed)."""
    if "####" not in answer:
        raise ValueError(f"a GSM8K answer ends with '#### <number>'; got {answer[-80:]!r}")
    return _clean_number(answer.rsplit("####", 1)[1].strip())


def last_number(text: str) -> str | None:
    """The last number in ``text`` (commas and ``$`` removed), or None."""
    found = _NUMBER.findall(text)
    return _clean_number(found[-1]) if found else None


def _clean_number(s: str) -> str:
    return s.replace(",", "").replace("$", "").rstrip(".").strip()


def gsm8k_score(prediction: str, reference_answer: str) -> float:
    """1.0 when the last number of ``prediction`` equals the reference number, else 0.0."""
    got, want = last_number(prediction), gsm8k_reference(reference_answer)
    if got is None:
        return 0.0
    try:
        return float(abs(float(got) - float(want)) < 1e-6)
    except ValueError:
        return float(got == want)


# ---------------------------------------------------------------------- text normalization
def normalize_answer(s: str) -> str:
    """Lower case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD style)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: list[str], reference: list[str]) -> float:
    """F1 of the multiset overlap of two token lists."""
    common = Counter(prediction) & Counter(reference)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    """Token F1 of the normalized answers."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (longest common subsequence of whitespace tokens)."""
    a, b = prediction.split(), reference.split()
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def edit_similarity(prediction: str, reference: str) -> float:
    """``difflib`` similarity ratio of two strings in ``[0, 1]`` (1: identical)."""
    if not prediction and not reference:
        return 1.0
    return SequenceMatcher(None, prediction, reference, autojunk=False).ratio()


def first_code_line(prediction: str) -> str:
    """The first line of a prediction that is code (not empty, a comment or a Markdown fence)."""
    for line in prediction.lstrip("\n").split("\n"):
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "//", "```")):
            return line
    return ""


def code_similarity(prediction: str, reference: str) -> float:
    """Edit similarity of the first code line of ``prediction`` and ``reference``."""
    return edit_similarity(first_code_line(prediction).strip(), reference.strip())


def classification(prediction: str, reference: str, all_classes: list[str]) -> float:
    """``1 / m`` when the reference class is among the ``m`` classes named in the prediction."""
    named = [c for c in all_classes if c in prediction]
    named = [c for c in named if not any(c != o and c in o for o in named)]
    return 1.0 / len(named) if reference in named else 0.0


def retrieval(prediction: str, reference: str) -> float:
    """Share of the numbers in the prediction equal to the paragraph number of the reference."""
    want = re.findall(r"Paragraph (\d+)", reference)
    numbers = re.findall(r"\d+", prediction)
    if not want or not numbers:
        return 0.0
    return sum(n == want[0] for n in numbers) / len(numbers)


def count(prediction: str, reference: str) -> float:
    """Share of the numbers in the prediction equal to the reference count."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == str(reference).strip() for n in numbers) / len(numbers)


#: LongBench dataset -> scorer name (English datasets; the Chinese ones need a word segmenter)
LONGBENCH_METRIC = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "triviaqa": "qa_f1",
    "gov_report": "rouge_l",
    "qmsum": "rouge_l",
    "multi_news": "rouge_l",
    "samsum": "rouge_l",
    "trec": "classification",
    "passage_retrieval_en": "retrieval",
    "passage_count": "count",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}


def longbench_score(dataset: str, prediction: str, answers: list[str], all_classes: list[str] | None = None) -> float:
    """Best score of ``prediction`` over ``answers`` with the dataset's metric, in ``[0, 1]``."""
    name = dataset.removesuffix("_e")  # LongBench-E files carry the same datasets
    metric = LONGBENCH_METRIC.get(name)
    if metric is None:
        raise ConfigError(
            f"LongBench dataset {dataset!r} has no scorer here; supported: {sorted(LONGBENCH_METRIC)} "
            "(the Chinese datasets need a word segmenter and are not supported)"
        )
    if name in ("triviaqa", "samsum", "trec"):
        prediction = prediction.lstrip("\n").split("\n")[0]  # few-shot datasets: the answer is the first line
    best = 0.0
    for ref in answers:
        if metric == "qa_f1":
            s = qa_f1(prediction, ref)
        elif metric == "rouge_l":
            s = rouge_l(prediction, ref)
        elif metric == "classification":
            s = classification(prediction, ref, all_classes or [])
        elif metric == "retrieval":
            s = retrieval(prediction, ref)
        elif metric == "count":
            s = count(prediction, ref)
        else:
            s = code_similarity(prediction, ref)
        best = max(best, s)
    return best
