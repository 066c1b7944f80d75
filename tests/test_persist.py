"""Saved caches (``cache.save`` / ``CompressedCache.load``): round trips continue with identical logits,
the file holds what the cache holds, and bad files are refused naming what is wrong."""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file
from test_policy_action_matrix import _gemma2

from kvpolicy import CompressedCache
from kvpolicy.attention import enable_scores
from kvpolicy.errors import CacheFileError
from kvpolicy.fused import disable_fused, enable_fused

pytestmark = pytest.mark.usefixtures("one_thread")

_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str = "llama") -> torch.nn.Module:
    if family not in _MODELS:
        model = _gemma2("eager") if family == "gemma2" else tiny_model(family)
        enable_scores(model)  # score-based policies get their scores; outputs unchanged
        _MODELS[family] = model
    return _MODELS[family]


def _ids(length: int, batch: int = 2, seed: int = 5) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _fill(model, cache, ids: torch.Tensor, prefill: int) -> None:
    """Prefill ``ids[:, :prefill]``, then decode the rest one token at a time."""
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, ids.shape[1]):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)


def _continue(model, cache, ids: torch.Tensor, turn: int) -> torch.Tensor:
    """A second multi-token turn of ``turn`` tokens, then single steps: every logit, ``(batch, n, vocab)``."""
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :turn], cache=cache, use_cache=True).logits)
        for t in range(turn, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def _data_bytes(path) -> int:
    """Bytes of tensor data in a safetensors file (the file minus its 8-byte length and JSON header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


COMPOSITIONS = [
    dict(policy="log", window=4, bits=2, group_size=16),
    dict(policy="log", window=4, key_bits=4, value_bits=2, group_size=16, transform="hadamard"),
    dict(policy="log", window=4, bits=3, group_size=16, key_axis="token", backend="torch"),
    dict(policy="log", window=5, key_bits=3, value_bits=2, group_size=16, backend="cpu"),
    dict(policy="recent", window=6, variant="flush", prompt="keep_tail", bits=4, group_size=16),
    dict(policy="sink", sinks=2, window=6, bits=2, group_size=32),
    dict(policy="h2o", heavy=4, recent=4, bits=2, group_size=16),
    dict(policy="recent", window=8, action="evict"),
    dict(policy="h2o", heavy=3, recent=3, action="evict"),
    dict(policy="log", action="none"),
]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kw=st.sampled_from(COMPOSITIONS),
    prefill=st.integers(1, 40),
    steps=st.integers(0, 20),
    turn=st.integers(1, 6),
)
def test_round_trip_continues_identically(tmp_path_factory, kw, prefill, steps, turn):
    """Any composition, any length (mid-group staging included): the loaded cache holds the same
    positions and, continued with a second turn and decode steps, gives bit-identical logits to the
    original; the file's tensor data is exactly the bytes the cache holds (less a transform's matrix,
    rebuilt from its seed, plus what a score-based policy's state holds)."""
    model = _model()
    ids = _ids(prefill + steps)
    cache = CompressedCache(**kw)
    _fill(model, cache, ids, prefill)
    path = tmp_path_factory.mktemp("persist") / "cache.kvc"
    size = cache.save(path, model=model)
    assert size == path.stat().st_size
    loaded = CompressedCache.load(path, model=model)
    assert repr(loaded) == repr(cache)
    for i in range(len(cache.layers)):
        for key, value in cache.positions(i).items():
            assert torch.equal(loaded.positions(i)[key], value), (i, key)
    report, again = cache.memory_report(), loaded.memory_report()
    assert again.total_bytes == report.total_bytes
    policy_bytes = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        if layer.engine.held.state is not None
        for t in layer.engine.held.state.state_dict().values()
        if isinstance(t, torch.Tensor)
    )
    transform_bytes = sum(layer.segments.get("transform", 0) for layer in report.layers)
    assert _data_bytes(path) == report.total_bytes - transform_bytes + policy_bytes
    more = _ids(turn + 5, seed=prefill)
    expected = _continue(model, copy.deepcopy(cache), more, turn)
    assert torch.equal(_continue(model, loaded, more, turn), expected)


def test_fused_path_round_trip(tmp_path, cpu_kernel):
    """A model on kvpolicy's fused decode path continues from a loaded cache exactly as from the
    original (the loaded cache serves the fused path: packed codes in place)."""
    model = tiny_model("llama")
    enable_fused(model)
    try:
        ids = _ids(70)
        cache = CompressedCache(policy="log", window=6, key_bits=4, value_bits=2, group_size=16, transform="hadamard")
        _fill(model, cache, ids, 50)
        cache.save(tmp_path / "c.kvc")
        loaded = CompressedCache.load(tmp_path / "c.kvc")
        more = _ids(12, seed=9)
        expected = _continue(model, copy.deepcopy(cache), more, 3)
        assert torch.equal(_continue(model, loaded, more, 3), expected)
        assert set(loaded.attention_paths().values()) == {"fused (cpu)"}
    finally:
        disable_fused(model)


