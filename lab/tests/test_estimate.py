"""kvpolicy_lab.estimate: the bytes a cache holds after a prompt, from the config alone, equal to what
``memory_report()`` says after a real prefill of tiny models (Llama with several kv heads, Gemma-3 with
sliding layers); the scaling it rests on; its checks; and ``kvpolicy estimate``."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lab_fixtures import ROOT, one_thread  # noqa: F401  (pytest fixtures)
from transformers import LlamaConfig, LlamaForCausalLM

import kvpolicy
from kvpolicy import CacheSpec, CompressedCache, ConfigError, preset_files
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.attention import enable_scores
from kvpolicy.cli import main
from kvpolicy.policies.log import LogWindow
from kvpolicy.presets import BUILTIN_PRESETS
from kvpolicy.tiny import tiny_gemma3
from kvpolicy_lab.estimation import MAX_TOKENS, Estimate, estimate

pytestmark = pytest.mark.usefixtures("one_thread")

#: compositions beyond the presets: the default one-liner, a tiered action, per-layer widths, sinks, no compression
COMPOSITIONS = {
    "default": {},
    "tiered": dict(
        policy=LogWindow(window=8),
        action=Tiered(
            tiers=[Quantize(bits=4, group_size=16, key_axis="token"), Quantize(bits=2, group_size=16)],
            keep=[LogWindow(window=32)],
        ),
    ),
    "layer_bits": dict(policy="log", window=8, bits=2, group_size=16, layer_bits={-1: (4, 2)}),
    "sinks": dict(policy="log", window=8, bits=2, group_size=16, sinks=4),
    "none": dict(policy="recent", window=16, action="none"),
    "h2o-quantize": dict(policy="h2o", heavy=16, recent=16, action="quantize", bits=4, group_size=16),
}


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama: 3 layers, 3 kv heads (6 query heads) of head_dim 64, scores reported (for H2O)."""
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=96, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    enable_scores(model)  # H2O gets its scores; every other cache runs as before
    return model


@pytest.fixture(scope="module")
def gemma():
    """A tiny Gemma-3: 6 layers, 5 sliding (window 8) and 1 global, 1 kv head of head_dim 64."""
    model = tiny_gemma3()
    enable_scores(model)
    return model


def _composition(name):
    return name if name in BUILTIN_PRESETS else COMPOSITIONS[name]


def _build(spec, config):
    if isinstance(spec, str):
        return CompressedCache.from_preset(spec, config=config)
    return CompressedCache(**spec, config=config)


