"""The lattice scheme: a per-vector scale and D4 lattice indices (``Quantize(scheme="lattice")``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kvpolicy_research import lattice
from kvpolicy_research.lattice import Lattice, LatticeTensor
from research_cases import fused_and_materialized, saved_cache_continues, teacher_forced_logits, tiny_model
from research_parts import cpu_kernel, ensure_registered, research_parts  # noqa: F401 - fixtures, and the plugin's parts registered

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.backends.base import dense_attention
from kvpolicy.backends.torch_backend import TorchBackend
from kvpolicy.errors import ConfigError
from kvpolicy.formats import codebook
from kvpolicy.testing import check_backend, check_format

#: Conway & Sloane, "Sphere Packings, Lattices and Groups", Table 2.3: the normalized second moment of D4
G_D4 = 0.0766032
#: the volume of D4's Voronoi cell (its determinant: the index of D4 in Z^4)
VOLUME_D4 = 2.0


def _brute_nearest_dn(x: torch.Tensor, reach: int = 2) -> torch.Tensor:
    """The squared distance from each row of ``x`` to the nearest point of D_n, by enumerating the
    even-sum integer points within ``reach`` of its rounding."""
    n = x.shape[-1]
    offsets = torch.tensor(list(itertools.product(range(-reach, reach + 1), repeat=n)), dtype=x.dtype)
    cand = torch.round(x).unsqueeze(-2) + offsets  # (..., K, n)
    even = torch.remainder(cand.sum(-1), 2) == 0
    d2 = ((cand - x.unsqueeze(-2)) ** 2).sum(-1)
    return torch.where(even, d2, torch.inf).amin(-1)


# ------------------------------------------------------------------ the lattice and its table


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 5),
    rows=st.lists(st.lists(st.floats(-6, 6, allow_nan=False, width=64), min_size=5, max_size=5), min_size=1,
                  max_size=8),
)  # fmt: skip
def test_nearest_dn_is_a_nearest_lattice_point(n, rows):
    x = torch.tensor(rows, dtype=torch.float64)[:, :n]
    p = lattice.nearest_dn(x)
    assert torch.equal(p, torch.round(p)) and bool((torch.remainder(p.sum(-1), 2) == 0).all())
    got = ((p - x) ** 2).sum(-1)
    torch.testing.assert_close(got, _brute_nearest_dn(x), rtol=0, atol=1e-9)


def test_second_moment_of_d4_on_uniform_data_is_the_published_one():
    """The infinite lattice quantizer on uniform data: per-dimension MSE = G(D4) · V^(2/4)."""
    x = torch.rand(400_000, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1000
    mse = float(((lattice.nearest_dn(x) - x) ** 2).mean())
    want = G_D4 * VOLUME_D4 ** (2 / 4)
    assert abs(mse / want - 1) < 0.05, (mse, want)


@pytest.mark.parametrize("bits", [2, 3])
def test_table_is_the_lattice_points_nearest_the_origin(bits):
    pts = torch.tensor(lattice.lattice_points(bits), dtype=torch.float64)
    shift = torch.tensor(lattice.TABLES[bits][1], dtype=torch.float64)
    assert pts.shape == (1 << (4 * bits), 4)
    assert len({tuple(p) for p in pts.tolist()}) == len(pts)  # distinct
    assert bool((torch.remainder((pts - shift).sum(-1), 2) == 0).all())  # in D4 + shift
    # no point of the lattice outside the table is nearer the origin than the table's farthest
    box = torch.tensor(list(itertools.product(range(-8, 9), repeat=4)), dtype=torch.float64)
    members = box[torch.remainder((box - shift).sum(-1), 2) == 0]
    inside = {tuple(p) for p in pts.tolist()}
    outside = torch.stack([p for p in members if tuple(p.tolist()) not in inside])
    assert float((outside**2).sum(-1).min()) >= float((pts**2).sum(-1).max())


def test_two_bit_table_is_symmetric():
    pts = {tuple(p) for p in lattice.lattice_points(2)}
    assert pts == {tuple(-c for c in p) for p in pts}


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3]),
    spread=st.sampled_from([0.5, 2.0, 5.0, 20.0]),
    seed=st.integers(0, 2**16),
)
def test_nearest_index_is_the_nearest_table_point(bits, spread, seed):
    """Exact against a search of the whole table, near the origin and far beyond the table's ball."""
    y = torch.randn(64, 4, generator=torch.Generator().manual_seed(seed)) * spread
    table = lattice.points(bits)
    idx = lattice.nearest_index(y, bits)
    got = ((table[idx] - y) ** 2).sum(-1)
    best = torch.cdist(y.double(), table.double()).pow(2).amin(-1)
    torch.testing.assert_close(got.double(), best, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3])
