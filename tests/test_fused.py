"""The fused decode path (kvpolicy.fused): same logits as the materialised path, and it says when it is not used."""

from __future__ import annotations

import pytest
import torch
from conftest import teacher_forced_logits, tiny_model

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores
from kvpolicy.backends.base import dense_attention
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.fused import attend_parts, disable_fused, enable_fused, merge
from kvpolicy.layer.parts import Part

KW = dict(policy="log", window=8, bits=2, group_size=16)


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def fresh():
    built: dict = {}

    def get(family: str) -> torch.nn.Module:
        if family not in built:
            built[family] = tiny_model(family)
        return built[family]

    return get


def _run(model, ids, prefill, fused: bool, **kw):
    if fused:
        enable_fused(model)
    try:
        cache = CompressedCache(**{**KW, **kw})
        logits = teacher_forced_logits(model, ids, prefill, cache)
    finally:
        disable_fused(model)
    return logits, cache


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("layout", ["ordered", "agnostic"])
def test_fused_logits_equal_materialized(fresh, family, layout):
    """GQA models, both layouts; 36 decode steps cross key-group flushes (G=16) with staging non-empty
    in between, and values quantized ahead of keys (the store's full-precision tail)."""
    model = fresh(family)
    ids = _ids(2, 75)
    ref, _ = _run(model, ids, 38, False, layout=layout, attention="materialized")
    got, cache = _run(model, ids, 38, True, layout=layout)
    assert set(cache.attention_paths().values()) == {f"fused ({cache.backend.name})"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)
    store = cache.layers[0].engine.held.store
    assert store.k.staging is not None and store.k.num_quantized > 0  # the last step had a staged tail
    assert store.v.num_quantized > store.k.num_quantized


def test_fused_differs_from_full_precision_only(fresh):
    """The quantized history is really attended (not just the full-precision segment)."""
    model = fresh("llama")
    ids = _ids(1, 70)
    got, _ = _run(model, ids, 40, True)
    wrong = teacher_forced_logits(model, ids, 40, CompressedCache(policy="log", window=8, action="evict"))
    assert not torch.allclose(got, wrong, atol=1e-3)


def test_memory_report_unchanged_by_fused_path(fresh):
    model = fresh("llama")
    ids = _ids(1, 70)
    _, a = _run(model, ids, 40, False, attention="materialized")
    _, b = _run(model, ids, 40, True)
    assert a.memory_report().segments == b.memory_report().segments
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in b.layers for t in _tensors(layer)
    }
    assert b.memory_report().total_bytes == sum(storages.values())  # a storage once (layers share positions)


def _tensors(layer):
    yield layer.keys
    yield layer.values
    yield layer.engine.held.full_pos
    yield layer.engine.held.store.positions
    for stream in (layer.engine.held.store.k, layer.engine.held.store.v):
        yield from stream.q.tensors().values()
        if stream.staging is not None:
            yield stream.staging


def test_padded_batch_materializes_visibly(fresh):
    model = fresh("llama")
    ids = _ids(2, 60)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    enable_fused(model)
    try:
        cache = CompressedCache(**KW)
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False)
        want = f"materialized ({cache.backend.name}): left-padded"
        assert all(p.startswith(want) for p in cache.attention_paths().values())
        with pytest.raises(NotImplementedError, match="left-padded"):
            model.generate(ids, attention_mask=mask, cache=CompressedCache(**KW, attention="fused"), max_new_tokens=2)
    finally:
        disable_fused(model)


def test_score_policy_refused_by_fused_and_materialized_by_auto(fresh):
    with pytest.raises(ConfigError, match="attention='fused'"):
        CompressedCache(policy="h2o", action="quantize", bits=2, attention="fused")
    with pytest.raises(ConfigError, match="attention must be one of"):
        CompressedCache(attention="fast")
    model = fresh("llama")
    ids = _ids(1, 70)
    enable_scores(model)
    ref = teacher_forced_logits(model, ids, 40, CompressedCache(policy="h2o", heavy=8, recent=8, bits=2, group_size=16))
    enable_fused(model)
    try:
        cache = CompressedCache(policy="h2o", heavy=8, recent=8, bits=2, group_size=16)
        got = teacher_forced_logits(model, ids, 40, cache)
    finally:
        disable_fused(model)
    want = f"materialized ({cache.backend.name}): policy 'h2o'"
    assert all(p.startswith(want) for p in cache.attention_paths().values())
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_fused_mode_without_enable_fails_loudly(fresh):
    model = fresh("llama")
    ids = _ids(1, 60)
    with pytest.raises(RuntimeError, match="enable_fused"):
        teacher_forced_logits(model, ids, 40, CompressedCache(**KW, attention="fused"))


