"""``kvpolicy tune`` and ``CompressedCache.from_config``."""

from __future__ import annotations

import argparse
import json
import tomllib

import pytest

from kvpolicy import CompressedCache, Sinks, Tiered
from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy_lab.tune import Candidate, pick, preset_toml, simulated_bits, space, storage_key, within_budget

TINY = ["--model", "tiny-llama", "--context", "128", "--windows", "4", "8", "--no-progress"]


def test_the_search_finishes_respects_the_budget_and_writes_a_loadable_preset(tmp_path, capsys):
    preset = tmp_path / "preset.toml"
    args = ["tune", *TINY, "--budget-bits", "10", "--preset-file", str(preset), "--screen", "6", "--trials", "4",
            "--samples", "1", "--tokens", "4", "--heldout-samples", "1", "--heldout-tokens", "4"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "★" in out and "| composition | bits/el (simulated) | bits/el (measured) |" in out
    saved = tomllib.loads(preset.read_text())
    assert saved["tune"]["bits_per_element"] <= 10 and saved["tune"]["bits_per_element_calibration"] <= 10
    cache = CompressedCache.from_config(preset)
    from kvpolicy.tiny import TinySpec, tiny_model

    model, _ = tiny_model(TinySpec())
    assert simulated_bits(saved["cache"], model.config, 128, (1, 4, 32)) <= 10  # the preset, measured again
    assert saved["tune"]["bits_per_element_heldout"] <= 10
    # every calibrated composition fits, and a single-tier rival was scored on held-out texts
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert len(rows) == 4 and all(float(r.split("|")[2]) <= 10 and float(r.split("|")[3]) <= 10 for r in rows)
    assert sum(1 for r in rows if r.split("|")[5].strip() != "–") >= 2
    assert repr(CompressedCache(**saved["cache"])) == repr(cache)
    # resumable: a second run finds every cell done
    assert main(args) == 0
    again = capsys.readouterr().out
    assert again.count("(0 run,") == 3, again


def test_batch_changes_no_score_and_the_runs_skip_the_attention_probe(tmp_path, capsys):
    """``--batch`` decodes texts together (default 4): the chosen composition and its scores are those of
    one text at a time, up to float rounding; no run measures ``attn_error``, which the search never reads."""
    saved = {}
    for batch in (1, 3):
        preset = tmp_path / str(batch) / "preset.toml"
        args = ["tune", *TINY, "--budget-bits", "10", "--preset-file", str(preset), "--screen", "4", "--trials", "2",
                "--samples", "3", "--tokens", "4", "--heldout-samples", "3", "--heldout-tokens", "4",
                "--batch", str(batch)]  # fmt: skip
        assert main(args) == 0
        capsys.readouterr()
        saved[batch] = tomllib.loads(preset.read_text())["tune"]
        metrics = {json.loads(line)["metric"] for line in (tmp_path / str(batch) / "preset-runs" / "heldout"
                                                           / "results.jsonl").read_text().splitlines()}  # fmt: skip
        assert "kl" in metrics and "attn_error" not in metrics
        for run in ("screen", "calibration", "heldout"):
            config = json.loads((tmp_path / str(batch) / "preset-runs" / run / "config.json").read_text())
            assert (config["batch"], config["attention_error"]) == (batch, False)
    one, three = saved[1], saved[3]
    assert one["label"] == three["label"]
    for key in ("bits_per_element_calibration", "bits_per_element_heldout"):
        assert one[key] == three[key]
    for key in ("kl_calibration", "kl_heldout", "top1_heldout"):
        assert three[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    with pytest.raises(SystemExit):
        main(["tune", *TINY, "--budget-bits", "10", "--preset-file", str(tmp_path / "p.toml"), "--batch", "0"])
    assert "--batch" in capsys.readouterr().err


def test_a_model_whose_keys_rotation_hurts_is_searched_without_it():
    """``rotate=False`` (what ``--rotation auto`` picks when ``kvpolicy analyze rotation`` finds that the
    rotation raises the attention KL, as on Gemma-3): no rotation, hence no codebook scheme, a min-max
    middle tier (keys per token: its tokens leave one at a time); the same policies, widths and families
    otherwise."""
    rotated = list(space(list(range(6)), transforms=("hadamard",)))
    plain = list(space(list(range(6)), rotate=False))
    assert all(c.args["transform"] == "hadamard" for c in rotated)
    assert all(c.args["transform"] == "none" and c.label.endswith("-norot") for c in plain)
    text = repr([c.args for c in plain])
    assert "codebook" not in text and "key_centre" not in text
    tiered = next(c for c in plain if c.family == "tiered")
    assert tiered.args["tiers"][0] == {"bits": 4, "key_axis": "token", "fit": "minmax"}
    widths = {c.label: c.label.split("-k")[1].split("-")[0] for c in rotated}  # "3cmv2l": keys and values
    minmax = {c.label.removesuffix("-n8") for c in rotated if not set(widths[c.label]) & {"c", "l"}}
    assert {c.label.removesuffix("-norot") for c in plain} == minmax
    for c in plain:  # each builds
        CompressedCache(**c.args)


def test_rotation_auto_asks_the_model_and_records_the_answer(tmp_path, capsys):
    preset = tmp_path / "p.toml"
    args = ["tune", *TINY, "--budget-bits", "10", "--preset-file", str(preset), "--screen", "2", "--trials", "1",
            "--samples", "1", "--tokens", "4", "--heldout-samples", "1", "--heldout-tokens", "4"]  # fmt: skip
    assert main([*args, "--rotation", "none"]) == 0
    saved = tomllib.loads(preset.read_text())
    assert saved["cache"]["transform"] == "none" and saved["tune"]["rotation"] == "none"
    assert saved["tune"]["rotation_reason"] == "--rotation none"
    capsys.readouterr()
    assert main([*args, "--rotation", "auto", "--out", str(tmp_path / "auto")]) == 0
    err = capsys.readouterr().err
    verdict = err.split("rotation: ")[1].splitlines()[0]
    assert verdict.startswith("Hadamard(seed=0) ") and "attention KL of 2-bit per-channel keys" in verdict
    saved = tomllib.loads(preset.read_text())
    assert saved["tune"]["rotation_reason"] == verdict
    rotate = "lowers the mean" in verdict
    assert saved["tune"]["rotation"] == ("hadamard" if rotate else "none")
    assert saved["cache"]["transform"] == ("hadamard" if rotate else "none")


def test_an_unreachable_budget_names_the_smallest_reachable_one(tmp_path, capsys):
    assert main(["tune", *TINY, "--budget-bits", "1", "--preset-file", str(tmp_path / "p.toml")]) == 2
    err = capsys.readouterr().err
    assert "kvpolicy tune: error: --budget-bits 1: no composition of the search fits; the smallest holds" in err
    smallest = float(err.split("the smallest holds ")[1].split()[0])
    suggested = float(err.split("Pass --budget-bits ")[1].split()[0])
    assert smallest <= suggested < smallest + 0.01
    assert not (tmp_path / "p.toml").exists()


def test_within_budget_and_pick_try_every_family_nearest_the_budget_first():
    families = (("single", (2.0, 2.9, 3.5)), ("boundary", (2.5, 2.95)), ("tiered", (2.7,)))
    cands = [Candidate(f"{fam}{i}", {}, fam, bits=b) for fam, bits in families for i, b in enumerate(bits)]
    fitting = within_budget(cands, 3.0)
    assert [c.label for c in fitting] == ["boundary1", "single1", "tiered0", "boundary0", "single0"]
    assert [c.label for c in pick(fitting, 3)] == ["boundary1", "single1", "tiered0"]
    assert [c.label for c in pick(fitting, 10)] == [c.label for c in fitting]


def test_every_composition_of_the_space_builds():
    cands = list(space(list(range(30))))
    assert len({c.label for c in cands}) == len(cands)
    keyed = [c.args for c in cands if c.args.get("key_scheme") == "codebook"]
    assert {a["key_bits"] for a in keyed} == {2, 3, 4} and all(a["key_centre"] is True for a in keyed)
    assert {"log16-k3cmv2c-n8", "log16-k2cmv2c-n8"} <= {c.label for c in cands}
    for c in cands:
        cache = CompressedCache(**c.args)
        if c.family == "tiered":
            assert isinstance(cache.action, Tiered)
        if "sinks" in c.args:
            assert isinstance(cache.policy, Sinks)
        if c.family == "boundary":
            assert sorted(cache.layer_bits) == [0, 1, 28, 29]


def test_min_max_keys_are_searched_with_both_range_fits_at_the_same_bytes(capsys):
    """Every min-max key (each group size, every family) comes with min-max and with fitted ranges
    (``-kmse``); codebook keys have no fit. A pair differs only in ``key_fit``, so it shares a storage key,
    and it holds the same bytes: checked by feeding both on a model's shape, not assumed."""
    cands = {c.label: c for c in space(list(range(2)), windows=(8,), key_groups=(32, 64))}
    fitted = [c for c in cands.values() if "-kmse" in c.label]
    assert fitted and {c.family for c in fitted} == {"single", "boundary", "tiered"}
    for c in fitted:
        twin = cands[c.label.replace("-kmse", "")]
        assert storage_key(c.args) == storage_key(twin.args) and c.args != twin.args
        bottom, twin_bottom = (
            (c.args["tiers"][-1], twin.args["tiers"][-1]) if c.family == "tiered" else (c.args, twin.args)
        )
        assert bottom["key_fit"] == "mse" and twin_bottom["key_fit"] == "minmax"
        assert "key_fit='mse'" in repr(CompressedCache(**c.args))
    assert not any("-kmse" in label and "cm" in label.split("-k")[1] for label in cands)
    assert len(fitted) == sum(1 for c in cands.values() if "key_fit" in str(c.args) and "-kmse" not in c.label)
    # different storage, different key
    assert storage_key(cands["log8-k2v2"].args) != storage_key(cands["log8-k2g32v2"].args)
    from kvpolicy.tiny import TinySpec, tiny_model

    config = tiny_model(TinySpec())[0].config
    for label in ("log8-k2g32v2-kmse", "log8-k3v2-kmse-t4x32-n8", "log8-s4-k3v3-kmse-b4"):
        fitted_args, minmax_args = cands[label].args, cands[label.replace("-kmse", "")].args
        assert simulated_bits(fitted_args, config, 200, (1, 7)) == simulated_bits(minmax_args, config, 200, (1, 7))
    only = {c.label for c in space(list(range(4)), windows=(8,), key_fits=("mse",))}
    assert "log8-k2v2-kmse" in only and "log8-k2v2" not in only
    with pytest.raises(
        ConfigError, match=r"key fits must be a non-empty selection of \['minmax', 'mse'\]; got \['l2'\]"
    ):
        list(space(list(range(4)), key_fits=("l2",)))
    with pytest.raises(SystemExit):
        main(["tune", *TINY, "--budget-bits", "3", "--key-fits", "l2", "--preset-file", "/nonexistent/p.toml"])
    assert "argument --key-fits: invalid choice: 'l2' (choose from 'minmax', 'mse')" in capsys.readouterr().err


def test_tier_factors_put_the_kvpolicy_3bit_composition_in_the_space(capsys):
    """W' = 8W (``--tier-factors 4 8``) makes the search hold the shipped kvpolicy-3bit composition, which
    the default W' = 4W does not."""
    tiered = {c.label: c for c in space(list(range(30)), windows=(4,), tier_factors=(4, 8)) if c.family == "tiered"}
    assert {"log4-k3cmv2c-t4x16-n8", "log4-k3cmv2c-t4x32-n8"} <= set(tiered)
    preset = CompressedCache.from_preset("kvpolicy-3bit")
    assert repr(CompressedCache(**tiered["log4-k3cmv2c-t4x32-n8"].args)) == repr(preset)
    default = {c.label for c in space(list(range(30)), windows=(4,)) if c.family == "tiered"}
    assert "log4-k3cmv2c-t4x16-n8" in default and not any(label.endswith("x32-n8") for label in default)
    with pytest.raises(ConfigError, match=r"tier factors must be integers >= 2 .*got 1"):
        list(space(list(range(4)), tier_factors=(1,)))
    argv = ["tune", *TINY, "--budget-bits", "3", "--tier-factors", "1", "--preset-file", "/nonexistent/p.toml"]
    assert main(argv) == 2
    assert "tier factors must be integers >= 2" in capsys.readouterr().err


def test_preset_files_round_trip_through_from_config(tmp_path):
    cand = next(c for c in space(list(range(4))) if c.family == "tiered")
    path = tmp_path / "p.toml"
    path.write_text(preset_toml(cand, {"label": cand.label}))
    assert repr(CompressedCache.from_config(path)) == repr(CompressedCache(**cand.args))
    assert "LogWindow(window=99)" in repr(CompressedCache.from_config(path, window=99))  # overrides win


@pytest.mark.parametrize(
    "text, match",
    [("[other]\nx = 1\n", r"has no \[cache\] table"), ("[cache\n", r"is not valid TOML"),
     ('[cache]\npolicy = "nope"\n', r"unknown policy 'nope'")],
)  # fmt: skip
def test_bad_preset_files_are_refused(tmp_path, text, match):
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        CompressedCache.from_config(path)


def test_the_shipped_preset_loads_as_the_tuned_composition():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "kvpolicy" / "preset_files" / "smollm2-3bit.toml"
    saved = tomllib.loads(path.read_text())
    assert saved["tune"]["budget_bits"] == 3.0 and saved["tune"]["bits_per_element_heldout"] <= 3.0
    cache = CompressedCache.from_config(path)
    assert isinstance(cache.action, Tiered) and [t.values.name for t in cache.action.tiers] == ["codebook"] * 2
    # the search found the kvpolicy-3bit composition itself, with the 16-bit codebook scales it searched then
    # (docs/how-to/tune.md); the preset holds one-byte scales
    assert repr(cache) == repr(CompressedCache.from_preset("kvpolicy-3bit", norm_bits=16))


def test_the_8k_preset_holds_at_most_2_5_bits_at_8k_and_centres_its_keys():
    """The shipped preset file smollm2-8k-2.5bit: what its header claims about bytes, checked on a
    model of SmolLM2's shape (30 layers, 3 KV heads of 64) fed 8k tokens and 128 more."""
    from pathlib import Path

    from transformers import LlamaConfig

    path = Path(__file__).resolve().parents[2] / "kvpolicy" / "preset_files" / "smollm2-8k-2.5bit.toml"
    cache = CompressedCache.from_config("smollm2-8k-2.5bit")
    assert isinstance(cache.action, Tiered)
    assert [(t.keys.bits, t.keys.centre) for t in cache.action.tiers] == [(3, True), (2, True)]
    config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                         head_dim=64)  # fmt: skip
    args = tomllib.loads(path.read_text())["cache"]
    bits = simulated_bits(args, config, 8192, extra=(128,))
    assert 2.3 < bits <= 2.5


def test_a_hybrid_model_budget_counts_its_full_attention_layers():
    """On Gemma-3's layout the sliding-window layers stay transformers' own at 16 bits: the budget counts the
    full-attention layer that a composition compresses, with the bytes the ablation records for it."""
    import torch

    from kvpolicy.tiny import tiny_gemma3
    from kvpolicy_lab.eval.caches import baseline_bytes, held_bytes

    config = tiny_gemma3().config
    args = {"policy": "log", "window": 4, "bits": 2, "group_size": 16}
    bits = simulated_bits(args, config, 200, (1,))
    cache = CompressedCache(**args, config=config, backend="torch")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # 200 tokens, then 1: the figure after the longer run
        step = 200 if not cache.get_seq_length() else 1
        for i in range(len(cache.layers)):
            x = torch.randn(1, 1, step, 64, generator=g)
            cache.update(x, x, i)
    global_16 = 16 * held_bytes(cache, at_16bit=True, layers=[5]) / baseline_bytes(config, 201, layers=[5])
    assert bits == pytest.approx(global_16, rel=1e-12)
    assert 2 < bits < cache.memory_report().bits_per_element_16bit - 1  # the whole cache: the windows weigh in


def test_norm_bits_are_an_axis_of_codebook_compositions_only():
    """One-byte scales (the default) give every composition holding codebook blocks a ``-n8`` twin in place of
    its 16-bit one; ``norm_bits=(16, 8)`` searches both; min-max-only compositions appear once, untouched."""
    layers = list(range(6))
    one = ("hadamard",)
    both = {c.label: c for c in space(layers, windows=(8,), norm_bits=(16, 8), transforms=one)}
    default = {c.label: c for c in space(layers, windows=(8,), transforms=one)}
    sixteen = {c.label: c for c in space(layers, windows=(8,), norm_bits=(16,), transforms=one)}
    assert set(both) == set(default) | set(sixteen)
    assert all(label.endswith("-n8") or label in sixteen for label in default)
    plain, coded = both["log8-k3v2"], both["log8-k3v2c-n8"]
    assert "norm_bits" not in plain.args and plain.label in default
    assert coded.args["norm_bits"] == 8 and CompressedCache(**coded.args).action.values.norm_bits == 8
    tiered = both["log8-k2v2-t4x32-n8"]
    assert [t.get("norm_bits") for t in tiered.args["tiers"]] == [8, None]  # the min-max bottom tier takes none
    for c in both.values():
        CompressedCache(**c.args)  # every candidate builds
    assert not any(label.endswith("-n8") for label in space_labels(norm_bits=(16,)))
    with pytest.raises(ConfigError, match=r"norm bits must be a non-empty selection of \[16, 8\]; got \[12\]"):
        list(space(layers, norm_bits=(12,)))


def test_query_weighted_rotation_is_an_axis_of_every_rotated_composition():
    """Each rotated composition has a ``-qh`` twin, identical but for ``transform="query-hadamard"``;
    unrotated searches have none; its bytes are the twin's plus the key weights."""
    from transformers import LlamaConfig

    from kvpolicy_lab.tune import simulated_bits

    layers = list(range(6))
    plain = {c.label: c for c in space(layers, windows=(8,), transforms=("hadamard",))}
    both = {c.label: c for c in space(layers, windows=(8,))}
    weighted = {label: c for label, c in both.items() if label.endswith("-qh")}
    assert set(both) == set(plain) | set(weighted) and len(weighted) == len(plain)
    for label, c in weighted.items():
        twin = plain[label.removesuffix("-qh")]
        assert c.args == {**twin.args, "transform": "query-hadamard"} and c.family == twin.family
    assert {c.label for c in space(layers, windows=(8,), transforms=("query-hadamard",))} == set(weighted)
    assert not any(c.label.endswith("-qh") for c in space(layers, rotate=False))
    allowed = r"\['hadamard', 'query-hadamard', 'lowrank'\]"
    with pytest.raises(ConfigError, match=rf"transforms must be a non-empty selection of {allowed}"):
        list(space(layers, transforms=("rotate",)))
    config = LlamaConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
                         head_dim=64, intermediate_size=64, vocab_size=64)  # fmt: skip
    label = "log8-k3cmv2c-t4x32-n8"
    bits = [simulated_bits(c.args, config, 300) for c in (plain[label], weighted[f"{label}-qh"])]
    weights = 64 * 4 * 8  # bits of one row and head's weights, per layer; held by every layer and head alike
    assert bits[1] - bits[0] == pytest.approx(weights / ((300 + 1) * 2 * 64), rel=1e-6)


