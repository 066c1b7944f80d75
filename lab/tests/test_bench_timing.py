"""The benchmarks' timing core (:func:`kvpolicy_lab.bench.timing.interleaved`), driven by fake statements
and a fake clock: what runs in which order, what is timed, on how many threads (no real time is read)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy_lab.bench.timing import interleaved, warmup_calls


class Recorder:
    """Fake statements and a fake clock writing one log: ``("call", name, threads)`` per statement call,
    ``("clock",)`` per clock reading. Each call of ``name`` advances the clock by ``cost[name]`` seconds,
    plus ``slow`` for the calls of the first ``slow_calls[name]`` ones (to tell warm-up rounds apart)."""

    def __init__(self, cost: dict[str, float], slow_calls: dict[str, int] | None = None, slow: float = 100.0):
        self.cost, self.slow_calls, self.slow = cost, slow_calls or {}, slow
        self.now = 0.0
        self.log: list[tuple] = []
        self.calls = dict.fromkeys(cost, 0)

    def statement(self, name: str):
        def call() -> None:
            self.log.append(("call", name, torch.get_num_threads()))
            self.now += self.cost[name] + (self.slow if self.calls[name] < self.slow_calls.get(name, 0) else 0.0)
            self.calls[name] += 1

        return call

    def clock(self) -> float:
        self.log.append(("clock",))
        return self.now

    def blocks(self) -> list[tuple[str, list[tuple]]]:
        """The log cut into measurements (four clock readings each: the warm-up span and the timed one),
        as (the one statement called in it, its entries), in the order they ran."""
        out: list[tuple[str, list[tuple]]] = []
        entries: list[tuple] = []
        for entry in self.log:
            entries.append(entry)
            if sum(e[0] == "clock" for e in entries) == 4:
                names = {e[1] for e in entries if e[0] == "call"}
                assert len(names) == 1, entries
                out.append((names.pop(), entries))
                entries = []
        assert not entries
        return out


def _run(rec: Recorder, **kw):
    return interleaved({name: rec.statement(name) for name in rec.cost}, clock=rec.clock, **kw)


def test_rounds_alternate_the_statements_in_a_rotating_order():
    rec = Recorder({"a": 1.0, "b": 2.0, "c": 3.0})
    _run(rec, number=3, repeats=4, warmup=1)
    order = [name for name, _ in rec.blocks()]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c", "b", "c", "a"]


def test_each_measurement_warms_up_untimed_then_times_number_calls():
    rec = Recorder({"a": 1.0, "b": 2.0})
    _run(rec, number=5, repeats=2)
    blocks = rec.blocks()
    assert len(blocks) == 4
    for name, entries in blocks:
        kinds = [e[0] for e in entries]
        warm = warmup_calls(5)
        # the Timer's warm-up: a span of its own, read and thrown away, before the measured span
        assert kinds == ["clock", *["call"] * warm, "clock", "clock", *["call"] * 5, "clock"], name


def test_measured_times_are_per_call_seconds_from_the_measured_rounds_only():
    # every call in the first (warm-up) round is 100 s slower: none of that may reach the results,
    # nor may the Timer's own warm-up calls of the measured rounds
    number, warm = 4, warmup_calls(4)
    rec = Recorder({"a": 0.5, "b": 2.0}, slow_calls={"a": number + warm, "b": number + warm})
    out = _run(rec, number=number, repeats=3, warmup=1)
    assert out["a"].times == pytest.approx([0.5] * 3) and out["b"].times == pytest.approx([2.0] * 3)
    assert out["a"].median == pytest.approx(0.5) and out["a"].iqr == pytest.approx(0.0)
    assert rec.calls == {"a": 4 * (number + warm), "b": 4 * (number + warm)}


def test_median_and_spread_come_from_the_rounds_in_order():
    rec = Recorder({"a": 1.0})
    # seconds per call, round by round (each round: the Timer's 2 warm-up calls, then 2 timed ones)
    costs = iter([1.0] * 4 + [3.0] * 4 + [2.0] * 4 + [5.0] * 4)

    def varying() -> None:
        rec.now += next(costs)

    m = interleaved({"a": varying}, number=2, repeats=4, clock=rec.clock)["a"]
    assert m.times == pytest.approx([1.0, 3.0, 2.0, 5.0])
    assert m.median == pytest.approx(2.5) and m.iqr == pytest.approx(3.5 - 1.75)


def test_statements_run_on_the_threads_asked_for_and_the_count_is_restored():
    before = torch.get_num_threads()
    wanted = 2 if before != 2 else 1
    rec = Recorder({"a": 1.0, "b": 1.0})
    out = _run(rec, number=1, repeats=2, threads=wanted)
    assert {e[2] for e in rec.log if e[0] == "call"} == {wanted}
    assert out["a"].num_threads == wanted
    assert torch.get_num_threads() == before


def test_without_threads_the_current_count_is_kept_not_the_timers_one():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rec = Recorder({"a": 1.0})
        _run(rec, number=1, repeats=1)
        assert {e[2] for e in rec.log if e[0] == "call"} == {2}
    finally:
        torch.set_num_threads(before)


def test_around_wraps_each_measurement_outside_the_timed_span():
    rec = Recorder({"a": 1.0, "b": 1.0})

    class Around:
        def __init__(self, name: str):
            self.name = name

        def __enter__(self):
            rec.log.append(("enter", self.name))

        def __exit__(self, *exc):
            rec.log.append(("exit", self.name))

    _run(rec, number=2, repeats=2, around=Around)
    kinds = [e[0] for e in rec.log]
    per = ["enter", "clock", "call", "call", "clock", "clock", "call", "call", "clock", "exit"]
    assert kinds == per * 4
    assert [e[1] for e in rec.log if e[0] == "enter"] == ["a", "b", "b", "a"]


@pytest.mark.parametrize(
    ("keyword", "value", "allowed"),
    [("number", 0, ">= 1"), ("repeats", -1, ">= 1"), ("warmup", -1, ">= 0"), ("number", 1.5, ">= 1"),
     ("threads", 0, ">= 1 or None")],
)  # fmt: skip
def test_bad_counts_are_refused_by_name(keyword, value, allowed):
    kw = dict(number=1, repeats=1, warmup=0) | {keyword: value}
    with pytest.raises(ValueError, match=rf"{keyword} must be an integer {allowed}.*got {value!r}"):
        interleaved({"a": lambda: None}, **kw)


def test_no_statements_is_refused():
    with pytest.raises(ValueError, match="statements is empty"):
        interleaved({}, number=1, repeats=1)


def test_the_cpu_clock_is_the_plain_wall_clock_and_an_accelerator_clock_waits_for_its_device(monkeypatch):
    import timeit

    from kvpolicy_lab.bench.timing import device_clock

    assert device_clock("cpu") is timeit.default_timer
    waited = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: waited.append(device))
    clock = device_clock("cuda:1")
    assert isinstance(clock(), float)
    assert waited == [torch.device("cuda:1")]
