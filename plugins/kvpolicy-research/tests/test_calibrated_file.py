"""The calibrated rotation read from a statistics file (``CalibratedRotation(statistics=path)``): each layer
takes its own rotations from the file when it binds, after the file is checked against the model and the
layer; every batch row shares them."""

from __future__ import annotations

import copy

import pytest
import torch
from kvpolicy_research import calibration
from kvpolicy_research.calibrated import CalibratedBasis, CalibratedRotation
from research_cases import CODEBOOK, composition, teacher_forced_logits, tiny_model
from research_cases import ids as _ids
from research_parts import research_parts  # noqa: F401 - fixtures, and the plugin's parts registered

from kvpolicy import CompressedCache
from kvpolicy.errors import CacheFileError, ConfigError
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.testing import check_basis
from kvpolicy.transforms import BindContext


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def stats_file(llama, tmp_path_factory):
    """Statistics of the tiny llama over calibration texts other than the ones the tests run."""
    texts = [torch.randint(3, 96, (2, 48), generator=torch.Generator().manual_seed(100))]
    path = tmp_path_factory.mktemp("stats") / "llama.stats.safetensors"
    return calibration.save(calibration.measure(llama, texts), path)


def _run(model, cache, ids, mask=None, fused=True):
    """Teacher-forced logits of ``ids`` (prefill 38, then one token a step) through ``cache``."""
    if fused:
        enable_fused(model)
    try:
        return teacher_forced_logits(model, ids, 38, cache) if mask is None else _masked(model, ids, mask, cache)
    finally:
        if fused:
            disable_fused(model)


def _masked(model, ids, mask, cache):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits, dim=1)


def test_each_layer_holds_the_files_rotation_for_its_index(llama, stats_file):
    t = CalibratedRotation(statistics=str(stats_file))
    assert not t.needs_queries and CalibratedRotation().needs_queries
    cache = CompressedCache.for_model(llama, transform=t, **CODEBOOK)
    _run(llama, cache, _ids(), fused=False)  # no attention wrapper: nothing is fitted on the prompt
    u, w, v = calibration.load(stats_file, llama.config).rotations(t)
    for i, layer in enumerate(cache.layers):
        basis = layer.engine.held.basis
        assert isinstance(basis, CalibratedBasis) and basis.from_file
        assert torch.equal(basis.key_basis, u[i : i + 1]) and torch.equal(basis.key_weights, w[i : i + 1])
        assert torch.equal(basis.value_basis, v[i : i + 1])
    assert not torch.equal(cache.layers[0].engine.held.basis.key_basis, cache.layers[1].engine.held.basis.key_basis)


def test_the_basis_keeps_the_transform_contract(llama, stats_file):
    keys = torch.empty(2, llama.config.num_key_value_heads, 0, 64)
    for layer in (0, 1):
        context = BindContext.of(layer, keys, keys, llama.config)
        for rotate_values in (True, False):
            check_basis(CalibratedRotation(statistics=str(stats_file), rotate_values=rotate_values), 64, 0, context)


def _refused(model, transform, error, match):
    """The first forward is refused with ``error`` matching ``match``, and no layer holds anything."""
    cache = CompressedCache.for_model(model, transform=transform, **CODEBOOK)
    with pytest.raises(error, match=match), torch.no_grad():
        model(_ids(12), cache=cache, use_cache=True)
    assert all(layer.engine.held is None for layer in cache.layers)  # nothing held: no store, no basis


def test_another_models_file_is_refused_naming_it_before_anything_is_held(stats_file):
    qwen = tiny_model("qwen2")
    _refused(qwen, CalibratedRotation(statistics=str(stats_file)), ValueError, f"{stats_file}.*another model")
    deeper = tiny_model("llama", layers=3)
    _refused(deeper, CalibratedRotation(statistics=str(stats_file)), ValueError, "num_hidden_layers 2")


@pytest.mark.parametrize("edit", ["heads", "head_dim", "tensor"])
def test_a_file_of_other_shapes_is_refused_naming_it(llama, stats_file, tmp_path, edit):
    stats = calibration.load(stats_file, llama.config)
    model, tensors = dict(stats.model), {n: getattr(stats, n) for n in calibration.TENSORS}
    if edit == "heads":  # a file that says its model has one KV head, and holds one
        model["num_key_value_heads"] = 1
        tensors = {n: t[:, :1] for n, t in tensors.items()}
    elif edit == "head_dim":
        model["head_dim"] = model["v_head_dim"] = 32
        tensors = {n: t[..., :32, :32] for n, t in tensors.items()}
    else:  # the model recorded right, one tensor of the wrong shape
        tensors["value_moment"] = tensors["value_moment"][..., :32, :32]
    path = calibration.save(calibration.Statistics(**tensors, model=model, tokens=stats.tokens), tmp_path / "x.st")
    _refused(llama, CalibratedRotation(statistics=str(path)), ValueError, str(path))