def _prefill(model, spec, tokens, batch, dtype=torch.float32):
    """``memory_report()`` after a real prefill of ``tokens`` random tokens, ``batch`` rows, in ``dtype``."""
    model.to(dtype)
    cache = _build(spec, model.config)
    ids = torch.randint(3, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    return cache.memory_report()


def _assert_same(report, got: Estimate):
    """Every layer's segments and baseline, and so every total, equal."""
    assert [layer.kind for layer in got.report.layers] == [layer.kind for layer in report.layers]
    for mine, real in zip(got.report.layers, report.layers, strict=True):
        assert {k: v for k, v in mine.segments.items() if v} == {k: v for k, v in real.segments.items() if v}, (
            f"layer {real.layer_idx}"
        )
        assert mine.baseline_bytes == real.baseline_bytes
    assert got.total_bytes == report.total_bytes
    assert got.baseline_bytes == report.baseline_bytes
    assert got.bits_per_element == report.bits_per_element
    assert got.bits_per_element_16bit == report.bits_per_element_16bit


# ---------------------------------------------------------------------- ground truth: a real prefill
@pytest.mark.parametrize("name", [*BUILTIN_PRESETS, *COMPOSITIONS])
def test_llama_estimate_equals_the_report_after_a_real_prefill(llama, name):
    spec = _composition(name)
    for tokens, batch in ((333, 2), (40, 1)):
        report = _prefill(llama, spec, tokens, batch)
        _assert_same(report, estimate(llama.config, tokens, spec, batch=batch, dtype=torch.float32))


@pytest.mark.parametrize("name", ["default", "kvpolicy-3bit", "kvpolicy-4.5bit", "logquant", "h2o", "layer_bits"])
def test_gemma3_estimate_with_sliding_layers_equals_the_report(gemma, name):
    spec = _composition(name)
    if name == "layer_bits":
        spec = {**spec, "layer_bits": {5: 4}}  # the global layer (the sliding ones are transformers')
    report = _prefill(gemma, spec, 150, 2)
    got = estimate(gemma.config, 150, spec, batch=2, dtype=torch.float32)
    _assert_same(report, got)
    assert got.compressed_layers == [5]
    sliding = [layer for layer in got.report.layers if layer.kind != "compressed"]
    assert len(sliding) == 5 and all(layer.segments["full_precision"] > 0 for layer in sliding)
    glob = got.report.layers[5]
    assert got.compressed_bits_per_element == 16 * glob.total_bytes / glob.baseline_bytes
    if name != "h2o":  # H2O's budget (256) holds all 150 tokens at full precision, positions on top
        # the global layer's own bits: below everything's, which counts the sliding layers at full precision
        assert got.compressed_bits_per_element < got.bits_per_element


def test_bfloat16_estimate_equals_the_report(llama):
    """The dtype sets the full-precision bytes and (meta_dtype="auto") the metadata's."""
    try:
        for name in ("kvpolicy-3bit", "default"):
            report = _prefill(llama, _composition(name), 200, 1, torch.bfloat16)
            _assert_same(report, estimate(llama.config, 200, _composition(name)))  # bfloat16 is the default
    finally:
        llama.to(torch.float32)


@given(tokens=st.integers(1, 700))
def test_any_prompt_length_is_exact(llama, tokens):
    for name in ("kvpolicy-3bit", "kivi"):
        report = _prefill(llama, name, tokens, 1)
        _assert_same(report, estimate(llama.config, tokens, name, dtype=torch.float32))


# ---------------------------------------------------------------------- what the scaling rests on
def _one_layer(spec, batch, heads, tokens=300):
    """One layer's bytes by segment after one update of ``(batch, heads, tokens, 64)`` random keys and values."""
    cache = CompressedCache(**spec) if isinstance(spec, dict) else CompressedCache.from_preset(spec)
    g = torch.Generator().manual_seed(0)
    shape = (batch, heads, tokens, 64)
    out = cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), 0)
    if cache.policy.needs_scores:
        cache.layers[0].observe_attention(torch.rand((heads, out[0].shape[-2]), generator=g))
    del out
    report = cache.memory_report()
    return report.layers[0].segments, report.layers[0].baseline_bytes, cache.policy.per_head


@pytest.mark.parametrize("name", ["kvpolicy-3bit", "kvpolicy-4.5bit", "kivi", "h2o-quantize", "tiered", "sinks"])
def test_bytes_are_linear_in_kv_heads_and_batch(name):
    """Data (codes, metadata, centres, staging, full precision) is held per batch row and kv head; positions
    once for all of them (shared policies) or once per kv head (per-head ones), never per batch row."""
    spec = _composition(name)
    unit, unit_baseline, per_head = _one_layer(spec, 1, 1)
    assert unit["positions"] > 0 and unit["codes"] > 0
    for batch, heads in ((2, 3), (3, 2)):
        segments, baseline, _ = _one_layer(spec, batch, heads)
        assert baseline == unit_baseline * batch * heads
        for role, n in segments.items():
            if role == "positions":
                assert n == unit[role] * (heads if per_head else 1), role
            elif role != "transform":
                assert n == unit[role] * batch * heads, role


# ---------------------------------------------------------------------- the API
def test_a_sequence_of_lengths_gives_one_estimate_each_in_order(llama):
    many = estimate(llama.config, [300, 40, 300], "kvpolicy-3bit")
    assert isinstance(many, list) and [e.tokens for e in many] == [300, 40, 300]
    one = estimate(llama.config, 40, "kvpolicy-3bit")
    assert isinstance(one, Estimate) and one.total_bytes == many[1].total_bytes
    assert many[0].total_bytes == many[2].total_bytes > one.total_bytes
    # a short prompt waits at full precision for whole groups: more bits per element
    assert one.bits_per_element > many[0].bits_per_element


