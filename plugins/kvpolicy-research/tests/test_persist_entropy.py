"""Entropy-coded saved caches (``cache.save(path, codec="entropy")``, :mod:`kvpolicy_research.entropy`):
lossless round trips, sizes near the empirical entropy, and corrupted or hostile files refused."""

from __future__ import annotations

import json
import math
import struct
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvpolicy_research import entropy
from research_cases import tiny_model
from research_parts import ensure_registered, one_thread, research_parts  # noqa: F401 - fixtures, and the plugin's parts registered
from safetensors import safe_open
from safetensors.torch import save_file

from kvpolicy import CompressedCache, persist
from kvpolicy.errors import CacheFileError
from kvpolicy.formats import codebook
from kvpolicy.formats.packed import pack

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = [torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64]


def _empirical_bits(codes: np.ndarray, levels: int) -> float:
    """``len(codes)`` times the entropy of their empirical distribution, in bits."""
    counts = np.bincount(codes, minlength=levels)
    p = counts[counts > 0] / codes.size
    return float(-(p * np.log2(p)).sum() * codes.size)


def _stored(path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def _header(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["kvpolicy"])


# ---------------------------------------------------------------------------------- round trips
@st.composite
def tensors(draw) -> torch.Tensor:
    """Tensors of many shapes and dtypes, with skewed values (so that coding applies) or not."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = [draw(st.integers(1, 3000)), *draw(st.lists(st.integers(1, 6), max_size=3))]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    n = math.prod(shape)
    kind = draw(st.sampled_from(["codes", "skewed", "uniform", "constant", "normal"]))
    if kind == "codes":  # packed codes of a random distribution over 2**bits levels
        bits = draw(st.sampled_from([1, 2, 3, 4, 8]))
        probs = torch.rand(1 << bits, generator=gen) ** 3 + 1e-3
        codes = torch.multinomial(probs, 8 * n, replacement=True, generator=gen).to(torch.uint8)
        raw = pack(codes.view(-1, 8), bits).reshape(-1)
    elif kind == "skewed":
        raw = (torch.rand(n * 8, generator=gen) ** 6 * 256).to(torch.uint8)
    elif kind == "uniform":
        raw = torch.randint(0, 256, (n * 8,), generator=gen, dtype=torch.uint8)
    elif kind == "constant":
        raw = torch.full((n * 8,), draw(st.integers(0, 255)), dtype=torch.uint8)
    else:
        raw = (torch.randn(n, generator=gen) * draw(st.sampled_from([1e-3, 1.0, 300.0]))).to(torch.float64)
        raw = raw.view(torch.uint8)
    size = torch.empty(0, dtype=dtype).element_size()
    out = raw.reshape(-1)[: n * size]
    if out.numel() < n * size:
        out = torch.cat([out, torch.zeros(n * size - out.numel(), dtype=torch.uint8)])
    if dtype == torch.bool:
        out = out & 1
    return out.view(dtype).reshape(shape)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@settings(max_examples=150, deadline=None)
@given(tensors())
def test_encode_decode_is_bit_identical(t):
    coded = entropy.encode(t)
    if coded is None:  # not smaller, or beyond the expansion bound: stored as it is
        return
    width, payload = coded
    assert payload.numel() < t.numel() * t.element_size() <= entropy.MAX_EXPANSION * payload.numel()
    assert _same(entropy.decode(payload, t.dtype, list(t.shape), width, "t"), t)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(tensors(), min_size=1, max_size=5))
def test_files_of_random_tensors_load_bit_identical(tmp_path, ts):
    """Through the file format: coded tensors, tensors stored as they are and empty ones come back the same."""
    tree = {"a": ts, "empty": torch.empty(0, 3)}
    path = tmp_path / "t.kvc"
    persist.write(path, {}, tree, codec="entropy")
    header, back = persist.read(path)
    for a, b in zip([*ts, tree["empty"]], [*back["a"], back["empty"]], strict=True):
        assert _same(a, b)
    assert header["version"] == (persist.CODED_VERSION if "coding" in header else persist.VERSION)


# ---------------------------------------------------------------------------------- sizes
def _gaussian_codes(bits: int, n: int, seed: int) -> np.ndarray:
    """Lloyd-Max codes of iid Gaussian data (the codebook format's quantizer)."""
    _, edges = codebook._tables(bits, "cpu")
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return torch.bucketize(x, edges, right=True).to(torch.uint8).numpy()


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("source", ["gaussian", "skewed"])
def test_coded_packed_codes_are_within_two_percent_of_their_entropy(tmp_path, bits, source):
    """2^17 codes packed at 2, 3 and 4 bits (3 bits: eight codes to three bytes, codes crossing byte
    boundaries): the coded payload in the file is within 2 % of the codes' empirical entropy."""
    n = 1 << 17
    if source == "gaussian":
        codes = _gaussian_codes(bits, n, seed=bits)
    else:
        rng = np.random.default_rng(bits)
        p = rng.dirichlet(np.full(1 << bits, 0.5))
        codes = rng.choice(1 << bits, size=n, p=p).astype(np.uint8)
    packed = pack(torch.from_numpy(codes).view(-1, 64), bits)
    path = tmp_path / "codes.kvc"
    persist.write(path, {}, {"codes": packed}, codec="entropy")
    payload_bits = _stored(path, "t0").numel() * 8
    assert payload_bits <= 1.02 * _empirical_bits(codes, 1 << bits)
    if bits == 3 and source == "gaussian":
        # bytes of 3-bit codes split two codes of every eight: an order-0 model of bytes misses the
        # 2 % (their entropy is ~3.8 % above the codes'), so the file codes 3-bit symbols
        assert _empirical_bits(packed.reshape(-1).numpy(), 256) > 1.02 * _empirical_bits(codes, 8)
        assert _header(path)["coding"]["t0"]["width"] == 3
    assert torch.equal(persist.read(path)[1]["codes"], packed)


def test_byte_planes_code_each_byte_by_its_own_statistics(tmp_path):
    """int64 positions (high bytes zero) and float16 scales (a narrow exponent byte) shrink by
    their planes' entropies, each plane near its own."""
    positions = torch.randperm(1 << 15, generator=torch.Generator().manual_seed(0)).to(torch.int64)
    scales = (torch.rand(1 << 15, generator=torch.Generator().manual_seed(1)) * 0.5 + 0.25).to(torch.float16)
    for t in (positions, scales):
        planes = t.view(torch.uint8).reshape(-1, t.element_size()).numpy()
        bound = sum(_empirical_bits(planes[:, p], 256) for p in range(t.element_size())) / 8
        table = t.element_size() * (2 * 256 + 7)
        _, payload = entropy.encode(t)
        assert payload.numel() <= 1.02 * bound + table
        assert payload.numel() < 0.8 * t.numel() * t.element_size()


# ---------------------------------------------------------------------------------- real caches
COMPOSITIONS = [
    dict(policy="log", window=4, bits=3, group_size=16),
    dict(policy="log", window=4, key_bits=4, value_bits=2, scheme="codebook", transform="hadamard"),
    dict(policy="h2o", heavy=4, recent=4, bits=2, group_size=16),
    dict(policy="sink", sinks=2, window=6, action="evict"),
    dict(policy="log", window=4, bits=3, scheme="codebook", transform="hadamard", key_centre=True, norm_bits=8),
    dict(policy="log", window=4, key_bits=3, value_bits=2, scheme="lattice", transform="hadamard", norm_bits=8),
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (2, length), generator=torch.Generator().manual_seed(seed))


def _steps(model, cache, ids) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])], 1)