def test_backend_auto_and_named_backend_across_devices(tmp_path):
    """backend="auto" is chosen again where the cache is loaded; a named backend is kept."""
    model = _model()
    ids = _ids(40)
    auto = CompressedCache(policy="log", window=4, group_size=16)
    _fill(model, auto, ids, 30)
    auto.save(tmp_path / "auto.kvc")
    loaded = CompressedCache.load(tmp_path / "auto.kvc")
    assert loaded.layers[0].engine.backend.name == auto.layers[0].engine.backend.name
    named = CompressedCache(policy="log", window=4, group_size=16, backend="torch")
    _fill(model, named, ids, 30)
    named.save(tmp_path / "torch.kvc")
    loaded = CompressedCache.load(tmp_path / "torch.kvc")
    assert loaded.backend.name == "torch" and loaded.layers[0].engine.backend.name == "torch"


def test_hybrid_model_layers_come_back_as_transformers_own(tmp_path):
    """config= with sliding layers (Gemma-2): sliding layers are saved and loaded as transformers'
    DynamicSlidingWindowLayer, compressed ones as CompressedLayer; the continuation is identical."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    model = _model("gemma2")
    ids = _ids(40)
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=16, config=model.config)
    _fill(model, cache, ids, 25)
    cache.save(tmp_path / "g.kvc", model=model)
    loaded = CompressedCache.load(tmp_path / "g.kvc", model=model)
    assert [type(a).__name__ for a in loaded.layers] == [type(a).__name__ for a in cache.layers]
    assert isinstance(loaded.layers[0], DynamicSlidingWindowLayer)
    assert loaded.layers[0].cumulative_length == cache.layers[0].cumulative_length
    more = _ids(10, seed=2)
    assert torch.equal(_continue(model, loaded, more, 2), _continue(model, copy.deepcopy(cache), more, 2))


def test_snapkv_plugin_round_trip(tmp_path, request):
    """A plugin policy (SnapKV) saves and loads through the registry, its state by the default
    ``PolicyState.state_dict``."""
    pytest.importorskip("kvpolicy_snapkv")
    import kvpolicy_snapkv.plugin

    from kvpolicy import registry

    registry.register(kvpolicy_snapkv.plugin, name="snapkv-under-test")
    request.addfinalizer(lambda: registry.unregister(kvpolicy_snapkv.plugin))
    model = _model()
    ids = _ids(50)
    cache = CompressedCache(policy="snapkv", capacity=12, window=4, bits=2, group_size=16)
    _fill(model, cache, ids, 40)
    cache.save(tmp_path / "s.kvc")
    loaded = CompressedCache.load(tmp_path / "s.kvc")
    more = _ids(8, seed=4)
    assert torch.equal(_continue(model, loaded, more, 2), _continue(model, copy.deepcopy(cache), more, 2))


def test_positions_shared_between_layers_stay_shared(tmp_path):
    """A shared policy's demoted positions are held once for all layers; the file stores them once and
    the loaded cache shares them again (same bytes counted)."""
    model = tiny_model("llama", layers=3)
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=16)
    _fill(model, cache, _ids(60), 40)
    cache.save(tmp_path / "c.kvc")
    loaded = CompressedCache.load(tmp_path / "c.kvc")
    stored = [layer.engine.held.store.positions for layer in loaded.layers]
    assert len({t.untyped_storage().data_ptr() for t in stored}) == 1
    assert loaded.memory_report().segments["positions"] == cache.memory_report().segments["positions"]


def test_file_within_5_percent_of_bytes_held(tmp_path):
    """The issue's bound on a cache of realistic proportions (a 1k-token prompt): file size (JSON header
    included) within 5 % of memory_report().total_bytes."""
    model = tiny_model("llama", layers=4)
    cache = CompressedCache(policy="log", window=16, bits=2)
    _fill(model, cache, _ids(1024, batch=1), 1000)
    size = cache.save(tmp_path / "c.kvc")
    held = cache.memory_report().total_bytes
    assert abs(size - held) <= 0.05 * held, (size, held)


# ------------------------------------------------------------------------------------------ bad files
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _model()
    cache = CompressedCache(policy="log", window=4, bits=2, group_size=16)
    _fill(model, cache, _ids(40), 30)
    path = tmp_path_factory.mktemp("bad") / "good.kvc"
    cache.save(path, model=model)
    return path


def _rewrite_header(src, dst, edit) -> None:
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    header = json.loads(meta["kvpolicy"])
    edit(header)
    save_file(tensors, str(dst), metadata={"kvpolicy": json.dumps(header)})


def test_truncated_file(saved, tmp_path):
    data = saved.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.kvc"
        bad.write_bytes(data[:cut])
        with pytest.raises(CacheFileError, match="truncated or corrupted"):
            CompressedCache.load(bad)


def test_corrupted_tensor_bytes(saved, tmp_path):
    data = bytearray(saved.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's data
    bad = tmp_path / "flip.kvc"
    bad.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match=r"tensor 't\d+' is corrupted"):
        CompressedCache.load(bad)


def test_corrupted_header(saved, tmp_path):
    """The cache's JSON sits, escaped, in the safetensors header's metadata: a byte that breaks only
    the inner JSON, and one that breaks the safetensors header itself."""
    data = saved.read_bytes()
    key = b'composition\\":'
    i = data.index(key) + len(key) - 1
    inner, outer = bytearray(data), bytearray(data)
    inner[i] = ord(";")  # still a valid string for safetensors, no longer JSON for kvpolicy
    outer[data.index(b'"kvpolicy"')] = ord("{")
    for bad_bytes, message in ((inner, "the cache's JSON header is corrupted"), (outer, "truncated or corrupted")):
        bad = tmp_path / "header.kvc"
        bad.write_bytes(bytes(bad_bytes))
        with pytest.raises(CacheFileError, match=message):
            CompressedCache.load(bad)


def test_wrong_format_version(saved, tmp_path):
    for version in (3, 0, "1", True, None):
        bad = tmp_path / "v.kvc"
        _rewrite_header(saved, bad, lambda h, v=version: h.update(version=v))
        with pytest.raises(CacheFileError, match=r"version .* is not supported; this kvpolicy reads versions 1, 2"):
            CompressedCache.load(bad)


def test_not_a_saved_cache(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(3)}, str(plain))
    with pytest.raises(CacheFileError, match="not a saved kvpolicy cache"):
        CompressedCache.load(plain)
    with pytest.raises(CacheFileError, match="no saved cache at"):
        CompressedCache.load(tmp_path / "missing.kvc")


def test_part_not_installed_lists_registered_names(saved, tmp_path):
    bad = tmp_path / "plugin.kvc"
    _rewrite_header(saved, bad, lambda h: h["composition"]["policy"].update(name="no-such-policy"))
    with pytest.raises(CacheFileError, match=r"policy 'no-such-policy', which is not installed.*registered policies"):
        CompressedCache.load(bad)


def test_inconsistent_header_is_refused(saved, tmp_path):
    """A header whose counts disagree with the tensors (hand-edited) is refused, naming the layer."""
    bad = tmp_path / "length.kvc"
    _rewrite_header(saved, bad, lambda h: h["tree"]["layers"][1].update(length=h["tree"]["layers"][1]["length"] + 3))
    with pytest.raises(CacheFileError, match=r"layer 1: the saved parts disagree"):
        CompressedCache.load(bad)


def test_model_mismatch_names_the_difference(saved):
    other = tiny_model("qwen2")  # 1 kv head, head_dim 64, Qwen2 architecture
    with pytest.raises(
        CacheFileError, match=r"architecture: file 'LlamaForCausalLM', model 'Qwen2ForCausalLM'.*kv_heads"
    ):
        CompressedCache.load(saved, model=other)


def test_continuing_with_another_model_is_refused(saved):
    """Loaded without model=, a cache still refuses keys that do not continue it (kv heads differ)."""
    cache = CompressedCache.load(saved)
    other = tiny_model("qwen2")
    with torch.no_grad(), pytest.raises(ValueError, match=r"kv_heads 2 -> 1"):
        other(_ids(3), cache=cache, use_cache=True)


def test_unsavable_parts_write_nothing(tmp_path):
    """A left-padded batch is refused before any file is written (so is a backend that cannot save its blocks:
    the quanto plugin's tests)."""
    model = _model()
    padded = CompressedCache(policy="log", window=4, bits=2, group_size=16)
    ids = _ids(20)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        model(ids, attention_mask=mask, position_ids=position_ids, cache=padded, use_cache=True)
    with pytest.raises(NotImplementedError, match="left-padded batch"):
        padded.save(tmp_path / "p.kvc")
    assert list(tmp_path.iterdir()) == []


def test_device_per_layer(saved):
    """``device=`` may map each layer index to a device (models split with device_map); a mapping that
    misses a layer is refused naming it."""
    loaded = CompressedCache.load(saved, device={0: "cpu", 1: torch.device("cpu")})
    assert all(layer.keys.device.type == "cpu" for layer in loaded.layers)
    with pytest.raises(CacheFileError, match=r"must name every one of the file's 2 layers; missing \[1\]"):
        CompressedCache.load(saved, device={0: "cpu"})


# -------------------------------------------------------------------------------- dtype names
def test_dtype_names_become_dtypes_only_through_the_allowlist():
    """persist.dtype_of is the one place a dtype name read from a file becomes a dtype: it refuses a name torch
    has but a saved cache never holds, and any non-name, naming the allowed dtypes."""
    import ast
    from pathlib import Path

    from kvpolicy import persist

    assert persist.dtype_of("bfloat16") is torch.bfloat16 and persist.dtype_of("uint8") is torch.uint8
    for bad in ("Tensor", "__class__", "cfloat", "torch.float16", ["float16"], {"a": 1}, None, 16):
        with pytest.raises(CacheFileError, match=r"what=.* is not a dtype a saved cache holds; expected one of \["):
            persist.dtype_of(bad, "what")
    # and nowhere else in the package is a dtype looked up by name on torch
    package = Path(__file__).resolve().parents[1] / "kvpolicy"
    found = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "torch"
            ):  # fmt: skip
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    assert not found, f"getattr(torch, ...) turns a name into a dtype outside persist.dtype_of: {found}"