def test_estimate_is_frozen_and_reads_well(llama):
    e = estimate(llama.config, 300, "kvpolicy-3bit", batch=2, dtype=torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.tokens = 1  # type: ignore[misc]
    text = str(e)
    assert text.startswith("Estimate: 300 tokens, batch 2, float32; 3 layers (3 compressed), 3 kv heads, head_dim 64")
    assert f"({e.bits_per_element:.2f} bits per element)" in text
    assert f"ratio {e.ratio:.2f}x" in text
    assert "float32 DynamicCache" in text and "at 16 bits" in text
    assert e.dynamic_bytes == 2 * e.baseline_bytes  # float32
    assert e.baseline_bytes == 300 * 3 * 2 * 3 * 2 * 64 * 2  # tokens x layers x batch x heads x (K, V) x dim x 2 B
    assert e.bits_per_element == pytest.approx(8 * e.total_bytes / (300 * 3 * 2 * 3 * 2 * 64))
    assert e.compressed_bits_per_element == e.bits_per_element  # every layer compressed
    assert sum(e.segments.values()) == e.total_bytes


def test_kvpolicy_lab_estimate_is_the_function_whatever_was_imported_first(llama):
    import kvpolicy_lab
    import kvpolicy_lab.estimation as module

    assert kvpolicy_lab.estimate is module.estimate
    got = kvpolicy_lab.estimate(llama.config, 40, "logquant")
    assert got.total_bytes == module.estimate(llama.config, 40, "logquant").total_bytes
    assert "estimate" in kvpolicy_lab.__all__ and "estimate" not in kvpolicy.__all__


def test_an_unused_cache_stands_for_its_composition(llama):
    cache = CompressedCache.from_preset("kvpolicy-4.5bit", layer_bits={0: 4}, config=llama.config)
    got = estimate(llama.config, 300, cache)
    want = estimate(llama.config, 300, {**BUILTIN_PRESETS["kvpolicy-4.5bit"](), "layer_bits": {0: 4}})
    assert got.total_bytes == want.total_bytes != estimate(llama.config, 300, "kvpolicy-4.5bit").total_bytes
    assert not any(layer.is_initialized for layer in cache.layers)  # not touched
    cache.update(torch.randn(1, 3, 4, 64), torch.randn(1, 3, 4, 64), 0)
    with pytest.raises(ConfigError, match=r"already holds tokens.*memory_report"):
        estimate(llama.config, 300, cache)


def test_a_spec_stands_for_its_composition(llama):
    spec = CacheSpec.from_preset("kvpolicy-4.5bit", layer_bits={0: 4})
    want = estimate(llama.config, 300, {**BUILTIN_PRESETS["kvpolicy-4.5bit"](), "layer_bits": {0: 4}})
    assert estimate(llama.config, 300, spec).total_bytes == want.total_bytes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": 0}, r"tokens must be an integer in \[1, 1048576\].*tokens=0"),
        ({"tokens": -5}, r"tokens=-5"),
        ({"tokens": MAX_TOKENS + 1}, rf"tokens={MAX_TOKENS + 1}"),
        ({"tokens": True}, r"tokens=True"),
        ({"tokens": 2.5}, r"tokens=2.5"),
        ({"tokens": "512"}, r"tokens='512'"),
        ({"tokens": []}, r"non-empty sequence.*tokens=\[\]"),
        ({"tokens": [512, 0]}, r"tokens=0"),
        ({"batch": 0}, r"batch must be an integer >= 1; got batch=0"),
        ({"dtype": torch.int8}, r"dtype must be one of torch.float32, torch.bfloat16, torch.float16.*int8"),
        ({"dtype": "fp16"}, r"dtype='fp16'"),
        ({"cache_or_preset": "kvpolicy-3bits"}, r"unknown preset 'kvpolicy-3bits'; did you mean 'kvpolicy-3bit'"),
        ({"cache_or_preset": {"window": 8, "config": None}}, r"must not set 'config'"),
        ({"cache_or_preset": {"windw": 8}}, r"unknown keyword\(s\) \['windw'\]"),
        ({"cache_or_preset": 3}, r"preset name, a mapping .* got a int"),
        ({"config": {"num_hidden_layers": 3}}, r"config must be a transformers PretrainedConfig.*dict"),
    ],
)
def test_bad_input_is_refused_naming_the_parameter(llama, kwargs, match):
    args = {"config": llama.config, "tokens": 512, "cache_or_preset": "kvpolicy-3bit", **kwargs}
    with pytest.raises(ConfigError, match=match):
        estimate(args.pop("config"), args.pop("tokens"), args.pop("cache_or_preset"), **args)