def _state(cache) -> list:
    """Every layer's saved state, tensors as (dtype, shape, bytes) so states compare exactly."""

    def plain(node):
        if isinstance(node, torch.Tensor):
            return (str(node.dtype), tuple(node.shape), node.contiguous().view(torch.uint8).numpy().tobytes())
        if isinstance(node, dict):
            return {k: plain(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [plain(v) for v in node]
        return node

    return [plain(layer.state_dict()) for layer in cache.layers]


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """``(cache, plain file, coded file)`` per composition; the cache continues from where it was saved."""
    from kvpolicy.attention import enable_scores

    enable_scores(model)
    root = tmp_path_factory.mktemp("entropy")
    out = []
    for i, kwargs in enumerate(COMPOSITIONS):
        cache = CompressedCache(**kwargs)
        with torch.no_grad():
            model(_ids(120, 5)[:, :100], cache=cache, use_cache=True)
            for t in range(100, 120):
                model(_ids(120, 5)[:, t : t + 1], cache=cache, use_cache=True)
        plain, coded = root / f"{i}.kvc", root / f"{i}.coded.kvc"
        cache.save(plain, model=model)
        cache.save(coded, model=model, codec="entropy")
        out.append((cache, plain, coded))
    return out


def test_a_real_cache_saved_coded_loads_the_same_state_and_continues_bit_for_bit(saved, model):
    nxt = _ids(5, 11)
    for cache, plain, coded in saved:
        assert _header(plain)["version"] == persist.VERSION and "coding" not in _header(plain)
        assert _header(coded)["version"] == persist.CODED_VERSION and _header(coded)["coding"]
        assert coded.stat().st_size < plain.stat().st_size
        a, b = CompressedCache.load(plain, model=model), CompressedCache.load(coded, model=model)
        assert _state(a) == _state(b) == _state(cache)
        reference = _steps(model, cache, nxt)
        assert torch.equal(_steps(model, a, nxt), reference)
        assert torch.equal(_steps(model, b, nxt), reference)


def test_an_old_reader_refuses_a_coded_file_by_version_and_reads_a_plain_one(saved, monkeypatch):
    _, plain, coded = saved[0]
    monkeypatch.setattr(persist, "VERSIONS", (persist.VERSION,))
    with pytest.raises(CacheFileError, match=r"format version 2 is not supported; this kvpolicy reads versions 1"):
        CompressedCache.load(coded)
    CompressedCache.load(plain)


def test_without_constriction_saving_coded_and_loading_coded_name_the_install(saved, monkeypatch, tmp_path):
    cache, plain, coded = saved[0]
    monkeypatch.setitem(sys.modules, "constriction", None)  # import constriction -> ImportError
    with pytest.raises(ImportError, match=r"pip install constriction==0.4.1"):
        cache.save(tmp_path / "x.kvc", codec="entropy")
    assert not (tmp_path / "x.kvc").exists()
    with pytest.raises(CacheFileError, match=r"holds coded tensors \('entropy'\); loading it needs: .*constriction"):
        CompressedCache.load(coded)
    CompressedCache.load(plain)  # a plain file needs no constriction


def test_a_coded_file_names_its_codec_and_without_the_plugin_the_error_names_the_plugin(saved, monkeypatch):
    """The file records the codec's name; with the plugin's entry points not loaded, loading it (or saving
    with the codec) is refused naming the plugin to install, and a plain file still loads."""
    from kvpolicy import registry
    from kvpolicy.errors import ConfigError

    cache, plain, coded = saved[0]
    assert _header(coded)["codec"] == "entropy" and "codec" not in _header(plain)
    monkeypatch.setenv(registry.DISABLE_ENV, "1")
    registry.reset()
    try:
        with pytest.raises(CacheFileError, match=r"coded by codec 'entropy', which no installed plugin registers.*"
                           r"pip install ./plugins/kvpolicy-research"):  # fmt: skip
            CompressedCache.load(coded)
        with pytest.raises(ConfigError, match=r"got codec='entropy'.*pip install ./plugins/kvpolicy-research"):
            cache.save(coded.parent / "never.kvc", codec="entropy")
        CompressedCache.load(plain)
    finally:
        monkeypatch.delenv(registry.DISABLE_ENV)
        registry.reset()
        ensure_registered()


def test_a_coded_file_of_an_earlier_release_without_a_codec_name_loads_bit_identical(saved, tmp_path, model):
    """Coded files written before files named their codec (version 2, no ``"codec"`` entry) are read by the
    codec that wrote them (``EntropyCodec.unnamed_versions``) and load the same state."""
    _, plain, coded = saved[0]
    old = _edited(coded, tmp_path / "old.kvc", lambda h: h.pop("codec"))
    assert "codec" not in _header(old) and _header(old)["version"] == 2
    assert _state(CompressedCache.load(old, model=model)) == _state(CompressedCache.load(plain, model=model))


# ---------------------------------------------------------------------------------- corruption
def _payload_span(path) -> tuple[int, int, str]:
    """Byte offsets ``[start, end)`` in the file of its largest coded tensor's payload, and its name."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    table = json.loads(data[8 : 8 + n])
    coded = _header(path)["coding"]
    name = max(coded, key=lambda k: table[k]["data_offsets"][1] - table[k]["data_offsets"][0])
    lo, hi = table[name]["data_offsets"]
    return 8 + n + lo, 8 + n + hi, name


def test_truncated_coded_files_are_refused(saved, tmp_path):
    _, _, coded = saved[1]
    data = coded.read_bytes()
    for cut in sorted({*range(0, len(data), max(1, len(data) // 97)), len(data) - 1, len(data) - 4}):
        bad = tmp_path / "cut.kvc"
        bad.write_bytes(data[:cut])
        with pytest.raises(CacheFileError):
            persist.read(bad)


def test_a_truncated_payload_under_a_consistent_header_is_refused(saved, tmp_path):
    """The payload cut short and the file rewritten around it (a valid safetensors file)."""
    _, _, coded = saved[0]
    _, _, name = _payload_span(coded)
    with safe_open(str(coded), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    full = tensors[name]
    for cut in sorted({1, 2, 5, 9, full.numel() // 3, full.numel() // 2, full.numel() - 4, full.numel() - 1}):
        tensors[name] = full[:cut].clone()
        save_file(tensors, str(tmp_path / "short.kvc"), metadata=meta)
        with pytest.raises(CacheFileError, match=name):
            persist.read(tmp_path / "short.kvc")


def test_bit_flips_in_the_coded_payload_are_refused(saved, tmp_path):
    _, _, coded = saved[1]
    data = bytearray(coded.read_bytes())
    start, end, name = _payload_span(coded)
    rng = np.random.default_rng(0)
    offsets = sorted({start, start + 1, start + 3, start + 6, end - 1, *rng.integers(start, end, 60).tolist()})
    for at in offsets:
        flipped = bytearray(data)
        flipped[at] ^= 1 << int(rng.integers(0, 8))
        bad = tmp_path / "flip.kvc"
        bad.write_bytes(bytes(flipped))
        with pytest.raises(CacheFileError, match=name):
            persist.read(bad)


def test_bit_flips_in_the_coding_header_are_refused(saved, tmp_path):
    """Every bit of the header's coding entries and checksums, flipped one at a time (sampled)."""
    _, _, coded = saved[0]
    data = coded.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = data[8 : 8 + n]
    rng = np.random.default_rng(1)
    for key in (b'\\"coding\\"', b'\\"checksums\\"'):
        lo = head.index(key)
        hi = lo + 400
        for at in rng.integers(lo + len(key), hi, 40).tolist():
            flipped = bytearray(data)
            flipped[8 + at] ^= 1 << int(rng.integers(0, 7))
            bad = tmp_path / "flip.kvc"
            bad.write_bytes(bytes(flipped))
            with pytest.raises(CacheFileError):
                CompressedCache.load(bad)


def _edited(src, dst, edit_header=None, edit_payload=None):
    with safe_open(str(src), framework="pt") as f:
        header = json.loads(f.metadata()["kvpolicy"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if edit_header:
        edit_header(header)
    if edit_payload:
        edit_payload(header, tensors)
    save_file(tensors, str(dst), metadata={"kvpolicy": json.dumps(header)})
    return dst


def _first_coded(h) -> str:
    return next(iter(h["coding"]))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["coding"][_first_coded(h)].update(shape=[2**40]), r"declares \d+ bytes from a payload"),
        (lambda h: h["coding"][_first_coded(h)].update(shape=[2**20, 2**20, 2**20]), "declares"),
        (lambda h: h["coding"][_first_coded(h)].update(width=5), "coded width 5 is not one of"),
        (lambda h: h["coding"][_first_coded(h)].update(dtype="complex64"), "not a dtype a saved cache holds"),
        (lambda h: h["coding"][_first_coded(h)].pop("width"), "not a mapping of dtype, shape, width"),
        (lambda h: h["coding"].update(t999={"dtype": "uint8", "shape": [1], "width": 8}), "'coding' entry"),
        (lambda h: h.update(coding={}), "'coding' entry"),
        (lambda h: h.pop("coding"), "'coding' entry"),
        (lambda h: h.update(version=1), "a version 1 file lists coded tensors"),
        (lambda h: h["coding"][_first_coded(h)].update(shape=[-1]), "shape"),
    ],
)
def test_malformed_coding_entries_are_refused_before_decoding(saved, tmp_path, edit, match):
    _, _, coded = saved[0]
    with pytest.raises(CacheFileError, match=match):
        CompressedCache.load(_edited(coded, tmp_path / "e.kvc", edit))


def _plane_table(payload: torch.Tensor) -> tuple[int, int]:
    """Offset and symbol count ``k`` of the first plane's frequency table (the plane must be coded)."""
    assert payload[0].item() == 1
    _, k, _ = struct.unpack_from("<BBI", payload.numpy().tobytes(), 1)
    return 1 + 6, k + 1


def _coded_first_plane(path) -> str:
    """A coded tensor of the file whose first plane is coded (not stored raw)."""
    with safe_open(str(path), framework="pt") as f:
        return next(name for name in _header(path)["coding"] if f.get_tensor(name)[0].item() == 1)


def test_frequency_tables_must_sum_to_the_precision_and_decode_to_the_checksum(saved, tmp_path):
    _, _, coded = saved[0]
    name = _coded_first_plane(coded)

    def bad_sum(h, tensors):
        p = tensors[name].clone()
        at, _ = _plane_table(p)
        p[at] ^= 1  # one frequency off by one: the table no longer sums to 2**15
        tensors[name] = p

    with pytest.raises(CacheFileError, match="frequencies sum to"):
        persist.read(_edited(coded, tmp_path / "a.kvc", edit_payload=bad_sum))

    def moved_mass(h, tensors):  # a valid table of other probabilities: decodes, to other bytes
        p = tensors[name].clone()
        at, k = _plane_table(p)
        freq = np.frombuffer(p.numpy().tobytes(), "<u2", k, at).copy()
        i, j = int(np.argmax(freq)), int(np.argmin(freq))
        freq[i] -= 7
        freq[j] += 7
        p[at : at + 2 * k] = torch.frombuffer(bytearray(freq.astype("<u2").tobytes()), dtype=torch.uint8)
        tensors[name] = p

    with pytest.raises(CacheFileError, match=rf"tensor {name!r}"):
        persist.read(_edited(coded, tmp_path / "b.kvc", edit_payload=moved_mass))


def test_a_payload_that_is_not_bytes_or_holds_extra_bytes_is_refused(saved, tmp_path):
    _, _, coded = saved[0]
    name = _first_coded(_header(coded))

    def as_int16(h, tensors):
        tensors[name] = tensors[name][: tensors[name].numel() // 2 * 2].view(torch.int16)

    def extra(h, tensors):
        tensors[name] = torch.cat([tensors[name], torch.zeros(3, dtype=torch.uint8)])

    with pytest.raises(CacheFileError, match="must be 1-D uint8"):
        persist.read(_edited(coded, tmp_path / "a.kvc", edit_payload=as_int16))
    with pytest.raises(CacheFileError, match="bytes follow its last plane"):
        persist.read(_edited(coded, tmp_path / "b.kvc", edit_payload=extra))


def test_quantized_frequencies_sum_to_the_precision_and_keep_every_symbol(tmp_path):
    rng = np.random.default_rng(3)
    for _ in range(200):
        k = int(rng.integers(2, 257))
        counts = rng.integers(0, 3, k) * rng.integers(1, 10**6, k) ** rng.integers(0, 2, k)
        counts[int(rng.integers(0, k))] += 1
        freq = entropy.quantized(counts)
        assert freq.sum() == 1 << entropy.PRECISION
        assert (freq[counts > 0] >= 1).all() and (freq[counts == 0] == 0).all()
