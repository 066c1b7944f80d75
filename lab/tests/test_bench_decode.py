"""``kvpolicy bench decode`` smoke runs on the tiny Llama (latency and capacity modes), and its parts."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from transformers import DynamicCache

import kvpolicy_lab.bench.decode as decode
from kvpolicy import CompressedCache
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy_lab.bench.decode import Variant, held_bytes, tiny_llama


def test_latency_mode_smoke(tmp_path):
    caches = ["dynamic", "hf-quanto-2", "log-2-torch-ordered-mat", "log-2-torch-agnostic-fused"]
    rc = main(["bench", "decode", "--model", "tiny-llama", "--lengths", "96", "160", "--batch", "1", "2",
               "--steps", "1", "--reps", "1", "--warmup", "0", "--window", "8", "--caches", *caches,
               "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * len(caches)
    assert (tmp_path / "decode.png").stat().st_size > 0
    by = {(r["length"], r["batch"], r["variant"]): r for r in rows}
    for length in (96, 160):
        for batch in (1, 2):
            dyn = by[(length, batch, "dynamic")]
            assert dyn["ratio_ms"] == 1.0
            # one round of the Timer's 2 warm-up steps and 1 timed step
            assert dyn["tokens_held"] == length + 3
            # fp32 DynamicCache: tokens x 4 layers x 2 kv heads x 64 x (k, v) x 4 bytes x batch
            assert dyn["bytes_held"] == (length + 3) * 4 * 2 * 64 * 2 * 4 * batch
            assert (dyn["bits_per_element"], dyn["bits16"]) == (pytest.approx(32.0), pytest.approx(16.0))
            log = by[(length, batch, "log-2-torch-agnostic-fused")]
            assert log["bits16"] < log["bits_per_element"] < 32
            assert by[(length, batch, "log-2-torch-agnostic-fused")]["paths"] == "fused (torch)"
            assert by[(length, batch, "log-2-torch-ordered-mat")]["paths"].startswith("materialized")
            for name in caches[1:]:
                assert 0 < by[(length, batch, name)]["bytes_held"] < dyn["bytes_held"]


def test_capacity_mode_smoke(tmp_path):
    rc = main(["bench", "decode", "--mode", "capacity", "--model", "tiny-llama", "--context", "128",
               "--budget-gib", str(2**-10), "--max-batch", "6", "--steps", "1", "--reps", "1", "--window", "8",
               "--caches", "dynamic", "log-2-torch-ordered-fused", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "capacity.json").read_text())["rows"]}
    dyn, log = rows["dynamic"], rows["log-2-torch-ordered-fused"]
    assert dyn["batch"] == 2**20 // dyn["bytes_per_sequence"]  # 1 MiB budget
    assert log["bytes_per_sequence"] < dyn["bytes_per_sequence"]
    assert log["batch"] > dyn["batch"]
    assert dyn["within_budget"] and log["tokens_per_s"] > 0
    assert dyn["decode_iqr_ms"] == 0.0  # one measured rep


def test_held_bytes_counts_dynamic_cache():
    model = tiny_llama(torch.float32)
    cache = DynamicCache()
    with torch.inference_mode():
        model(torch.randint(3, 100, (1, 10)), cache=cache, use_cache=True)
    assert held_bytes(cache) == 10 * 4 * 2 * 64 * 2 * 4


@pytest.mark.parametrize("name", ["fast", "log-2-torch-sideways-fused", "hf-fp8-2", "log-2-torch-ordered-fused-spin"])
def test_bad_variant_names(name):
    with pytest.raises(ConfigError, match="not understood"):
        Variant.parse(name)


def test_one_liner_variant_is_the_readme_cache_on_the_fused_path(tmp_path):
    from kvpolicy import CompressedCache

    v = Variant.parse("one-liner")
    assert v.fused
    assert repr(v.build(None, 8)) == repr(CompressedCache(policy="log", action="quantize", bits=2))
    rc = main(["bench", "decode", "--model", "tiny-llama", "--lengths", "300", "--steps", "1", "--reps", "1",
               "--warmup", "0", "--caches", "dynamic", "one-liner", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "decode.json").read_text())["rows"]}
    chosen = CompressedCache(policy="log", action="quantize", bits=2).backend.name
    assert rows["one-liner"]["paths"] == f"fused ({chosen})"
    assert rows["one-liner"]["bytes_held"] < rows["dynamic"]["bytes_held"]


def test_mixed_width_variants_build_key_and_value_bits():
    v = Variant.parse("log-k4v2-cpu-ordered-fused")
    assert (v.widths, v.backend, v.fused) == ((4, 2), "cpu", True)
    cache = v.build(None, 16)
    assert (cache.action.keys.bits, cache.action.values.bits) == (4, 2)
    assert Variant.parse("log-2-torch-ordered-mat").build(None, 16).action.keys.bits == 2
    with pytest.raises(ConfigError, match="k<K>v<V>"):
        Variant.parse("log-k4-cpu-ordered-fused")


def test_rot_variants_add_the_hadamard_transform(tmp_path):
    v = Variant.parse("log-k4v2-cpu-ordered-fused-rot")
    assert (v.widths, v.transform) == ((4, 2), "hadamard")
    assert v.build(None, 16).transform.name == "hadamard"
    assert Variant.parse("log-2-torch-ordered-fused").build(None, 16).transform.identity
    rc = main(["bench", "decode", "--model", "tiny-llama", "--lengths", "300", "--steps", "2", "--reps", "1",
               "--warmup", "0", "--caches", "log-2-torch-ordered-fused-rot", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    row = json.loads((tmp_path / "decode.json").read_text())["rows"][0]
    assert row["paths"] == "fused (torch)"


def test_mse_variants_fit_the_ranges_with_or_without_rotation():
    v = Variant.parse("log-2-cpu-ordered-fused-mse")
    fits = lambda cache: (cache.action.keys.fit, cache.action.values.fit)  # noqa: E731
    assert (v.fit, v.transform) == ("mse", "none") and fits(v.build(None, 16)) == ("mse", "mse")
    both = Variant.parse("log-k4v2-torch-ordered-fused-rot-mse").build(None, 16)
    assert fits(both) == ("mse", "mse") and both.transform.name == "hadamard"
    assert fits(Variant.parse("log-2-cpu-ordered-fused-rot-kmse").build(None, 16)) == ("mse", "minmax")
    assert fits(Variant.parse("log-2-cpu-ordered-fused-rot").build(None, 16)) == ("minmax", "minmax")
    with pytest.raises(ConfigError, match="not understood"):
        Variant.parse("log-2-cpu-ordered-fused-mse-rot")


def test_preset_variants_build_the_file_and_run_fused(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text(
        '[cache]\npolicy = "log"\nwindow = 8\naction = "tiered"\ntransform = "hadamard"\n'
        'tiers = [{bits = 4, scheme = "codebook"}, {bits = 2, value_scheme = "codebook"}]\n'
        'keep = [{name = "log", window = 16}]\n'
    )
    v = Variant.parse(f"preset:{preset}")
    assert v.fused and repr(v.build(None, 42)) == repr(CompressedCache.from_config(preset))
    with pytest.raises(ConfigError, match=r"cache variant 'preset:.*missing.toml': preset file '.*missing\.toml' does "
                                          r"not exist"):  # fmt: skip
        Variant.parse(f"preset:{tmp_path / 'missing.toml'}")
    # a registered preset by name
    named = Variant.parse("preset:kvpolicy-3bit")
    assert named.fused and repr(named.build(None, 42)) == repr(CompressedCache.from_preset("kvpolicy-3bit"))
    # a preset file shipped with kvpolicy, by name
    shipped = Variant.parse("preset:smollm2-8k-2.5bit")
    assert repr(shipped.build(None, 42)) == repr(CompressedCache.from_config("smollm2-8k-2.5bit"))
    out = tmp_path / "bench"
    rc = main(["bench", "decode", "--model", "tiny-llama", "--lengths", "256", "--steps", "1", "--reps", "1",
               "--warmup", "0", "--caches", "dynamic", f"preset:{preset}", "--out", str(out)])  # fmt: skip
    assert rc == 0
    rows = json.loads((out / "decode.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["dynamic", f"preset:{preset}"]
    assert rows[1]["paths"] == "fused (cpu)" and 0 < rows[1]["bytes_held"] < rows[0]["bytes_held"]


class DecodeLog:
    """A forward pre-hook on the model: each call's cache, input length and torch thread count."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, module, args, kwargs) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        self.calls.append((id(kwargs.get("cache")), ids.shape[1], torch.get_num_threads()))