def _hole(lo: int, t: int) -> torch.Tensor:
    """A custom 4-D mask over positions ``[lo, t)``: causal, key 3 hidden (a 2-D mask with a hole is padding a
    compressed cache refuses, tests/test_padding.py)."""
    query = torch.arange(lo, t)[:, None]
    key = torch.arange(t)[None, :]
    return ((key <= query) & (key != 3))[None, None]


def test_mask_hiding_keys_falls_back_under_auto_and_is_refused_under_fused(fresh):
    """A mask with a hole cannot be fused: under attention='auto' the step materialises and says so; under
    attention='fused' it raises."""
    model = fresh("llama")
    ids = _ids(1, 50)
    pos = torch.arange(51)[None]
    enable_fused(model)
    try:
        for attention in ("auto", "materialized"):
            cache = CompressedCache(**KW, attention=attention)
            with torch.inference_mode():
                model(ids[:, :40], cache=cache, attention_mask=_hole(0, 40), position_ids=pos[:, :40])
                for t in range(40, 50):
                    out = model(
                        ids[:, t : t + 1], cache=cache, attention_mask=_hole(t, t + 1), position_ids=pos[:, t : t + 1]
                    )
            if attention == "auto":
                got, paths = out.logits, cache.attention_paths()
            else:
                ref = out.logits
    finally:
        disable_fused(model)
    assert all("mask" in p for p in paths.values())
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    enable_fused(model)
    try:
        cache = CompressedCache(**KW, attention="fused")
        with torch.inference_mode():
            model(ids[:, :40], cache=cache, attention_mask=_hole(0, 40), position_ids=pos[:, :40])
            with pytest.raises(RuntimeError, match="cannot run fused: an attention mask that hides some keys"):
                model(ids[:, 40:41], cache=cache, attention_mask=_hole(40, 41), position_ids=pos[:, 40:41])
    finally:
        disable_fused(model)


def test_sliding_window_layers_without_config_are_refused_by_fused_and_materialised_by_auto():
    """A Mistral config with a sliding window of 16, the cache built without config=: once the history is
    longer than the window, the mask hides keys. attention='fused' names the window and config=;
    attention='auto' materialises, and equals attention='materialized'."""
    model = tiny_model("mistral")
    model.config.sliding_window = 16
    ids = _ids(1, 50)
    ref = teacher_forced_logits(model, ids, 40, CompressedCache(**KW, attention="materialized"))
    enable_fused(model)
    try:
        cache = CompressedCache(**KW)
        got = teacher_forced_logits(model, ids, 40, cache)
        with pytest.raises(
            RuntimeError, match=r"sliding window \(16 tokens\): build the cache with config=model\.config"
        ):
            teacher_forced_logits(model, ids, 40, CompressedCache(**KW, attention="fused"))
    finally:
        disable_fused(model)
    want = f"materialized ({cache.backend.name}): an attention mask that hides some keys"
    assert set(cache.attention_paths().values()) == {want}
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_output_attentions_is_refused_by_fused_and_materialised_by_auto(fresh):
    model = fresh("llama")
    ids = _ids(1, 42)
    enable_fused(model)
    try:
        for attention in ("auto", "fused"):
            cache = CompressedCache(**KW, attention=attention)
            with torch.inference_mode():
                model(ids[:, :40], cache=cache)
                if attention == "fused":
                    with pytest.raises(RuntimeError, match="cannot run fused: output_attentions"):
                        model(ids[:, 40:41], cache=cache, output_attentions=True)
                else:
                    model(ids[:, 40:41], cache=cache, output_attentions=True)
                    want = f"materialized ({cache.backend.name}): output_attentions"
                    assert set(cache.attention_paths().values()) == {want}
    finally:
        disable_fused(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_parts_equals_softmax_over_everything(dtype):
    """The log-sum-exp merge of the parts equals plain attention over all keys (GQA, 3 query heads per kv head)."""
    g = torch.Generator().manual_seed(0)
    be = TorchBackend()
    b, hk, d = 2, 2, 64
    full_k, full_v = (torch.randn(b, hk, 5, d, generator=g).to(dtype) for _ in range(2))
    qk = be.quantize(torch.randn(b, hk, 128, d, generator=g).to(dtype), 2, 32, "channel")
    qv = be.quantize(torch.randn(b, hk, 128, d, generator=g).to(dtype), 4, 32, "token")
    tail = tuple(torch.randn(b, hk, 7, d, generator=g).to(dtype) for _ in range(2))
    query = torch.randn(b, hk * 3, 1, d, generator=g).to(dtype)
    got = attend_parts(query, [Part(*tail), Part(qk, qv, be), Part(full_k, full_v)], 0.125)
    keys = torch.cat([be.dequantize(qk).float(), tail[0].float(), full_k.float()], dim=2)
    values = torch.cat([be.dequantize(qv).float(), tail[1].float(), full_v.float()], dim=2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.float(), keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1), scale=0.125
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, rtol=0, atol=tol)


