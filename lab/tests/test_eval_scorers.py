"""Scorers of GSM8K, LongBench and line completion, on hand-worked examples."""

from __future__ import annotations

import pytest

from kvpolicy.errors import ConfigError
from kvpolicy_lab.eval import scorers


def test_gsm8k_reference_and_last_number():
    assert scorers.gsm8k_reference("She has 3 + 4 = 7 apples.\n#### 1,234") == "1234"
    assert scorers.last_number("so 12 then 15.5, The answer is $1,200.") == "1200"
    assert scorers.last_number("no digits here") is None
    with pytest.raises(ValueError, match="####"):
        scorers.gsm8k_reference("no marker 5")


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [("The answer is 18.", 1.0), ("18.0", 1.0), ("It is 17. The answer is 19", 0.0), ("eighteen", 0.0)],
)
def test_gsm8k_score(prediction, expected):
    assert scorers.gsm8k_score(prediction, "16 - 3 - 4 = 9 eggs; 9 * 2 = 18\n#### 18") == expected


def test_normalize_and_qa_f1_by_hand():
    assert scorers.normalize_answer("The  Cat, sat!") == "cat sat"
    # prediction tokens {cat, sat, mat}, reference {cat, on, mat}: overlap 2 -> P = R = 2/3 -> F1 = 2/3
    assert scorers.qa_f1("the cat sat mat", "cat on the mat") == pytest.approx(2 / 3)
    assert scorers.qa_f1("dog", "cat") == 0.0


def test_rouge_l_by_hand():
    # LCS of "a b c d" and "a c d e" is "a c d" (3): P = 3/4, R = 3/4
    assert scorers.rouge_l("a b c d", "a c d e") == pytest.approx(0.75)
    assert scorers.rouge_l("", "a") == 0.0
    assert scorers.rouge_l("x y", "x y") == 1.0


def test_code_similarity_uses_first_code_line():
    pred = "\n# a comment\n```\n    return x + 1\nmore"
    assert scorers.first_code_line(pred) == "    return x + 1"
    assert scorers.code_similarity(pred, "return x + 1") == 1.0
    assert 0 < scorers.code_similarity("return x + 2", "return x + 1") < 1


def test_classification_retrieval_count():
    classes = ["Location", "Description", "Abbreviation"]
    assert scorers.classification("Location", "Location", classes) == 1.0
    assert scorers.classification("Location or Description", "Location", classes) == 0.5
    assert scorers.classification("Abbreviation", "Location", classes) == 0.0
    assert scorers.retrieval("Paragraph 3", "Paragraph 3") == 1.0
    assert scorers.retrieval("Paragraph 3 or 4", "Paragraph 3") == 0.5
    assert scorers.count("There are 7 paragraphs", "7") == 1.0
    assert scorers.count("5 or 7", "7") == 0.5


def test_longbench_dispatch_best_over_answers_and_unknown_dataset():
    assert scorers.longbench_score("hotpotqa", "Paris", ["London", "Paris"]) == 1.0
    assert scorers.longbench_score("lcc", "x = 1\n", ["x = 1"]) == 1.0
    assert scorers.longbench_score("triviaqa_e", "Paris\nextra words", ["Paris"]) == 1.0
    with pytest.raises(ConfigError, match="supported"):
        scorers.longbench_score("dureader", "x", ["x"])


def test_edit_similarity_bounds():
    assert scorers.edit_similarity("", "") == 1.0
    assert scorers.edit_similarity("abc", "xyz") == 0.0
    assert scorers.edit_similarity("abcd", "abce") == pytest.approx(0.75)
