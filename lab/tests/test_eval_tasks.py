"""Tasks: deterministic under a seed, sized to the context, reading the published JSONL formats."""

from __future__ import annotations

import json

import pytest

from kvpolicy.errors import ConfigError
from kvpolicy.tiny import ByteTokenizer
from kvpolicy_lab.eval.tasks import (
    GSM8K,
    KeyValueRetrieval,
    LanguageModeling,
    LineCompletion,
    LongBench,
    Passkey,
    make_task,
    stdlib_text,
)

TOK = ByteTokenizer(96)


def seen(text: str) -> str:
    """``text`` as the lossy byte tokenizer renders it."""
    return TOK.decode(TOK.encode(text))


def test_lm_samples_deterministic_and_sized():
    task = LanguageModeling(samples_per_context=2, tokens=16)
    a, b = task.samples(TOK, 300, seed=0), task.samples(TOK, 300, seed=0)
    assert [s.ids for s in a] == [s.ids for s in b]
    assert all(len(s.ids) == 316 and s.prefill == 300 for s in a)
    assert a[0].ids != a[1].ids  # different files
    # the text is the start of a standard-library file
    assert a[0].ids == TOK.encode(stdlib_text(a[0].meta["files"][0]))[:316]


def test_passkey_needle_depth_and_length():
    task = Passkey(depths=(0.0, 0.5, 1.0), digits=5)
    samples = task.samples(TOK, 600, seed=3)
    assert samples == task.samples(TOK, 600, seed=3)
    assert samples[0].answer != Passkey(depths=(0.0,)).samples(TOK, 600, seed=4)[0].answer
    for s in samples:
        assert 500 <= len(s.ids) <= 600, len(s.ids)
        assert len(s.answer) == 5
        assert task.score(s, f"The key is {s.answer}.") == {"accuracy": 1.0}
        assert task.score(s, "12") == {"accuracy": 0.0}
    positions = [TOK.decode(s.ids).find(seen(f"pass key is {s.answer}")) for s in samples]
    assert positions[0] < positions[1] < positions[2]


def test_kv_retrieval_answer_is_in_prompt():
    task = KeyValueRetrieval(depths=(0.5,))
    (s,) = task.samples(TOK, 500, seed=0)
    assert len(s.ids) <= 520
    prompt = TOK.decode(s.ids)
    assert seen(s.answer) in prompt
    assert task.score(s, s.answer)["accuracy"] == 1.0


def test_line_completion_target_is_the_next_line():
    task = LineCompletion(samples_per_context=2)
    for s in task.samples(TOK, 400, seed=0):
        lines = stdlib_text(s.meta["file"]).splitlines()
        assert s.answer == lines[s.meta["line"] - 1]
        assert len(s.ids) <= 400
        assert s.stop_at_newline
        assert task.score(s, s.answer + "\nmore") == {"exact_match": 1.0, "edit_similarity": 1.0}
        assert task.score(s, "zzz")["exact_match"] == 0.0


def test_gsm8k_reads_jsonl_and_scores(tmp_path):
    path = tmp_path / "test.jsonl"
    rows = [
        {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2 + 3 = 5\n#### 5"},
        {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = GSM8K(path=str(path), shots=1)
    (s,) = task.samples(TOK, 0, seed=0)
    assert seen("6 times 7") in TOK.decode(s.ids) and seen("#### 5") in TOK.decode(s.ids)  # one worked example first
    assert task.score(s, "6*7 is 42. The answer is 42.") == {"accuracy": 1.0}
    assert task.score(s, "The answer is 41.") == {"accuracy": 0.0}


def test_longbench_reads_jsonl_truncates_and_scores(tmp_path):
    path = tmp_path / "hotpotqa.jsonl"
    row = {"input": "Where is the tower?", "context": "filler sentence. " * 200 + "The tower is in Paris.",
           "answers": ["Paris"], "length": 600, "dataset": "hotpotqa", "language": "en", "all_classes": None,
           "_id": "x1"}  # fmt: skip
    path.write_text(json.dumps(row) + "\n")
    task = LongBench(path=str(path))
    (s,) = task.samples(TOK, 800, seed=0)
    assert len(s.ids) <= 800 - s.max_new_tokens
    text = TOK.decode(s.ids)
    assert seen("Where is the tower?") in text and seen("Paris") in text  # the middle went, both ends stayed
    assert task.score(s, "Paris")["score"] == 1.0


def test_bad_inputs_raise_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="known tasks"):
        make_task("nope")
    with pytest.raises(ConfigError, match="accepted"):
        make_task("lm", bogus=1)
    with pytest.raises(ConfigError, match="depths"):
        Passkey(depths=(1.5,))
    with pytest.raises(ConfigError, match="not a file"):
        GSM8K(path=str(tmp_path / "missing.jsonl")).samples(TOK, 0, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ConfigError, match="answer"):
        GSM8K(path=str(bad)).samples(TOK, 0, 0)
    assert make_task("passkey", depths="0.25,0.75").depths == (0.25, 0.75)