def test_a_dtype_by_name_is_the_dtype(llama):
    by_name = estimate(llama.config, 300, "logquant", dtype="float16")
    assert by_name.dtype is torch.float16
    assert by_name.total_bytes == estimate(llama.config, 300, "logquant", dtype=torch.float16).total_bytes


def test_a_layer_type_the_estimate_does_not_model_is_refused():
    from conftest import tiny_qwen3_next_config

    cfg = tiny_qwen3_next_config()
    # linear attention holds no keys: counted 0 bytes, as memory_report counts it
    got = estimate(cfg, 64, {"policy": "log", "window": 8, "bits": 2, "group_size": 16})
    assert got.compressed_layers == [1] and got.report.layers[0].total_bytes == 0
    cfg.layer_types = ["indexed_attention", "full_attention"]
    with pytest.raises(ConfigError, match="layer 0 of this config is of type 'indexed_attention'"):
        estimate(cfg, 64, "logquant")


def test_estimate_tells_a_used_hybrid_cache_from_an_unused_one():
    """Three linear-attention layers, then one full: a cache built for the model but unused is estimated (its one
    compressed layer), and once it holds tokens it is refused."""
    import warnings

    from conftest import tiny_qwen3_next_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_qwen3_next_config()
    cfg.num_hidden_layers = 4
    cfg.layer_types = ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reference kernels of the linear layers
        model = AutoModelForCausalLM.from_config(cfg).eval()
    unused = CompressedCache.for_model(model, window=4, bits=4, group_size=16)
    assert estimate(model.config, 64, unused).compressed_layers == [3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(torch.randint(3, 96, (1, 12)), cache=unused, use_cache=True)
    with pytest.raises(ConfigError, match="already holds tokens"):
        estimate(model.config, 64, unused)


# ---------------------------------------------------------------------- the command
def _run(argv, capsys):
    status = main(argv)
    return status, capsys.readouterr().out


# ---------------------------------------------------------------------- presets and preset files by name
@pytest.mark.parametrize(
    ("name", "suggestion"), [("kvpolicy-3bits", "kvpolicy-3bit"), ("smollm2-3bits", "smollm2-3bit")]
)
def test_the_estimate_suggests_the_closest_name_as_the_core_does(llama, name, suggestion, capsys):
    hint = f"did you mean '{suggestion}'?"
    with pytest.raises(ConfigError, match=re.escape(hint)):
        CompressedCache.from_preset(name)
    with pytest.raises(ConfigError, match=re.escape(hint)):
        estimate(llama.config, 16, name)
    with pytest.raises(SystemExit) as info:  # argparse refuses the value (kvpolicy_lab.commands._types.preset_name)
        main(["estimate", "--model", "tiny-llama", "--tokens", "64", "--preset", name])
    assert info.value.code == 2 and hint in capsys.readouterr().err


@pytest.mark.parametrize("name", preset_files.names())
def test_shipped_preset_files_are_estimated_by_name(llama, name, capsys):
    cache = CompressedCache.for_model(llama, name)
    assert estimate(llama.config, 100, name).total_bytes == estimate(llama.config, 100, cache).total_bytes
    status, out = _run(["estimate", "--model", "tiny-llama", "--tokens", "100", "--preset", name], capsys)
    assert status == 0 and re.search(rf"^{re.escape(name)}\s+100\s", out, re.M)


@pytest.mark.parametrize(
    ("content", "match"),
    [(b"[cache\n", "is not valid TOML"), (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is a binary file"),
     (b'[cache]\npolicy = 3\n', r"its \[cache\] table is not a composition kvpolicy can build")],
    ids=["malformed", "binary", "policy-int"],
)  # fmt: skip
def test_a_malformed_preset_file_is_one_clear_line_of_the_command(tmp_path, content, match, capsys):
    path = tmp_path / "bad.toml"
    path.write_bytes(content)
    try:
        status = main(["estimate", "--model", "tiny-llama", "--tokens", "64", "--preset", str(path)])
    except SystemExit as exc:  # refused by argparse
        status = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("usage:", " "))]
    assert status == 2 and "Traceback" not in err and len(lines) == 1 and re.search(match, lines[0])


