"""Cross-checks of the plugin's backends (they wrap libraries) against the ``torch`` reference and against their
own storage.

Error bounds, per backend (``s`` is a group's step, ``qmax = 2**bits - 1``, ``eps_d`` the input
dtype's machine epsilon):

* ``minmax`` backends (``quanto``): the same asymmetric min-max grid as the
  reference, ``s = (max - min) / qmax``, but with the metadata and arithmetic in the input dtype
  (quanto) instead of directed-rounded 16-bit metadata. So each element is within ``s / 2`` of the
  input, plus: a scale rounded down by ``eps_d / 2`` relative pushes the group maximum past the grid
  (clamped, ``<= qmax * eps_d / 2 * s``); ``x - min`` and ``/ s`` rounded in the input dtype move the
  code argument by ``<= qmax * eps_d`` steps; ``s * code`` and ``- shift`` round twice
  (``<= eps_d * (qmax * s + |x|)``). Against the reference's output the two half steps add up: one
  step ``s`` plus both rounding terms.
* ``own_grid`` backends (``hqq``): the optimiser moves the zero-point, so the grid
  ``{(c - z) * s : c = 0..qmax}`` need not cover the group and neither ``s / 2`` nor the reference's
  output bounds the error. What holds is that each code is the nearest grid point to its input:
  ``|x - x_hat| <= s / 2 + dist(x, [grid_lo, grid_hi])`` plus float32 rounding of ``x / s + z``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quanto_hqq_cases import plugin_backends, quanto_extension, teacher_forced_logits, tiny_model  # noqa: F401

from kvpolicy import registry
from kvpolicy.actions.quantize import QuantizedStream
from kvpolicy.backends.base import Usability
from kvpolicy.errors import ConfigError, MetadataOverflowError, MissingDependencyError
from kvpolicy.formats import MinMax

pytestmark = pytest.mark.usefixtures("plugin_backends", "quanto_extension")

#: backend name -> which bound applies (see the module docstring); one line per backend
CROSSCHECKED = {
    "quanto": "minmax",
    "hqq": "own_grid",
}

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 96, 128)
EPS32 = torch.finfo(torch.float32).eps
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_built: dict[str, object] = {}


def backend(name: str):
    if name not in _built:
        _built[name] = registry.get("backends", name)()
    return _built[name]


def per_element(meta: torch.Tensor, g: int, axis: str, shape) -> torch.Tensor:
    """Per-group metadata in ``(b, h, t, j)`` (token) / ``(b, h, i, d)`` (channel) order -> per element."""
    b, h, t, d = shape
    if axis == "token":
        return meta.reshape(b, h, t, d // g).repeat_interleave(g, dim=3)
    return meta.reshape(b, h, t // g, d).repeat_interleave(g, dim=2)


@st.composite
def cases(draw, name: str):
    caps = backend(name).capabilities
    axis = draw(st.sampled_from(caps.axes))
    dtype = draw(st.sampled_from([d for d in DTYPES if d in caps.dtypes]))
    bits = draw(st.sampled_from(caps.bits))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    mult = max(caps.group_size_multiple, 4)
    if axis == "token":
        g = draw(st.sampled_from([v for v in range(mult, head_dim + 1, mult) if head_dim % v == 0]))
        tokens = draw(st.integers(1, 9))
    else:
        g = draw(st.sampled_from([v for v in (8, 16, 32, 64) if v % mult == 0]))
        tokens = g * draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), tokens, head_dim)
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["randn", "outliers", "ints", "some_constant"]))
    scale = draw(st.sampled_from([1e-2, 1.0, 30.0]))
    offset = draw(st.sampled_from([0.0, -7.5, 20.0]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, shape, generator=gen).float() if kind == "ints" else torch.randn(shape, generator=gen)
    if kind == "outliers":
        x = torch.where(torch.rand(shape, generator=gen) < 0.02, x * 50, x)
    x = x * scale + offset
    if kind == "some_constant":
        x[:, :, ::3, :] = offset
    return axis, bits, g, x.to(dtype)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the buffer behind ``t`` (a view of a bigger buffer would show here)."""
    return t.untyped_storage().nbytes()