def test_a_layer_of_other_shapes_than_the_config_is_refused_naming_the_file(llama, stats_file):
    """The layer's own tensors count, not only the config (a model split across processes holds fewer heads)."""
    one_head = torch.empty(1, 1, 0, 64)
    with pytest.raises(ValueError, match=f"{stats_file}.*num_key_value_heads"):
        CalibratedRotation(statistics=str(stats_file)).bind(BindContext.of(0, one_head, one_head, llama.config))


def test_a_missing_file_or_no_model_is_refused_naming_them(llama, stats_file, tmp_path):
    _refused(llama, CalibratedRotation(statistics=str(tmp_path / "none.st")), ValueError, "none.st")
    cache = CompressedCache(transform=CalibratedRotation(statistics=str(stats_file)), **CODEBOOK)
    with pytest.raises(ConfigError, match="for_model"), torch.no_grad():
        llama(_ids(12), cache=cache, use_cache=True)


def test_bad_statistics_parameter_is_refused_naming_it():
    for bad in (3, "", " "):
        with pytest.raises(ConfigError, match="statistics"):
            CalibratedRotation(statistics=bad)


@pytest.mark.parametrize(("name", "rotate_values"), [("codebook", True), ("tiered", True), ("tiered", False)])
def test_fused_equals_materialized(llama, stats_file, name, rotate_values):
    t = CalibratedRotation(statistics=str(stats_file), rotate_values=rotate_values)
    kw = {**composition(name), "transform": t, "backend": "torch"}
    got = _run(llama, cache := CompressedCache.for_model(llama, **kw), _ids())
    ref = _run(llama, CompressedCache.for_model(llama, attention="materialized", **kw), _ids(), fused=False)
    assert set(cache.attention_paths().values()) == {"fused (torch)"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("rotate_values", [True, False])
def test_the_rotations_are_counted_once_per_layer_whatever_the_batch(llama, stats_file, rotate_values):
    t = CalibratedRotation(statistics=str(stats_file), rotate_values=rotate_values)
    plain = CompressedCache.for_model(llama, transform="hadamard", **CODEBOOK)
    cal = CompressedCache.for_model(llama, transform=t, **CODEBOOK)
    for cache in (plain, cal):
        _run(llama, cache, _ids())
    a, b = dict(plain.memory_report().segments), dict(cal.memory_report().segments)
    layers, heads, d = 2, llama.config.num_key_value_heads, 64  # batch 2: one row of rotations per layer
    per_layer = heads * ((2 if rotate_values else 1) * d * d * 2 + d * 4)
    assert b.pop("transform") - a.pop("transform") == layers * per_layer
    assert a == b
    assert cal.memory_report().bits_per_element > plain.memory_report().bits_per_element


def test_a_saved_cache_continues_bit_for_bit(llama, stats_file, tmp_path):
    t = CalibratedRotation(statistics=str(stats_file))
    ids = _ids(40)
    cache = CompressedCache.for_model(llama, transform=t, **{**CODEBOOK, "window": 4})
    with torch.no_grad():
        llama(ids[:, :30], cache=cache, use_cache=True)
    path = tmp_path / "c.kvc"
    cache.save(path, model=llama)
    loaded = CompressedCache.load(path, model=llama)
    basis, was = loaded.layers[1].engine.held.basis, cache.layers[1].engine.held.basis
    assert basis.from_file and basis.key_basis is was.key_basis  # the file's tensors again, held once
    want = teacher_forced_logits(llama, ids[:, 30:], 1, copy.deepcopy(cache))
    assert torch.equal(teacher_forced_logits(llama, ids[:, 30:], 1, loaded), want)
    # loading names the file it reads, when it is gone
    moved = stats_file.with_suffix(".moved")
    stats_file.rename(moved)
    try:
        with pytest.raises(CacheFileError, match=stats_file.name):
            CompressedCache.load(path, model=llama)
    finally:
        moved.rename(stats_file)


@pytest.mark.parametrize("pad", [0, 5], ids=["batch", "left-padded"])
def test_each_batch_row_equals_the_row_run_alone(llama, stats_file, pad):
    """The rotations depend on no row: a row of a batch (left-padded or not) holds the very tensors the row
    run alone holds, and generates the same tokens with the same logits."""
    t = CalibratedRotation(statistics=str(stats_file))
    ids = _ids(40)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    cache = CompressedCache.for_model(llama, transform=t, **CODEBOOK)
    seq, logits = _run(llama, cache, ids, mask, fused=False)
    alone = CompressedCache.for_model(llama, transform=t, **CODEBOOK)
    seq1, logits1 = _run(llama, alone, ids[1:, pad:], torch.ones_like(ids[1:, pad:]), fused=False)
    engine = cache.layers[0].engine
    basis = engine.rows[1].held.basis if pad else engine.held.basis
    assert basis.key_basis is alone.layers[0].engine.held.basis.key_basis
    assert torch.equal(seq[1, -6:], seq1[0, -6:])
    torch.testing.assert_close(logits[1], logits1[0], rtol=0, atol=1e-4)