def test_the_low_rank_transform_is_an_axis_on_request():
    """Named in ``transforms``, each rotated composition gets an ``-lr`` twin with ``transform="lowrank"``; not by
    default; its bytes are the twin's plus the coefficient table and the fit; the command line offers exactly
    the transforms the search knows, with its defaults."""
    from transformers import LlamaConfig

    from kvpolicy_lab.commands.tune import register
    from kvpolicy_lab.tune import DEFAULT_TRANSFORMS, TRANSFORMS, simulated_bits

    layers = list(range(6))
    assert not any(c.label.endswith("-lr") for c in space(layers, windows=(8,)))
    plain = {c.label: c for c in space(layers, windows=(8,), transforms=("hadamard",))}
    low = {c.label: c for c in space(layers, windows=(8,), transforms=("lowrank",))}
    assert set(low) == {f"{label}-lr" for label in plain}
    for label, c in low.items():
        assert c.args == {**plain[label.removesuffix("-lr")].args, "transform": "lowrank"}
    config = LlamaConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
                         head_dim=64, intermediate_size=64, vocab_size=64)  # fmt: skip
    label = "log8-k3cmv2c-t4x32-n8"
    bits = [simulated_bits(c.args, config, 300) for c in (plain[label], low[f"{label}-lr"])]
    table = -(-301 // 64) * 64  # positions 0..300, 64 at a time
    extra = table * (8 + 2) * 8 + (64 + 64 * 8) * 4 * 8  # bits per layer and head: table, scales, centre, basis
    assert bits[1] - bits[0] == pytest.approx(extra / ((300 + 1) * 2 * 64), rel=1e-6)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    action = next(a for a in parser._subparsers._group_actions[0].choices["tune"]._actions if a.dest == "transforms")
    assert tuple(action.choices) == TRANSFORMS and tuple(action.default) == DEFAULT_TRANSFORMS


def space_labels(**kw) -> set[str]:
    return {c.label for c in space(list(range(4)), windows=(8,), **kw)}


def test_lattice_blocks_are_an_axis_of_rotated_keys_and_values_at_their_widths():
    """Beside codebook indices, the space holds D4 lattice keys (centred, ``lm``) and values (``l``) at 2 and 3
    bits, never at 4 (the lattice has no 4-bit table) and never with 4-bit boundary layers; ``schemes`` narrows
    the search to one scheme, and a scheme tune does not know is refused."""
    layers = list(range(6))
    both = {c.label: c for c in space(layers, windows=(8,))}
    lattice = {label: c for label, c in both.items() if "lattice" in repr(c.args)}
    assert {"log8-k2lmv2l-n8", "log8-k3lmv2l-t4x32-n8", "log8-k3cmv2l-n8", "log8-k2lmv2c-n8"} <= set(lattice)
    for label, c in lattice.items():
        quant = c.args["tiers"][1] if c.family == "tiered" else c.args
        roles = [(quant["key_bits"], quant.get("key_scheme")), (quant["value_bits"], quant.get("value_scheme"))]
        assert all(bits in (2, 3) for bits, scheme in roles if scheme == "lattice"), label
        assert c.family != "boundary" and "layer_bits" not in c.args, label
        if quant.get("key_scheme") == "lattice":
            assert quant["key_centre"] is True and "lm" in label
        if c.family == "tiered":
            assert c.args["tiers"][0]["scheme"] == "codebook"  # the 4-bit middle tier stays codebook
        cache = CompressedCache(**c.args)
        bottom = cache.action.tiers[-1] if isinstance(cache.action, Tiered) else cache.action
        lattices = [f for f in (bottom.keys, bottom.values) if f.name == "lattice"]
        assert lattices and all(f.norm_bits == 8 for f in lattices), label
    codebook_only = {c.label for c in space(layers, windows=(8,), schemes=("codebook",))}
    assert codebook_only == set(both) - set(lattice)
    lattice_only = {c.label: c for c in space(layers, windows=(8,), schemes=("lattice",))}
    assert not any(c.args.get("key_scheme") == "codebook" or c.args.get("value_scheme") == "codebook"
                   for c in lattice_only.values())  # fmt: skip
    assert set(lattice_only) <= set(both)
    with pytest.raises(ConfigError, match=r"vector schemes must be a non-empty selection of \['codebook', 'lattice'\]; "
                       r"got \['e8'\]"):  # fmt: skip
        list(space(layers, schemes=("e8",)))
    with pytest.raises(ConfigError, match="vector schemes"):
        list(space(layers, schemes=()))