def test_index_round_trip(bits):
    """Every table point, quantized, decodes to itself; digits and indices are inverse."""
    n = 1 << (4 * bits)
    every = torch.arange(n)
    digits = lattice.index_digits(every.reshape(-1, 16), bits)
    assert int(digits.max()) < (1 << bits)
    assert torch.equal(lattice.digits_index(digits, bits).reshape(-1), every)
    table = lattice.points(bits)
    assert torch.equal(lattice.nearest_index(table, bits), every)
    # through a block: the packed codes give back the indices of the search, and the points they name
    x = torch.randn(2, 3, 5, 64)
    q = Lattice(bits, meta_dtype="float32").quantize(x)
    y = x * (lattice.TABLES[bits][0] * 8 / x.norm(dim=-1, keepdim=True))
    want = lattice.nearest_index(y.reshape(2, 3, 5, 16, 4), bits)
    assert torch.equal(lattice.indices(q), want)
    assert torch.equal(lattice.unit_vectors(q), table[want].reshape(2, 3, 5, 64))


# ------------------------------------------------------------------ reconstruction quality


def _gaussian(n: int, d: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, 1, n, d, generator=torch.Generator().manual_seed(seed))


def _mse(x: torch.Tensor, bits: int, beta: float | None = None) -> float:
    old = lattice.TABLES[bits]
    try:
        if beta is not None:
            lattice.TABLES[bits] = (beta, old[1])
        q = Lattice(bits, meta_dtype="float32").quantize(x)
    finally:
        lattice.TABLES[bits] = old
    return float(((q.dequantize() - x) ** 2).mean())


@pytest.mark.parametrize("bits", [2, 3])
def test_beta_is_a_local_minimum_of_the_gaussian_error(bits):
    x = _gaussian(6000, seed=bits)
    beta = lattice.TABLES[bits][0]
    at = _mse(x, bits)
    assert at <= _mse(x, bits, beta - 0.05) and at <= _mse(x, bits, beta + 0.05)


@pytest.mark.parametrize("bits", [2, 3])
def test_beats_the_lloyd_max_codebook_and_respects_the_rate_distortion_bound(bits):
    x = _gaussian(6000, seed=10 + bits)
    got = _mse(x, bits)
    scalar = float(((codebook.quantize(x, bits, torch.float32).dequantize() - x) ** 2).mean())
    assert 2.0 ** (-2 * bits) < got < 0.95 * scalar, (got, scalar)


def test_reconstruction_keeps_each_vector_norm_and_zero_stays_zero():
    x = _gaussian(50) * 3
    x[0, 0, 7] = 0
    for bits in (2, 3):
        xh = Lattice(bits, meta_dtype="float32").quantize(x).dequantize()
        torch.testing.assert_close(xh.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
        assert torch.equal(xh[0, 0, 7], torch.zeros(64))


@pytest.mark.parametrize("bits", [2, 3])
def test_bytes_held_are_the_formula(bits):
    q = Lattice(bits).quantize(torch.randn(2, 3, 10, 128))
    assert q.nbytes() == {"codes": 2 * 3 * 10 * 128 * bits // 8, "scales": 2 * 3 * 10 * 2}
    one = Lattice(bits, norm_bits=8).quantize(torch.randn(2, 3, 10, 128))
    assert one.nbytes() == {"codes": 2 * 3 * 10 * 128 * bits // 8, "scales": 2 * 3 * 10, "scale_base": 2 * 3 * 2}


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 3]), spread=st.floats(0.0, 2.9), centred=st.booleans(), seed=st.integers(0, 2**16))
@example(bits=2, spread=2.75, centred=False, seed=0)  # a scale more than the fine span below its row's largest
def test_one_byte_scales_decode_within_their_bound_of_the_exact_ones(bits, spread, centred, seed):
    from kvpolicy.formats import scale_codes
    from kvpolicy.formats.scale_codes import COARSE_ERROR, FINE_ERROR

    gen = torch.Generator().manual_seed(seed)
    # vector norms spread over `spread` octaves; a vector's scale also depends on its direction, so a few
    # scales may fall more than the fine span below their row's largest and take a coarse code
    x = torch.randn(2, 2, 12, 64, generator=gen) * torch.exp2(spread * torch.rand(2, 2, 12, 1, generator=gen))
    mu = torch.randn(2, 2, 1, 64, generator=gen) if centred else None
    exact = Lattice(bits, "float32", centred).quantize(x, centre=mu)
    one = Lattice(bits, "float32", centred, norm_bits=8).quantize(x, centre=mu)
    assert one.norm_bits == 8 and one.scales.dtype == torch.uint8
    assert torch.equal(one.codes, exact.codes)  # the codes do not depend on how the scale is stored
    rel = (one.scale_values() - exact.scale_values()).abs() / exact.scale_values()
    scales = exact.scale_values().double()
    below = scales.amax(dim=-1, keepdim=True).log2() - scales.log2()  # octaves below the row's largest
    fine_span = (scale_codes.TOP - scale_codes.FINE_LOW - 1) / scale_codes.STEPS  # a grid step of margin
    bound = torch.where(below <= fine_span, FINE_ERROR, COARSE_ERROR) * (1 + 1e-5)
    assert bool((rel <= bound).all()), float((rel - bound).max())