def test_command_prints_one_row_per_preset_and_length(capsys):
    from kvpolicy.commands._model import model_config

    status, out = _run(["estimate", "--model", "tiny-llama", "--tokens", "64", "300", "--preset", "kvpolicy-3bit",
                        "logquant", "--dtype", "float32", "--batch", "2"], capsys)  # fmt: skip
    assert status == 0
    config = model_config("tiny-llama")
    assert out.startswith("tiny-llama: 2 layers (2 compressed), 2 kv heads, head_dim 64; float32, batch 2")
    rows = [line.split() for line in out.splitlines() if line.startswith(("kvpolicy-3bit", "logquant"))]
    assert [(r[0], int(r[1])) for r in rows] == [("kvpolicy-3bit", 64), ("kvpolicy-3bit", 300), ("logquant", 64),
                                                 ("logquant", 300)]  # fmt: skip
    for row in rows:
        e = estimate(config, int(row[1]), row[0], batch=2, dtype=torch.float32)
        assert row[2] == f"{e.bits_per_element:.2f}" and row[-1] == f"{e.ratio:.2f}x"
        assert row[3] == f"{e.bits_per_element_16bit:.2f}" != row[2]  # float32: the 16-bit figure too


def test_command_on_gemma3_adds_the_compressed_layers_column(capsys):
    status, out = _run(["estimate", "--model", "gemma3-270m", "--tokens", "600", "--preset", "logquant",
                        "--markdown", "--dtype", "bfloat16"], capsys)  # fmt: skip
    assert status == 0
    assert "18 layers (3 compressed), 1 kv head, head_dim 256; bfloat16" in out
    assert "| preset | tokens | bits/element | compressed layers' bits | bytes held |" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--tokens", "0"], r"argument --tokens: must be a token count from 1 to 1048576; got '0'"),
        (["--tokens", "-8"], r"argument --tokens: must be a token count such as 512, 2k, 8k or 128k \(k = 1024\)"),
        (["--tokens", "2kk"], r"argument --tokens: must be a token count such as 512, 2k, 8k or 128k"),
        (["--memory", "4G"], r"argument --memory: must be a number and a unit.*did you mean 4GiB or 4GB\?"),
        (["--memory", "4"], r"argument --memory: must be a number and a unit: 512MiB, 4GiB, 4GB"),
        (["--tokens", "512,2048"], r"is comma-separated; --tokens takes its values separated by spaces"),
        (["--tokens", str(MAX_TOKENS + 1)], r"must be a token count from 1 to 1048576"),
        (
            ["--tokens", "512", "--preset", "kvpolicy-3bits"],
            r"unknown preset 'kvpolicy-3bits'; did you mean "
            r"'kvpolicy-3bit'\?",
        ),
        (["--tokens", "512", "--dtype", "fp16"], r"argument --dtype: .*did you mean 'float16'\?"),
        (["--tokens", "512", "--model", "/no/such/model"], r"model path '/no/such/model' does not exist"),
        (
            ["--tokens", "512", "--model", "no-such-org/no-such-model"],
            r"model 'no-such-org/no-such-model': cannot read "
            r"its config.*--online",
        ),
    ],
)
def test_bad_command_lines_are_one_line_and_exit_2(argv, match, capsys):
    full = ["estimate", "--model", "tiny-llama", *argv]
    if "--tokens" not in argv and "--memory" not in argv:
        full += ["--tokens", "512"]
    try:
        status = main(full)
    except SystemExit as exc:
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvpolicy estimate: error: "), err
    assert [line for line in err.strip().splitlines() if not line.startswith(("usage:", " "))] == [last]
    assert re.search(match, last), last


# ---------------------------------------------------------------------- the docs page
def test_presets_page_lists_every_preset_with_the_estimators_numbers():
    """docs/presets.md: one section per preset, and its SmolLM2 bits at 512 tokens are the estimator's."""
    from kvpolicy.commands._model import model_config

    text = (ROOT / "docs" / "presets.md").read_text()
    config = model_config("smollm2")
    smol = text.split("## SmolLM2-135M", 1)[1].split("\n## ", 1)[0]
    for name in BUILTIN_PRESETS:
        assert f"`{name}`" in text
        row = re.search(rf"^\| `{re.escape(name)}` \| ([0-9.]+) \|", smol, re.M)
        assert row, name
        assert row.group(1) == f"{estimate(config, 512, name).bits_per_element:.2f}", name
    assert "kvpolicy estimate --model smollm2 --tokens 512 2k 8k 32k --dtype bfloat16" in text


# ---------------------------------------------------------------------- the longest prompt within a budget
def _tiny_config():
    from kvpolicy.commands._model import model_config

    return model_config("tiny-llama")  # 2 layers, 2 kv heads of 64