def reference_step(
    x: torch.Tensor, bits: int, g: int, axis: str, meta_dtype: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``torch`` reference's output and per-element step ``s``."""
    ref = backend("torch")
    q = ref.quantize(x, bits, g, axis, meta_dtype=meta_dtype)
    return ref.dequantize(q).double(), per_element(q.scales, g, axis, x.shape).double()


# --------------------------------------------------------------------------------------------------
# error bounds
# --------------------------------------------------------------------------------------------------


def check_minmax(name: str, x: torch.Tensor, bits: int, g: int, axis: str, ref_meta: str = "auto") -> None:
    be = backend(name)
    xh = be.dequantize(be.quantize(x, bits, g, axis))
    assert xh.shape == x.shape and xh.dtype == x.dtype
    xt, s = reference_step(x, bits, g, axis, ref_meta)
    xd = x.double()
    qmax = (1 << bits) - 1
    eps = torch.finfo(x.dtype).eps
    lo = per_element(_group_min(xd, g, axis), g, axis, x.shape)
    rounding = eps * (2 * qmax * s + 2 * xd.abs() + lo.abs()) + 4 * EPS32 * (xd.abs() + qmax * s)
    err = (xh.double() - xd).abs()
    assert (err <= s / 2 + rounding).all(), f"{name}: worst excess {float((err - s / 2 - rounding).max())}"
    ref_rounding = eps * (xd.abs() + s) + 4 * EPS32 * (xd.abs() + lo.abs() + qmax * s)
    diff = (xh.double() - xt).abs()
    assert (diff <= s + rounding + ref_rounding).all(), f"{name} vs torch: worst {float((diff / s).max())} steps"


def _group_min(xd: torch.Tensor, g: int, axis: str) -> torch.Tensor:
    b, h, t, d = xd.shape
    if axis == "token":
        return xd.reshape(b, h, t, d // g, g).amin(-1)
    return xd.reshape(b, h, t // g, g, d).amin(3)


def check_own_grid(name: str, x: torch.Tensor, bits: int, g: int, axis: str) -> None:
    be = backend(name)
    q = be.quantize(x, bits, g, axis)
    xh = be.dequantize(q)
    assert xh.shape == x.shape and xh.dtype == x.dtype
    s = per_element(q.scales, g, axis, x.shape).double()
    z = per_element(q.zeros, g, axis, x.shape).double()
    qmax = (1 << bits) - 1
    xd = x.double()
    grid_lo, grid_hi = -z * s, (qmax - z) * s
    outside = (grid_lo - xd).clamp_min(0) + (xd - grid_hi).clamp_min(0)
    eps = torch.finfo(x.dtype).eps
    err = (xh.double() - xd).abs()
    # float32 arithmetic, then rounding of the output (its own magnitude: a 1-bit grid point may lie far from x)
    rounding = 4 * EPS32 * (xd.abs() + s * (z.abs() + qmax)) + eps * (xd.abs() + xh.double().abs())
    assert (err <= s / 2 + outside + rounding).all(), f"{name}: worst excess {float((err - s / 2 - outside).max())}"
    if x.dtype == torch.float32:  # float32 outputs are grid points (16-bit outputs round off the grid)
        codes = xh.double() / s + z
        # xh = (c - z) * s was computed in float32: the code recovered carries ~eps32 * (|z| + qmax)
        slack = 1e-3 + 4 * EPS32 * (z.abs() + qmax)
        assert (codes >= -slack).all() and (codes <= qmax + slack).all()
        assert ((codes - codes.round()).abs() <= 1e-3 + 4 * EPS32 * (xd.abs() / s + z.abs())).all()


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
@SETTINGS
@given(data=st.data())
def test_error_bound(name, data):
    axis, bits, g, x = data.draw(cases(name))
    if CROSSCHECKED[name] == "minmax":
        check_minmax(name, x, bits, g, axis)
    else:
        check_own_grid(name, x, bits, g, axis)


# --------------------------------------------------------------------------------------------------
# values beyond float16's range
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
@pytest.mark.parametrize("magnitude", [1e5, 1e6])
@pytest.mark.parametrize("axis", ["channel", "token"])  # keys' default axis, values' default axis
@pytest.mark.parametrize("bits", [2, 4])
def test_large_float32_values(name, magnitude, axis, bits):
    """float32 keys / values around 1e5 and 1e6: quanto (float32 scale and shift) and hqq (float32
    metadata) hold them, within their usual bounds (quanto against the reference with float32 metadata)."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 2, 16, 64, generator=gen) * magnitude
    x[..., 1] += 2 * magnitude  # an all-positive channel: a large minimum
    q = backend(name).quantize(x, bits, 16, axis)
    assert all(torch.isfinite(t).all() for role, t in q.tensors().items() if role != "codes")
    if CROSSCHECKED[name] == "minmax":
        check_minmax(name, x, bits, 16, axis, ref_meta="float32")
    else:
        check_own_grid(name, x, bits, 16, axis)


@pytest.mark.parametrize("axis", ["channel", "token"])
def test_quanto_float16_overflow_raises(axis):
    """quanto computes in the input dtype: a float16 group spanning more than 65504 has an inf scale. The
    backend raises, naming itself, the dtype and the remedy, instead of storing it."""
    x = torch.full((1, 1, 16, 64), 40000.0, dtype=torch.float16)
    x[..., ::2, :] = -40000.0
    x[..., ::3] = -40000.0
    with pytest.raises(MetadataOverflowError) as ei:
        backend("quanto").quantize(x, 2, 16, axis)
    msg = str(ei.value)
    assert "backend 'quanto'" in msg and "float16" in msg and "4e+04" in msg and "backend='torch'" in msg


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), low=st.sampled_from([-65504.0, -30000.0, 0.0, 30000.0, 65000.0]))
def test_float16_near_the_limit_never_comes_back_inf(name, seed, low):
    """float16 groups reaching 65504: either an error at quantize time or finite values (quanto's own
    float16 arithmetic can put the top of the grid past 65504; the backend checks it)."""
    be = backend(name)
    gen = torch.Generator().manual_seed(seed)
    x = (low + torch.rand(1, 2, 16, 64, generator=gen) * (65504.0 - low)).to(torch.float16)
    x[..., 0, :] = 65504.0
    for bits in (2, 4):
        for axis in ("token", "channel"):
            try:
                q = be.quantize(x, bits, 16, axis)
            except MetadataOverflowError as exc:
                assert name == "quanto" and "float16" in str(exc)
                continue
            assert torch.isfinite(be.dequantize(q)).all()


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
def test_meta_dtype_options(name):
    """quanto keeps the input dtype ("auto" only); hqq stores float32 ("auto" or "float32")."""
    from kvpolicy.actions.quantize import Quantize

    be = backend(name)
    allowed = {"quanto": ["auto"], "hqq": ["auto", "float32"]}[name]
    assert list(be.capabilities.meta_dtypes) == allowed
    for meta in ("auto", "float16", "bfloat16", "float32"):
        action = Quantize(bits=2, group_size=16, meta_dtype=meta, fit="minmax")
        if meta in allowed:
            action.check_backend(be)
        else:
            with pytest.raises(ConfigError, match=rf"backend '{name}' does not support meta_dtype='{meta}'"):
                action.check_backend(be)
    if name == "hqq":
        x = torch.randn(1, 1, 16, 64)
        q = be.quantize(x, 2, 16, "token", meta_dtype="float32")
        assert q.scales.dtype == torch.float32
        with pytest.raises(ConfigError, match="meta_dtype='float16'"):
            be.quantize(x, 2, 16, "token", meta_dtype="float16")


# --------------------------------------------------------------------------------------------------
# bytes reported == bytes held
# --------------------------------------------------------------------------------------------------


def library_tensors(name: str, q) -> list[torch.Tensor]:
    """The tensors the library object itself holds, found through the library's own API."""
    if name == "quanto":
        inner, _ = q.qt.__tensor_flatten__()  # quanto's serialisation names its inner tensors
        out = []
        for attr in inner:
            t = getattr(q.qt, attr)
            if hasattr(t, "__tensor_flatten__"):  # PackedTensor wraps the real uint8 buffer
                out.extend(getattr(t, a) for a in t.__tensor_flatten__()[0])
            else:
                out.append(t)
        return out
    return [q.codes, q.scales, q.zeros]


def expected_bytes(name: str, x: torch.Tensor, bits: int, g: int, axis: str) -> int:
    """Storage from the documented formats (see docs/explanation/backends.md)."""
    n_groups = x.numel() // g
    if name == "quanto":
        # packed along the first axis of the grouped view: (n_groups, G) per token, (G, n_groups) per channel
        per = 8 // bits
        codes = -(-n_groups // per) * g if axis == "token" else -(-g // per) * n_groups
        return codes + 2 * n_groups * x.element_size()
    if name == "hqq":
        codes = n_groups * (4 * -(-g // 10) if bits == 3 else g * bits // 8)
        return codes + 2 * 4 * n_groups
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
@SETTINGS
@given(data=st.data())
def test_bytes_reported_equal_storage(name, data):
    axis, bits, g, x = data.draw(cases(name))
    be = backend(name)
    blocks = [be.quantize(x, bits, g, axis), be.quantize(x * 2, bits, g, axis)]
    for q in (blocks[0], be.cat(blocks)):
        reported = sum(q.nbytes().values())
        held = library_tensors(name, q)
        assert reported == sum(t.numel() * t.element_size() for t in held)
        assert reported == sum(storage_bytes(t) for t in held)  # no view into a bigger buffer
        assert set(q.nbytes()) == {"codes", "scales", "zeros"}
    assert sum(blocks[0].nbytes().values()) == expected_bytes(name, x, bits, g, axis)


def test_quanto_pads_odd_group_counts():
    """quanto packs along the grouped view's first axis and pads it to a multiple of 8 // bits."""
    x = torch.randn(1, 1, 3, 64)
    q = backend("quanto").quantize(x, 2, 64, "token")  # 3 groups -> 1 packed row of 64 bytes
    assert q.nbytes()["codes"] == 64 == expected_bytes("quanto", x, 2, 64, "token") - 2 * 3 * 4


# --------------------------------------------------------------------------------------------------
# cat, map_batch, quantize once
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
@settings(max_examples=15, deadline=None)
@given(
    axis=st.sampled_from(["token", "channel"]),
    sizes=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_cat_and_map_batch(name, axis, sizes, seed):
    be = backend(name)
    gen = torch.Generator().manual_seed(seed)
    g, blocks = 8, []
    for i, k in enumerate(sizes):
        n = k * g if axis == "channel" else k + i
        blocks.append(be.quantize(torch.randn(3, 2, n, 64, generator=gen) * (i + 1), 2, g, axis))
    cat = be.cat(blocks)
    deq = be.dequantize(cat)
    assert cat.shape == (3, 2, sum(b.shape[2] for b in blocks), 64)
    assert torch.equal(deq, torch.cat([be.dequantize(b) for b in blocks], dim=2))
    for fn in (lambda t: t.index_select(0, torch.tensor([2, 0, 0])), lambda t: t.repeat_interleave(2, dim=0)):
        mapped = cat.map_batch(fn)
        assert mapped.shape[0] == fn(deq).shape[0]
        assert torch.equal(be.dequantize(mapped), fn(deq))


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
def test_stream_never_requantizes(name):
    """Later blocks with other ranges leave earlier tokens' dequantized values bit-identical."""
    be = backend(name)
    gen = torch.Generator().manual_seed(1)
    for axis in ("token", "channel"):
        stream = QuantizedStream(be, MinMax(2, 8, axis))
        seen: list[torch.Tensor] = []
        for i, n in enumerate([5, 1, 11, 3, 8]):
            stream.append(torch.randn(2, 2, n, 64, generator=gen) * (i + 1) * 3 + i)
            if stream.q is not None:
                seen.append(be.dequantize(stream.q))
        final = be.dequantize(stream.q)
        for old in seen:
            assert torch.equal(final[:, :, : old.shape[2]], old)


# --------------------------------------------------------------------------------------------------
# errors name the backend, the parameter and what is supported
# --------------------------------------------------------------------------------------------------


def test_quanto_rejects_3_bits_naming_its_bits():
    with pytest.raises(ConfigError, match=r"backend 'quanto' does not support bits=3; it supports bits in \[2, 4\]"):
        backend("quanto").check(bits=3, group_size=32, axis="token")


def test_hqq_rejects_group_size_naming_multiple():
    with pytest.raises(ConfigError, match=r"backend 'hqq' needs group_size to be a multiple of 8; got group_size=4"):
        backend("hqq").check(bits=2, group_size=4, axis="channel")


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
def test_rejects_dtype_naming_supported(name):
    with pytest.raises(ConfigError, match=rf"backend '{name}' does not accept dtype torch.float64; it supports"):
        backend(name).check_tensor(torch.zeros(1, dtype=torch.float64))


def test_cache_construction_checks_backend():
    from kvpolicy import CompressedCache

    with pytest.raises(ConfigError, match=r"backend 'quanto' does not support bits=8"):
        CompressedCache(policy="log", action="quantize", bits=8, backend="quanto")


@pytest.mark.parametrize(
    ("name", "module", "package"), [("quanto", "optimum.quanto", "optimum-quanto"), ("hqq", "hqq", "hqq")]
)
def test_a_missing_library_names_the_plugin_to_install(monkeypatch, name, module, package):
    """Construction raises naming the plugin (which depends on the library); ``kvpolicy list`` says the same."""
    for mod in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, mod, None)  # makes `import mod` raise ImportError
    monkeypatch.setitem(sys.modules, module, None)
    cls = registry.get("backends", name)  # registering needs no import of the package
    with pytest.raises(MissingDependencyError) as info:
        cls()
    assert isinstance(info.value, ImportError) and isinstance(info.value, ConfigError)
    assert "pip install ./plugins/kvpolicy-quanto-hqq" in str(info.value) and repr(name) in str(info.value)
    want = Usability(False, f"needs the {package} package: pip install ./plugins/kvpolicy-quanto-hqq")
    assert registry.get("backends", name).usability() == want


# --------------------------------------------------------------------------------------------------
# end to end on a tiny model
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (2, 56), generator=torch.Generator().manual_seed(0))


# min-max on both sides: quanto and hqq choose no fitted ranges (the keys' default is fitted)
LOG_KW = dict(policy="log", window=8, action="quantize", bits=2, group_size=32, fit="minmax")


@pytest.fixture(scope="module")
def full_and_torch_logits(llama, ids):
    from transformers import DynamicCache

    from kvpolicy import CompressedCache

    full = teacher_forced_logits(llama, ids, 24, DynamicCache())
    return full, teacher_forced_logits(llama, ids, 24, CompressedCache(**LOG_KW, backend="torch"))


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
def test_cache_logits_agree_with_torch_backend(llama, ids, full_and_torch_logits, name):
    """``|logits_X - logits_torch| <= 2 * |logits_torch - logits_full|`` (max over positions).

    Per element the torch backend is within ``s / 2`` of the full-precision keys/values and backend X
    within ``s`` of the torch backend's (one step, see the module docstring); to first order the
    logits' deviations scale with those per-element bounds, hence the factor 2.
    """
    from kvpolicy import CompressedCache

    full, ref = full_and_torch_logits
    cache = CompressedCache(**LOG_KW, backend=name)
    got = teacher_forced_logits(llama, ids, 24, cache)
    ref_dev = float((ref - full).abs().max())
    assert ref_dev > 0  # quantization really happened
    assert float((got - ref).abs().max()) <= 2 * ref_dev
    # the memory report's quantized segments are the storage the library objects really hold
    report = cache.memory_report()
    stores = [layer.engine.held.store for layer in cache.layers]
    held = [t for store in stores for s in (store.k, store.v) for t in library_tensors(name, s.q)]
    assert report.segments["codes"] > 0
    assert report.segments["codes"] + report.segments["scales"] + report.segments["zeros"] == sum(
        storage_bytes(t) for t in held
    )


@pytest.mark.parametrize("name", sorted(CROSSCHECKED))
def test_generate_end_to_end(llama, ids, name):
    from kvpolicy import CompressedCache

    with pytest.raises(ConfigError, match=rf"backend '{name}' does not fit .*Pass key_fit='minmax'"):
        CompressedCache(policy="log", action="quantize", bits=2, key_fit="mse", backend=name)  # asked for
    # the keys' default fit is one this backend lacks: the default becomes min-max, and repr says so
    default = CompressedCache(policy="log", action="quantize", bits=2, backend=name)
    assert "adapted=[\"key_fit='minmax'" in repr(default)
    cache = CompressedCache(policy="log", action="quantize", bits=2, key_fit="minmax", backend=name)
    prompt = ids[:1].repeat(1, 3)[:, :140]  # more than the default window, so tokens are quantized
    outs = [
        llama.generate(prompt, attention_mask=torch.ones_like(prompt), cache=c, max_new_tokens=4, do_sample=False)
        for c in (cache, default)
    ]
    assert outs[0].shape == (1, 144)
    assert torch.equal(outs[0], outs[1])
    assert cache.positions(0)["compressed"].numel() > 0


@pytest.mark.parametrize(("residual", "prompt"), [(4, 10), (16, 16)])
def test_quanto_flush_matches_transformers_quantized_cache(llama, ids, residual, prompt):
    """Our ``recent``/``flush`` + quanto cache against transformers' ``QuantizedCache("quanto")``.

    Both keep the same full-precision tokens (tests/test_policy_recent.py checks the sets). They
    differ in when tokens are quantized: transformers re-quantizes everything (dequantized old
    tokens included) at each flush; we quantize each token once. With per-token groups
    (transformers' ``axis_key=axis_value=0`` and ``q_group_size=head_dim``; our ``"token"`` axes) a
    re-quantization reproduces the first: a min-max group's minimum and maximum get codes 0 and
    qmax, so its re-derived minimum is exact, its scale equal up to one rounding and every code
    the same. So the logits agree to float32 rounding. Per-channel groups would not: transformers'
    groups then span tokens quantized at different flushes and their ranges change.
    """
    from transformers import QuantizedCache

    from kvpolicy import CompressedCache

    hf = QuantizedCache(
        "quanto", llama.config, nbits=2, axis_key=0, axis_value=0, q_group_size=64, residual_length=residual
    )
    ours = CompressedCache(
        policy="recent", variant="flush", window=residual, prompt="quantize", action="quantize", bits=2,
        group_size=64, key_axis="token", value_axis="token", fit="minmax", backend="quanto",
    )  # fmt: skip
    torch_ours = CompressedCache(
        policy="recent", variant="flush", window=residual, prompt="quantize", action="quantize", bits=2,
        group_size=64, key_axis="token", value_axis="token", fit="minmax", backend="torch",
    )  # fmt: skip
    a = teacher_forced_logits(llama, ids, prompt, hf)
    b = teacher_forced_logits(llama, ids, prompt, ours)
    c = teacher_forced_logits(llama, ids, prompt, torch_ours)
    assert torch.allclose(a, b, rtol=0, atol=1e-4), float((a - b).abs().max())
    assert float((a - c).abs().max()) > 1e-3  # a different quantizer gives visibly different logits


def test_quanto_single_group_block_has_one_scale():
    """quanto's optimizer call switches to per-tensor mode for a single group, which gave each element
    its own scale and shift (4x the bytes of the input); the backend keeps the group axis."""
    q = backend("quanto").quantize(torch.randn(1, 1, 1, 64), 2, 64, "token")
    # one float32 scale and shift; the 16 bytes of codes sit in one packed row of 64 (quanto pads the
    # grouped view's first axis to a multiple of 4; a cat repacks and the padding goes away)
    assert q.nbytes() == {"codes": 64, "scales": 4, "zeros": 4}


# --------------------------------------------------------------------------------------------------
# docs/explanation/backends.md
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# the public contract check, as a third-party backend runs it
# --------------------------------------------------------------------------------------------------

#: backend -> how check_backend compares its reconstruction with the reference (see its docstring)
CONTRACT = {"quanto": "minmax", "hqq": "own"}


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_the_plugin_backends_pass_check_backend(name):
    from kvpolicy.testing import check_backend

    check_backend(backend(name), bound=CONTRACT[name])