# ------------------------------------------------------------------ attention from the codes


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), nq=st.integers(1, 4), kbits=st.sampled_from([2, 3]), vbits=st.sampled_from([2, 3]),
       centred=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_lookup_scores_and_mix_equal_the_materialised_ones(n, nq, kbits, vbits, centred, seed):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 2, n, 64, generator=gen), torch.randn(2, 2, n, 64, generator=gen)
    q = torch.randn(2, 2, nq, 64, generator=gen)
    mu = torch.randn(2, 2, 1, 64, generator=gen) if centred else None
    norm = 8 if seed % 2 else 16
    kq = Lattice(kbits, "float32", centred, norm).quantize(k, centre=mu)
    vq = Lattice(vbits, "float32", centred, norm).quantize(v, centre=mu)
    kd, vd = kq.dequantize(), vq.dequantize()
    torch.testing.assert_close(kq.scores(q), q @ kd.transpose(-1, -2), rtol=1e-5, atol=1e-4)
    probs = torch.softmax(torch.randn(2, 2, nq, n, generator=gen), -1)
    torch.testing.assert_close(vq.mix(probs), probs @ vd, rtol=1e-5, atol=1e-5)
    out, lse = TorchBackend().attend(q, kq, vq, 0.125)
    want_out, want_lse = dense_attention(q, kd, vd, 0.125)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_bits", [16, 8])
def test_blocks_cat_narrow_select_map_batch_and_round_trip_through_their_saved_state(norm_bits):
    mu = torch.randn(2, 3, 1, 64)
    for centre in (None, mu):
        fmt = Lattice(3, centre=centre is not None, norm_bits=norm_bits)
        x = torch.randn(2, 3, 9, 64)
        a, b = fmt.quantize(x[:, :, :4], centre=centre), fmt.quantize(x[:, :, 4:], centre=centre)
        whole = LatticeTensor.cat([a, b])
        assert whole.shape == (2, 3, 9, 64)
        torch.testing.assert_close(whole.dequantize(), fmt.quantize(x, centre=centre).dequantize())
        torch.testing.assert_close(whole.narrow(2, 5).dequantize(), whole.dequantize()[:, :, 2:7])
        idx = torch.tensor([8, 0, 3])
        torch.testing.assert_close(whole.select(idx).dequantize(), whole.dequantize()[:, :, idx])
        torch.testing.assert_close(whole.map_batch(lambda t: t[1:]).dequantize(), whole.dequantize()[1:])
        saved = whole.state()
        assert saved["layout"] == ("lattice-d4-v2" if norm_bits == 8 else "lattice-d4-v1")
        again = LatticeTensor.from_state(saved)
        assert again.norm_bits == norm_bits and torch.equal(again.dequantize(), whole.dequantize())
    with pytest.raises(ValueError, match="different centres"):
        LatticeTensor.cat([Lattice(2, centre=True).quantize(x, centre=mu), Lattice(2).quantize(x)])
    with pytest.raises(ValueError, match=r"(8-bit and 16-bit|16-bit and 8-bit) norms"):
        LatticeTensor.cat([Lattice(2).quantize(x), Lattice(2, norm_bits=8).quantize(x)])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(bits=4), r"lattice block bits"),
        (dict(layout="lattice-e8-v9"), r"block layout"),
        (dict(codes=torch.zeros(1, 2, 5, 15, dtype=torch.uint8)), r"block codes"),
        (dict(codes=torch.zeros(1, 2, 5, 16, dtype=torch.int16)), r"block codes"),
        (dict(scales=torch.zeros(1, 2, 4)), r"scales must be"),
        (dict(scales=torch.zeros(1, 2, 5, dtype=torch.int32)), r"scales must be"),
        (dict(shape=[1, 2, 5, 60]), r"multiple of 8"),
        (dict(centre=torch.zeros(1, 2, 1, 32, dtype=torch.float16)), r"centre must be"),
        (dict(extra=1), r"extra"),
    ],
)
def test_untrusted_saved_blocks_are_refused(change, match):
    good = Lattice(2).quantize(torch.randn(1, 2, 5, 64)).state()
    with pytest.raises(ValueError, match=match):
        LatticeTensor.from_state({**good, **change})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(layout="lattice-d4-v1"), r"lattice-d4-v1 block has no scale_base"),
        (dict(scales=torch.zeros(1, 2, 5)), r"scales must be uint8"),
        (dict(scales=torch.zeros(1, 2, 4, dtype=torch.uint8)), r"scales must have shape"),
        (dict(scale_base=torch.zeros(1, 2, 1, dtype=torch.int32)), r"int16 scale_base"),
        (dict(scale_base=torch.full((1, 2, 1), 32767, dtype=torch.int16)), r"scale_base holds values"),
        (dict(scale_base=None), r"scale_base"),
    ],
)
def test_untrusted_saved_blocks_of_one_byte_scales_are_refused(change, match):
    good = Lattice(2, norm_bits=8).quantize(torch.randn(1, 2, 5, 64)).state()
    with pytest.raises(ValueError, match=match):
        LatticeTensor.from_state({**good, **change})