@pytest.mark.parametrize(
    ("composition", "budget"),
    [
        ("kvpolicy-3bit", 3 << 20),  # past three lattice steps: extended along the checked step
        ("logquant", 3 << 20),
        ("kivi", 1 << 20),
        ("kvpolicy-4.5bit", 100 << 10),  # before the first lattice step: exact estimates only
        ({"policy": "log", "window": 100, "bits": 2}, 3 << 20),  # windows that do not divide the lattice step
        ("DynamicCache", 3 << 20),
    ],
    ids=["kvpolicy-3bit", "logquant", "kivi", "short", "window-100", "dynamic"],
)
def test_the_longest_prompt_fits_and_one_more_token_does_not(composition, budget):
    """The answer is exact: the estimate at that length fits the budget and the estimate one token later does not,
    whether the search extended the bytes along the lattice step or estimated every length it tried."""
    from kvpolicy_lab.capacity import DYNAMIC, longest_prompt

    config = _tiny_config()
    probes = []
    fit = longest_prompt(config, budget, composition, dtype="bfloat16", on_probe=probes.append)
    assert 0 < fit.tokens < 10**6 and not fit.unbounded
    what = {"policy": "log", "action": "none"} if composition == DYNAMIC else composition
    at, after = estimate(config, [fit.tokens, fit.tokens + 1], what, dtype=torch.bfloat16)
    held = (lambda e: e.dynamic_bytes) if composition == DYNAMIC else (lambda e: e.total_bytes)
    assert held(at) == fit.bytes_held <= budget < held(after)
    assert max(probes) <= 3 * 5376 or not fit.extrapolated  # extended answers never estimate long prompts
    if composition == DYNAMIC:  # 2 layers x 2 kv heads x (keys + values) x 64 x 2 bytes per token
        assert fit.tokens == budget // (2 * 2 * 2 * 64 * 2)


def test_a_cache_that_stops_growing_fits_any_prompt():
    from kvpolicy_lab.capacity import MAX_PROMPT, longest_prompt

    config = _tiny_config()
    fit = longest_prompt(config, 1 << 30, "streamingllm", dtype="bfloat16")
    assert fit.unbounded and fit.tokens == MAX_PROMPT
    assert fit.bytes_held == estimate(config, 40_000, "streamingllm", dtype=torch.bfloat16).total_bytes


def test_a_budget_below_one_token_fits_nothing_and_bad_budgets_are_refused():
    from kvpolicy_lab.capacity import longest_prompt

    assert longest_prompt(_tiny_config(), 10, "kvpolicy-3bit").tokens == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="budget must be a number of bytes >= 1"):
            longest_prompt(_tiny_config(), bad, "kvpolicy-3bit")


def test_gemma3_sliding_layers_stop_growing_at_their_window():
    """A hybrid model's DynamicCache: its sliding layers hold their window, its global layers every token."""
    from kvpolicy.commands._model import model_config
    from kvpolicy_lab.capacity import DYNAMIC, longest_prompt

    config = model_config("gemma3-270m")
    fit = longest_prompt(config, 256 << 20, DYNAMIC, dtype="bfloat16")
    at, after = estimate(config, [fit.tokens, fit.tokens + 1], {"action": "none"}, dtype=torch.bfloat16)
    assert at.dynamic_bytes <= 256 << 20 < after.dynamic_bytes


def test_command_memory_prints_the_longest_prompt_of_each_cache(capsys):
    from kvpolicy_lab.capacity import DYNAMIC, longest_prompt

    status, out = _run(["estimate", "--model", "tiny-llama", "--memory", "3MiB", "--preset", "kvpolicy-3bit",
                        "streamingllm", "--dtype", "bfloat16"], capsys)  # fmt: skip
    assert status == 0
    assert "the longest prompt whose cache fits in 3.00 MiB (3,145,728 bytes):" in out
    config = _tiny_config()
    dynamic = longest_prompt(config, 3 << 20, DYNAMIC, dtype="bfloat16")
    three = longest_prompt(config, 3 << 20, "kvpolicy-3bit", dtype="bfloat16")
    assert re.search(rf"^DynamicCache\s+{dynamic.tokens:,}\s+1\.00x", out, re.M), out
    assert re.search(rf"^kvpolicy-3bit\s+~{three.tokens:,}\s+{three.tokens / dynamic.tokens:.2f}x", out, re.M), out
    assert re.search(r"^streamingllm\s+any\s+-\s+.* at most \(stops growing\)", out, re.M), out
    assert "~: past 16,128 tokens, from exact estimates at every 5,376 tokens" in out