def test_merge_with_empty_part():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2, 8, generator=g) for _ in range(3))
    out, lse = dense_attention(q, k, v, 1.0)
    empty = (torch.zeros_like(out), torch.full_like(lse, -float("inf")))
    merged, total = merge([empty, (out, lse)])
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(total, lse)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("key_axis", ["channel", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attend_equals_float64_attention_over_the_stored_codes(bits, key_axis, dtype):
    """``TorchBackend.attend`` (per-channel keys scored from their codes, ``(q ⊙ s) · codes + q · z``)
    against softmax attention computed in float64 from the stored codes and metadata."""
    from kvpolicy.backends.torch_backend import unpack

    def exact(q):
        v = unpack(q.codes, q.bits).double() * q.scales.double().unsqueeze(-1) + q.zeros.double().unsqueeze(-1)
        return v.reshape(q.shape) if q.axis == "token" else v.transpose(-1, -2).reshape(q.shape)

    g = torch.Generator().manual_seed(bits)
    be = TorchBackend()
    keys = be.quantize((torch.randn(2, 3, 96, 64, generator=g) * 3 + 5).to(dtype), bits, 32, key_axis)
    values = be.quantize(torch.randn(2, 3, 96, 64, generator=g).to(dtype), bits, 32, "token")
    query = torch.randn(2, 3, 4, 64, generator=g).to(dtype)
    out, lse = be.attend(query, keys, values, 0.125)
    scores = torch.matmul(query.double(), exact(keys).transpose(-1, -2)) * 0.125
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=0, atol=2e-5)
    ref = torch.matmul(torch.softmax(scores, -1), exact(values))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("fit", ["minmax", None])  # None: the defaults (fitted keys, min-max values)
def test_end_to_end_codes_differ_only_at_rounding_ties(stored_blocks, fit):
    """The guarantee that holds end to end (docs/explanation/scale-out.md, "Where quantized runs differ").

    Layer 0 produces the same output on both paths up to float rounding, so the keys and values of
    later layers differ by that noise between the fused and the materialised run. The stored blocks
    must then be equal except at rounding ties: a code differs only by one, for an input within
    float noise of the midpoint between two grid points; a 16-bit scale or minimum differs only by
    one unit in the last place (its float32 value straddled a float16 rounding boundary).

    A fitted range (``fit="mse"``, the keys' default) rounds every element of its group at each round
    of the fit, so a tie there moves the group's fitted range by more than the noise: such a group must
    be a fitted one in one of the runs, and they are rare; the other groups keep the whole guarantee.
    """
    from kvpolicy.backends.torch_backend import _grouped, quantize_groups, unpack

    model = tiny_model("llama", layers=4)  # deep and long enough for ties to occur
    ids = _ids(2, 300, seed=4)
    stored_blocks.append([])
    kw = {} if fit is None else {"fit": fit}
    _run(model, ids, 40, False, attention="materialized", **kw)
    stored_blocks.append([])
    _, cache = _run(model, ids, 40, True, **kw)
    assert set(cache.attention_paths().values()) == {f"fused ({cache.backend.name})"}
    materialized, fused = ([(_grouped(x.float(), g, axis), out) for x, g, axis, out in run] for run in stored_blocks)
    assert len(fused) == len(materialized) > 10

    code_flips = meta_flips = total = refits = groups = 0
    for (ga, qa), (gb, qb) in zip(materialized, fused, strict=True):
        noise = (ga - gb).abs()
        assert noise.max() <= 1e-4 * max(1.0, float(ga.abs().max()))  # the inputs: float noise apart
        za, zb, sa, sb = (t.float().unsqueeze(-1) for t in (qa.zeros, qb.zeros, qa.scales, qb.scales))
        # metadata: each run's min and scale, rounded to 16 bits, move only by the input noise (plus the
        # one float16 step a value straddling a rounding boundary can take)
        step = lambda m: (torch.nextafter(m, m.new_tensor(float("inf"))) - m).float().unsqueeze(-1)  # noqa: E731
        group_noise = noise.amax(dim=-1, keepdim=True)
        near = ((za - zb).abs() <= group_noise + step(qa.zeros)) & ((sa - sb).abs() <= group_noise + step(qa.scales))
        groups += near.numel()
        if not near.all():
            assert fit is None, "a min-max group's metadata moved by more than its input's noise"
            # a refit that went the other way at a tie: a group fitted (not its min-max grid) in one run
            minmax = [quantize_groups(g, qa.bits, qa.scales.dtype, "minmax")[1:] for g in (ga, gb)]
            fitted = torch.zeros_like(near)
            for (s_mm, z_mm), q in zip(minmax, (qa, qb), strict=True):
                fitted |= ((q.scales != s_mm) | (q.zeros != z_mm)).unsqueeze(-1)
            assert fitted[~near].all()
            refits += int((~near).sum())
        meta_flips += int(((qa.scales != qb.scales) | (qa.zeros != qb.zeros)).unsqueeze(-1)[near].sum())
        ca, cb = unpack(qa.codes, qa.bits).int(), unpack(qb.codes, qb.bits).int()
        flipped = (ca != cb) & near  # codes are compared on grids within the noise of each other
        total += ca.numel()
        code_flips += int(flipped.sum())
        if flipped.any():
            assert ((ca - cb).abs()[flipped] == 1).all()
            t = (ga - za) / sa  # the input's position on run A's grid
            # how far the two runs' perturbations (input, minimum, scale) can move it, in grid steps
            reach = (noise + (za - zb).abs() + ((1 << qa.bits) - 1) * (sa - sb).abs()) / sa
            assert ((t - t.floor() - 0.5).abs() <= reach + 1e-5)[flipped].all()  # at a midpoint: a tie
    assert 0 < code_flips + meta_flips + refits < 1e-3 * total, (code_flips, meta_flips, refits, total)  # > 0: ran
    assert refits <= 1e-2 * groups, (refits, groups)


# ------------------------------------------------------------------ steps the fused function declines

_DECLINED = {
    "softcap": (dict(softcap=30.0), "attention argument 'softcap'"),
    "s_aux": (dict(s_aux=torch.zeros(2)), "attention argument 's_aux'"),
    "sinks": (dict(sinks=torch.zeros(2)), "attention argument 'sinks'"),
    "position_bias": (dict(position_bias=torch.zeros(1, 2, 1, 41)), "attention argument 'position_bias'"),
    "output_attentions": (dict(output_attentions=True), "output_attentions"),
    "dropout": (dict(dropout=0.1), "dropout in training"),
    "mask": (dict(hole=True), "an attention mask that hides some keys"),
    "sliding": (dict(hole=True, sliding_window=16), "an attention mask that hides some keys"),
}


def _declined_call(attention: str, case: str):
    """One decode step of a layer (40 tokens held, 32 of them quantized), then the fused function (of
    eager attention: sdpa itself refuses some of these arguments) called on its hand-off with what
    ``case`` names; returns the cache and the call's result."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvpolicy.fused import register

    register()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 40, 64, generator=g)
    cache = CompressedCache(**KW, backend="torch", attention=attention)
    cache.update(x, x, 0)
    keys, values = cache.update(x[:, :, :1], x[:, :, :1], 0)
    kwargs = dict(_DECLINED[case][0])
    module = torch.nn.Module()
    module.is_causal = True
    module.train(kwargs.get("dropout") is not None)
    mask = None
    if kwargs.pop("hole", False):
        mask = torch.ones(1, 1, 1, 41, dtype=torch.bool)
        mask[..., 5] = False
    query = torch.randn(1, 2, 1, 64, generator=g)
    out = ALL_ATTENTION_FUNCTIONS["kvpolicy_fused_eager"](module, query, keys, values, mask, scaling=0.125, **kwargs)
    return cache, out


@pytest.mark.parametrize("case", sorted(_DECLINED))
def test_a_step_the_fused_function_declines_raises_under_fused_and_materialises_under_auto(case):
    """Every reason the fused function declines a decode step: attention='fused' refuses it, naming the
    reason and the remedy (config= for a sliding window), before anything is computed; attention='auto'
    materialises the step and records why."""
    reason = _DECLINED[case][1]
    with pytest.raises(
        RuntimeError, match=rf"attention='fused'\): layer 0's decode step cannot run fused: {reason}\."
    ) as info:
        _declined_call("fused", case)
    assert "attention='auto'" in str(info.value)
    assert ("config=model.config" in str(info.value)) == (case == "sliding")
    cache, (out, _) = _declined_call("auto", case)
    assert cache.attention_paths() == {0: f"materialized (torch): {reason}"}
    assert out.shape == (1, 1, 2, 64) and bool(torch.isfinite(out).all())