def _log_forwards(monkeypatch) -> DecodeLog:
    """Make ``kvpolicy bench decode`` load the tiny Llama with a :class:`DecodeLog` on it; the log."""
    log = DecodeLog()

    def logged(model, dtype, device, online=False):
        m = tiny_llama(dtype)
        m.register_forward_pre_hook(log, with_kwargs=True)
        return m

    monkeypatch.setattr(decode, "load", logged)
    return log


def test_latency_decode_is_interleaved_warmed_up_and_on_the_threads_asked_for(tmp_path, monkeypatch, capsys):
    log = _log_forwards(monkeypatch)
    before = torch.get_num_threads()
    threads = 1 if before == 2 else 2
    try:
        rc = main(["bench", "decode", "--model", "tiny-llama", "--lengths", "40", "--steps", "2", "--reps", "3",
                   "--warmup", "1", "--threads", str(threads), "--window", "8",
                   "--caches", "dynamic", "log-2-torch-ordered-fused", "--out", str(tmp_path)])  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    # prefills: a 16-token warm-up forward through a throwaway cache, then the timed 40-token one, per variant
    assert [n for _, n, _ in log.calls if n > 1] == [16, 40, 16, 40]
    caches = [c for c, n, _ in log.calls if n == 40]
    a, b = caches
    decodes = [c for c, n, _ in log.calls if n == 1]
    # 4 rounds (1 warm-up + 3 measured) of 2 untimed + 2 timed steps per cache, alternating, order rotating
    per = [a] * 4, [b] * 4
    assert decodes == [*per[0], *per[1], *per[1], *per[0], *per[0], *per[1], *per[1], *per[0]]
    assert {t for _, _, t in log.calls} == {threads}

    data = json.loads((tmp_path / "decode.json").read_text())
    meta = data["meta"]
    assert (meta["threads"], meta["timer"]) == (threads, "torch.utils.benchmark.Timer")
    assert (meta["steps"], meta["reps"], meta["warmup_rounds"], meta["warmup_steps_per_rep"]) == (2, 3, 1, 2)
    for row in data["rows"]:
        assert len(row["decode_ms_all"]) == 3 and all(t > 0 for t in row["decode_ms_all"])
        assert row["decode_ms"] == pytest.approx(statistics.median(row["decode_ms_all"]))
        q1, _, q3 = statistics.quantiles(row["decode_ms_all"], n=4, method="inclusive")
        assert row["decode_iqr_ms"] == pytest.approx(q3 - q1)
        assert row["tokens_held"] == 40 + 4 * (2 + 2)
        assert row["prefill_ms"] > 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("length"))
    assert header.split()[:8] == ["length", "batch", "cache", "prefill", "ms", "decode", "ms/tok", "IQR"]


def test_without_threads_decode_runs_on_torchs_count(tmp_path, monkeypatch):
    log = _log_forwards(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rc = main(["bench", "decode", "--model", "tiny-llama", "--lengths", "24", "--steps", "1", "--reps", "1",
                   "--warmup", "0", "--caches", "dynamic", "--out", str(tmp_path)])  # fmt: skip
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    assert {t for _, _, t in log.calls} == {2}  # not the Timer's default of one thread
    assert json.loads((tmp_path / "decode.json").read_text())["meta"]["threads"] == 2