def test_command_defaults_to_float32_like_every_command(capsys):
    status, out = _run(["estimate", "--model", "tiny-llama", "--tokens", "64", "--preset", "logquant"], capsys)
    assert status == 0 and "; float32, batch 1;" in out


def test_command_needs_tokens_or_memory(capsys):
    assert main(["estimate", "--model", "tiny-llama"]) == 2
    assert "give --tokens N [N...]" in capsys.readouterr().err


def test_command_plot_draws_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bytes.png"
    status, out = _run(["estimate", "--model", "tiny-llama", "--memory", "1MiB", "--preset", "logquant", "--plot",
                        str(path), "--no-progress"], capsys)  # fmt: skip
    assert status == 0 and f"plot written to {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("name", "match"), [("bytes.txt", "must end in one of .png"),
                                             ("no/such/dir/b.png", "does not exist")])  # fmt: skip
def test_command_plot_refuses_a_file_it_cannot_write_before_any_work(tmp_path, capsys, name, match):
    status = main(["estimate", "--model", "tiny-llama", "--tokens", "64", "--plot", str(tmp_path / name)])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and match in err


def test_command_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    status = main(["estimate", "--model", "tiny-llama", "--tokens", "64", "--plot", str(tmp_path / "b.png")])
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.strip() == (
        "kvpolicy estimate: error: --plot needs matplotlib, which is not installed: pip install matplotlib"
    )


# ---------------------------------------------------------------------- the progress bar
class _Terminal:
    """A stream that says it is a terminal and keeps what is written (a StringIO's isatty says no)."""

    def __init__(self):
        import io

        self.buffer = io.StringIO()

    def isatty(self):
        return True

    def write(self, text):
        return self.buffer.write(text)

    def flush(self):
        pass


def test_the_progress_bar_appears_only_for_a_run_past_its_delay_and_names_the_work():
    from kvpolicy.commands._progress import Progress

    term = _Terminal()
    progress = Progress(3, "estimating", file=term)
    assert progress._timer is not None  # a terminal: the bar is due after the delay
    progress.working_on("kvpolicy-3bit at 131,072 tokens")
    progress._show()  # what the timer does once the delay has passed
    progress.advance()
    assert progress._bar.n == 1 and progress._bar.total == 3
    progress.close()
    shown = term.buffer.getvalue()
    assert "estimating" in shown and "0/3" in shown and "kvpolicy-3bit at 131,072 tokens" in shown

    quick = _Terminal()
    progress = Progress(3, "estimating", file=quick)
    progress.close()  # a run that ended before the delay
    progress._show()  # a timer firing late draws nothing
    assert quick.buffer.getvalue() == ""


@pytest.mark.parametrize("enabled", [True, False])
def test_no_progress_bar_off_a_terminal_or_with_no_progress(enabled):
    import io

    from kvpolicy.commands._progress import Progress

    assert Progress(3, "estimating", enabled=enabled, file=io.StringIO())._timer is None
    assert Progress(3, "estimating", enabled=False, file=_Terminal())._timer is None


def test_estimate_counts_one_byte_scales_as_the_cache_holds_them():
    """A codebook cache's 8-bit norms (``norm_bits=8``, tests/test_codebook_norm8.py): one byte per scale."""
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
                         vocab_size=128)  # fmt: skip
    kw = dict(policy="recent", window=16, bits=3, scheme="codebook", transform="hadamard", backend="torch")
    got = {n: estimate(config, 500, {**kw, "norm_bits": n}, dtype="float32") for n in (16, 8)}
    head_dim, kv_heads, demoted = 64, 2, 500 - 16
    one_layer = 2 * kv_heads * demoted  # keys and values: one scale per demoted token and head
    assert got[16].total_bytes - got[8].total_bytes == 2 * (one_layer - 2 * kv_heads * 2)
    segments = got[8].report.segments
    assert segments["scales"] == 2 * one_layer and segments["scale_base"] == 2 * 2 * kv_heads * 2
    assert got[16].report.segments["scales"] == 2 * 2 * one_layer and head_dim == 256 // 4