# ------------------------------------------------------------------ bad configuration


def test_bad_parameters_are_refused_naming_them():
    with pytest.raises(ConfigError, match=r"Lattice: bits must be one of \[2, 3\]; got bits=4"):
        Lattice(4)
    with pytest.raises(ConfigError, match=r"Lattice: norm_bits must be one of \[16, 8\]; got norm_bits=12"):
        Lattice(2, norm_bits=12)
    with pytest.raises(ConfigError, match=r"'lattice' refuses bits=4: Lattice: bits must be one of \[2, 3\]"):
        Quantize(bits=4, scheme="lattice")
    for d in (10, 12):
        with pytest.raises(ConfigError, match=rf"head_dim={d} does not split .* head_dim must be a multiple of 8"):
            Lattice(2).quantize(torch.randn(1, 1, 3, d))
    cache = CompressedCache(policy="recent", window=2, bits=2, scheme="lattice", transform="hadamard")
    with pytest.raises(ConfigError, match=r"scheme='lattice' need a head_dim that is a multiple of 8.*head_dim=12"):
        cache.update(torch.randn(1, 1, 8, 12), torch.randn(1, 1, 8, 12), 0)


def test_without_a_rotation_is_refused():
    with pytest.raises(ConfigError, match=r"scheme='lattice' .* assumes rotated"):
        CompressedCache(policy="recent", window=2, bits=2, scheme="lattice", backend="torch")


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_backends_without_the_scheme_refuse_it(backend):
    pytest.importorskip({"quanto": "optimum.quanto", "hqq": "hqq"}[backend])
    with pytest.raises(ConfigError, match=rf"backend {backend!r} does not serve (key_)?scheme='lattice'"):
        CompressedCache(policy="recent", window=2, bits=2, scheme="lattice", transform="hadamard", backend=backend)


# ------------------------------------------------------------------ through a cache


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("norm_bits", [16, 8])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_equals_materialized(family, norm_bits, backend):
    got, ref, cache = fused_and_materialized(
        family, group_size=None, key_bits=3, value_bits=2, scheme="lattice", transform="hadamard", backend=backend,
        norm_bits=norm_bits,
    )  # fmt: skip
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    assert isinstance(cache.layers[0].engine.held.store.k.q, LatticeTensor)
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fused_equals_materialized_across_moves_between_centred_tiers(backend):
    from kvpolicy.actions.tiered import Tiered
    from kvpolicy.policies.log import LogWindow

    tiers = [Quantize(bits=4, scheme="codebook", key_centre=True, norm_bits=8),
             Quantize(bits=3, scheme="lattice", key_centre=True, norm_bits=8),
             Quantize(bits=2, scheme="lattice", key_centre=True)]  # fmt: skip
    got, ref, cache = fused_and_materialized(
        group_size=None, action=Tiered(tiers=tiers, keep=[LogWindow(8), LogWindow(4)]), transform="hadamard",
        backend=backend,
    )  # fmt: skip
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fused_equals_materialized_with_minmax_keys_and_lattice_values(backend):
    got, ref, cache = fused_and_materialized(
        transform="hadamard", key_bits=4, value_bits=2, value_scheme="lattice", backend=backend
    )
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}
    torch.testing.assert_close(got, ref, rtol=0, atol=5e-5)


@pytest.mark.parametrize("norm_bits", [16, 8])
@pytest.mark.parametrize("key_centre", [False, True])
def test_saved_cache_continues_identically(tmp_path, key_centre, norm_bits):
    _, loaded = saved_cache_continues(
        tmp_path, policy="log", window=4, key_bits=3, value_bits=2, scheme="lattice", transform="hadamard",
        key_centre=key_centre, norm_bits=norm_bits,
    )  # fmt: skip
    k = loaded.layers[0].engine.held.store.k.q
    assert isinstance(k, LatticeTensor) and k.norm_bits == norm_bits


def test_lattice_stays_close_to_uncompressed_and_closer_with_more_bits():
    model = tiny_model("llama")
    ids = torch.randint(3, 96, (1, 90), generator=torch.Generator().manual_seed(6))
    ref = torch.log_softmax(teacher_forced_logits(model, ids, 60, CompressedCache(action="none")), -1)
    kl = {}
    for bits in (2, 3):
        cache = CompressedCache(policy="log", window=8, bits=bits, scheme="lattice", transform="hadamard")
        got = torch.log_softmax(teacher_forced_logits(model, ids, 60, cache), -1)
        kl[bits] = float((ref.exp() * (ref - got)).sum(-1).mean())
    assert kl[3] < kl[2] < 5e-3


def test_the_format_passes_check_format():
    check_format(Lattice)  # the torch backend and the cpu kernel: the backends it names


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backends_pass_check_backend(backend):
    from kvpolicy import registry

    formats = [Lattice(2), Lattice(3), Lattice(2, norm_bits=8), Lattice(3, norm_bits=8)]
    if backend == "torch":  # the cpu kernel reads one metadata dtype for keys and values (checked below)
        formats.append(Lattice(3, meta_dtype="float32"))
    check_backend(registry.get("backends", backend)(), formats=formats, bound="reference")


def test_the_cpu_kernel_scores_and_mixes_lattice_codes_as_the_reference_does():
    """Every scheme pair with a lattice role, odd token counts (a tile's AVX2 eight and the scalar rest), several
    queries, a centre and one-byte scales: the kernel's output and log-sum-exp against the torch backend's."""
    from kvpolicy.backends.cpu_backend import CpuBackend
    from kvpolicy.formats import Codebook, MinMax

    cpu, ref = CpuBackend(), TorchBackend()
    cpu.tile = 16
    gen = torch.Generator().manual_seed(4)
    pairs = [(Lattice(2), Lattice(2)), (Lattice(3, "float32"), Lattice(3, "float32")),
             (Lattice(2, norm_bits=8), Codebook(3, norm_bits=8)), (Codebook(2), Lattice(3)),
             (MinMax(4, 32, "channel", meta_dtype="float16"), Lattice(2, "float16")),
             (Lattice(3, centre=True, norm_bits=8), MinMax(2, 32, "token"))]  # fmt: skip
    for kf, vf in pairs:
        for n in (1, 9, 64, 131):
            if isinstance(kf, MinMax):
                n = 32 * (n // 32 + 1)
            k, v = torch.randn(2, 2, n, 64, generator=gen), torch.randn(2, 2, n, 64, generator=gen)
            q = torch.randn(2, 2, 3, 64, generator=gen)
            mu = torch.randn(2, 2, 1, 64, generator=gen) if getattr(kf, "centre", False) else None
            kq = kf.quantize(k, centre=mu) if mu is not None else kf.quantize(k)
            vq = vf.quantize(v)
            out, lse = cpu.attend(q, kq, vq, 0.125)
            want_out, want_lse = ref.attend(q, kq, vq, 0.125)
            where = f"{kf} {vf} n={n}"
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-6, msg=lambda m, w=where: f"{w}: {m}")
            torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=2e-6, msg=lambda m, w=where: f"{w}: {m}")


def test_the_cpu_kernel_refuses_lattice_tables_that_do_not_fit_the_codes():
    from kvpolicy.backends.cpu_backend import CpuBackend

    cpu = CpuBackend()
    kq = Lattice(2).quantize(torch.randn(1, 1, 5, 64))
    args = [torch.randn(1, 1, 1, 64), kq.codes, kq.scales.float(), None]
    rest = [2, 16, kq.codes, kq.scales.float(), None, lattice.points(2), 2, 0, 1, None, None, None, None]
    with pytest.raises(RuntimeError, match=r"the lattice table must be \(256, 4\) contiguous float32 points"):
        cpu._kernel.attend(*args, lattice.points(3), *rest)
    with pytest.raises(RuntimeError, match=r"lattice rows are 2 or 3 bits per coordinate; got 4"):
        cpu._kernel.attend(*args, torch.zeros(1 << 16, 4), 4, *rest[1:])
