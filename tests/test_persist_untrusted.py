"""A saved cache is untrusted input: whoever writes a file also writes its checksums.

Each test edits a valid file's header (the tensors, and so their checksums, stay as written) and
asserts that loading refuses it with one :class:`CacheFileError` naming what is wrong, before
anything is allocated from a declared shape, or that what loads continues exactly as the
original. The fuzz test at the end does the same for random edits, in a child process under a
memory limit.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from safetensors import safe_open
from safetensors.torch import save_file
from test_persist import _rewrite_header

from kvpolicy import CompressedCache
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.errors import CacheFileError
from kvpolicy.policies.log import LogWindow

HERE = Path(__file__).parent


def _ids(length: int, batch: int = 2, seed: int = 5) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


def _fill(model: torch.nn.Module, cache: CompressedCache, ids: torch.Tensor, prefill: int) -> None:
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache, use_cache=True)
        for t in range(prefill, ids.shape[1]):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)


def _steps(model: torch.nn.Module, cache: CompressedCache, ids: torch.Tensor) -> torch.Tensor:
    """Decode ``ids`` one token at a time: every step's logits, ``(batch, n, vocab)``."""
    with torch.no_grad():
        return torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])], 1)


#: compositions whose files are edited: each part kind that saves its own state
COMPOSITIONS = {
    "log-minmax": {"policy": "log", "window": 4, "bits": 2, "group_size": 16},
    "log-codebook-rotated": {"policy": "log", "window": 4, "bits": 2, "scheme": "codebook", "transform": "hadamard"},
    "recent-flush": {"policy": "recent", "window": 8, "variant": "flush", "bits": 4, "group_size": 16},
    "sink-evict": {"policy": "sink", "sinks": 2, "window": 8, "action": "evict"},
    "log-sinks": {"policy": "log", "window": 4, "sinks": 2, "bits": 2, "group_size": 16},
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def files(model, tmp_path_factory) -> dict[str, Path]:
    out = {}
    root = tmp_path_factory.mktemp("untrusted")
    kinds = {**COMPOSITIONS, "tiered": {"policy": "log", "window": 4, "action": _tiered()}}
    for name, kwargs in kinds.items():
        cache = CompressedCache(**kwargs)
        _fill(model, cache, _ids(40), 30)
        out[name] = root / f"{name}.kvc"
        cache.save(out[name], model=model)
    return out


def _tiered() -> Tiered:
    per_token = {"group_size": 16, "key_axis": "token"}
    return Tiered(tiers=[Quantize(bits=4, **per_token), Quantize(bits=2, group_size=16)], keep=[LogWindow(4)])


def _edit(src: Path, dst: Path, edit) -> Path:
    """``src`` with ``edit(header)`` applied (the tensors, and their checksums, unchanged)."""
    _rewrite_header(src, dst, edit)
    return dst


def _raw(src: Path, dst: Path, text: str) -> Path:
    """``src`` with the header replaced by ``text`` as it is (not necessarily JSON)."""
    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(tensors, str(dst), metadata={"kvpolicy": text})
    return dst


def _refused(path: Path, match: str, **kwargs) -> None:
    with pytest.raises(CacheFileError, match=match):
        CompressedCache.load(path, **kwargs)


def _layer(h: dict, i: int = 0) -> dict:
    return h["tree"]["layers"][i]


# ---------------------------------------------------------------------------------- allocation
def test_an_empty_reference_with_elements_is_refused_before_allocating(files, tmp_path):
    big = [2, 2, 2**20, 64]  # 1 GiB of float32 if it were allocated
    path = _edit(files["log-minmax"], tmp_path / "empty.kvc", lambda h: _layer(h)["store"]["keys"].update(
        staging={"$tensor": None, "shape": big, "dtype": "float32"}))  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _refused(path, r"empty tensor reference declares shape \[2, 2, 1048576, 64\]")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: nothing was reserved


@pytest.mark.parametrize("stride", [[0, 0, 0, 0], [64, 64, 1, 1], [1, 1, 1, 1]])
def test_views_that_repeat_elements_are_refused(files, tmp_path, stride):
    """A zero or overlapping stride would make one stored element stand for many tokens."""

    def edit(h):
        keys = _layer(h)["keys"]
        name = keys["$tensor"]
        h["tree"]["layers"][0]["store"]["positions"] = {
            "$tensor": name,
            "offset": 0,
            "shape": [2, 2, 2**23, 64],
            "stride": stride,
        }

    _refused(
        _edit(files["log-minmax"], tmp_path / "stride.kvc", edit),
        r"reads some elements more than once|is not one-dimensional",
    )


def test_a_view_beyond_its_tensor_and_too_many_views_are_refused(files, tmp_path):
    def beyond(h):
        ref = _layer(h)["store"]["positions"]
        ref["offset"] = 10**6

    _refused(_edit(files["log-minmax"], tmp_path / "beyond.kvc", beyond), "reaches beyond it")

    def many(h):  # every layer's own tensors replaced by many distinct views of the shared positions
        ref = _layer(h)["store"]["positions"]
        _layer(h)["extra"] = [dict(ref, offset=i, shape=[1, 20]) for i in range(9)]  # 180 elements of 28

    _refused(
        _edit(files["log-minmax"], tmp_path / "many.kvc", many),
        r"views of tensor 't\d+' declare 208 elements, more than its 28 times the file's 2 layer",
    )


def test_a_staging_buffer_must_fit_the_counts(files, tmp_path):
    """Key staging holds fewer tokens than a group; here it names the layer's whole full-precision keys."""
    path = _edit(files["log-minmax"], tmp_path / "staging.kvc", lambda h: _layer(h)["store"]["keys"].update(
        staging=dict(_layer(h)["store"]["values"]["q"]["codes"])))  # fmt: skip
    _refused(path, r"layer 0: the keys stream: staging")
    # a staging buffer of the right size but the wrong dtype, on the value stream (which stages nothing)
    path = _edit(files["log-minmax"], tmp_path / "vstage.kvc", lambda h: _layer(h)["store"]["values"].update(
        staging=dict(_layer(h)["store"]["keys"]["staging"])))  # fmt: skip
    _refused(path, r"the values stream: staging holds .* token-grouped stream stages fewer than 1")


# ---------------------------------------------------------------------------------- policy state
@pytest.mark.parametrize("window", [0, 1000, 5])
def test_the_policy_state_never_overrides_the_policy(files, tmp_path, window):
    """The window comes from the policy (``LogWindow(4)``), never from the file: 0 made decode loop forever."""
    path = _edit(files["log-minmax"], tmp_path / "window.kvc", lambda h: _layer(h)["state"].update(window=window))
    _refused(path, rf"LogWindowState.window: the saved state says {window}, but the policy's parameters give 4")


@pytest.mark.parametrize(
    ("name", "edit", "match"),
    [
        ("full too long", lambda s: s.update(_full=list(range(40))), r"40 full-precision positions at length 40"),
        ("not ascending", lambda s: s.update(_full=s["_full"][::-1]), "not ascending"),
        ("a float length", lambda s: s.update(length=40.0), "cannot restore a float where it holds a int"),
        ("a list length", lambda s: s.update(length=[40]), "cannot restore a list"),
        ("unknown", lambda s: s.update(extra=1), r"no attribute\(s\) \['extra'\]"),
    ],
)
def test_a_log_state_that_its_appends_could_not_reach_is_refused(files, tmp_path, name, edit, match):
    path = _edit(files["log-minmax"], tmp_path / "state.kvc", lambda h: edit(_layer(h)["state"]))
    _refused(path, match)


def test_other_policy_states_are_checked_too(files, tmp_path):
    flush = _edit(files["recent-flush"], tmp_path / "flush.kvc", lambda h: _layer(h)["state"].update(_lo=-3))
    _refused(flush, r"FlushWindowState._lo=-3 is not in \[0, length=40\]")
    prompt = _edit(files["recent-flush"], tmp_path / "prompt.kvc", lambda h: _layer(h)["state"].update(prompt="keep"))
    _refused(prompt, r"FlushWindowState.prompt: the saved state says 'keep'")
    sinks = _edit(files["log-sinks"], tmp_path / "sinks.kvc", lambda h: _layer(h)["state"].update(sinks=5))
    _refused(sinks, "saved with sinks=5 cannot load into sinks=2")
    inner = _edit(files["log-sinks"], tmp_path / "inner.kvc", lambda h: _layer(h)["state"].update({"inner.window": 0}))
    _refused(inner, "LogWindowState.window: the saved state says 0")
    keep = _edit(files["tiered"], tmp_path / "keep.kvc", lambda h: _layer(h)["store"]["keep"][0].update(window=1))
    _refused(keep, "LogWindowState.window: the saved state says 1")


# ---------------------------------------------------------------------------------- positions
def test_store_positions_must_be_unique_in_range_and_disjoint_from_full_ones(files, tmp_path):
    """A duplicated position left a slot of the ordered view unwritten (uninitialised memory read as history)."""
    with safe_open(str(files["log-minmax"]), framework="pt") as f:
        header = json.loads(f.metadata()["kvpolicy"])
        name = header["tree"]["layers"][0]["store"]["positions"]["$tensor"]
        stored = f.get_tensor(name)
    one = lambda p: torch.tensor([p], dtype=torch.int32)  # noqa: E731
    for label, values, match in (
        ("duplicate", torch.cat([stored[:1], stored[:-1]]), "a position is held twice"),
        ("negative", torch.cat([one(-1), stored[1:]]), r"positions reach -1, outside \[0, 40\)"),
        ("beyond", torch.cat([stored[:-1], one(40)]), r"positions reach 40, outside \[0, 40\)"),
        ("a full one", torch.cat([stored[:-1], one(39)]), "a position is held twice"),
    ):
        path = tmp_path / f"{label}.kvc"
        with safe_open(str(files["log-minmax"]), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        extra = f"t{len(tensors)}"
        tensors[extra] = values.contiguous()
        from kvpolicy.persist import _sha256

        edited = json.loads(json.dumps(header))
        edited["checksums"][extra] = _sha256(tensors[extra])
        for layer in edited["tree"]["layers"]:
            layer["store"]["positions"] = {
                "$tensor": extra,
                "offset": 0,
                "shape": [1, values.numel()],
                "stride": [values.numel(), 1],
            }
        save_file(tensors, str(path), metadata={"kvpolicy": json.dumps(edited)})
        _refused(path, match)


def test_counts_and_pending_must_agree(files, tmp_path):
    for label, edit, match in (
        ("length", lambda layer: layer.update(length=43), "the saved parts disagree"),
        ("pending", lambda layer: layer.update(pending=1), "the saved parts disagree: policy length"),
        ("pending range", lambda layer: layer.update(pending=10**6), r"pending=1000000 is out of range"),
        ("scored", lambda layer: layer.update(scored="yes"), "scored: expected true or false"),
        (
            "full_pos",
            lambda layer: layer.update(full_pos=dict(layer["keys"])),
            "full-precision positions: dtype float32",
        ),
    ):
        _refused(
            _edit(files["log-minmax"], tmp_path / f"{label}.kvc", lambda h, e=edit: e(_layer(h, 1))),
            rf"layer 1: .*{match}",
        )


# ---------------------------------------------------------------------------------- blocks and dtypes
def test_blocks_must_be_of_the_cache_dtype_and_layout(files, tmp_path):
    for label, edit, match in (
        ("float64", lambda q: q.update(dtype="float64"), r"a block's dtype='float64' is not one of"),
        ("float16", lambda q: q.update(dtype="float16"), "block of shape .* and dtype torch.float16 in a layer of"),
        ("bits", lambda q: q.update(bits=4), r"block tensors have shapes|a PackedTensor of 4 bits"),
        ("ragged", lambda q: q.update(shape=[2, 2, 17, 64]), "does not split into groups of 16"),
        ("tokens", lambda q: q.update(shape=[2, 2, 32, 64]), "block tensors have shapes"),
        ("name", lambda q: q.update(dtype="Tensor"), r"a block's dtype='Tensor' is not one of"),
        ("a string tensor", lambda q: q.update(codes="t3"), "block codes: expected a tensor; got str"),
        ("extra key", lambda q: q.update(spare=1), r"unexpected \['spare'\]"),
    ):
        path = _edit(
            files["log-minmax"], tmp_path / f"{label}.kvc", lambda h, e=edit: e(_layer(h)["store"]["keys"]["q"])
        )
        _refused(path, match)
    codebook = files["log-codebook-rotated"]
    _refused(
        _edit(codebook, tmp_path / "cb.kvc", lambda h: _layer(h)["store"]["inner"]["keys"]["q"].update(bits=9)),
        r"codebook block bits=9",
    )
    _refused(
        _edit(codebook, tmp_path / "dims.kvc", lambda h: _layer(h)["store"].update(dims=[64, 32])),
        r"head dims \(64, 32\) recorded",
    )


def test_a_layer_of_another_dtype_than_the_file_records_is_refused(files, tmp_path):
    path = _edit(files["log-minmax"], tmp_path / "dtype.kvc", lambda h: h["model"].update(dtype="bfloat16"))
    _refused(path, "keys of dtype float32 in a cache of bfloat16")


@pytest.mark.parametrize("dtype", ["evil", 3, "float128"])
def test_a_model_dtype_outside_the_allowlist_is_refused_naming_the_file(files, tmp_path, dtype):
    path = _edit(files["log-minmax"], tmp_path / "odd.kvc", lambda h: h["model"].update(dtype=dtype))
    _refused(path, r"odd\.kvc' cannot be loaded: model: dtype=.* is not a dtype a saved cache holds")


# ---------------------------------------------------------------------------------- malformed JSON
def test_malformed_headers_are_cache_file_errors(files, tmp_path):
    src = files["log-minmax"]
    with safe_open(str(src), framework="pt") as f:
        text = f.metadata()["kvpolicy"]
    deep = text[:-1] + ',"x":' + "[" * 200_000 + "]" * 200_000 + "}"
    _refused(_raw(src, tmp_path / "deep.kvc", deep), "nests deeper than")
    huge = text.replace('"length":40', '"length":1e400', 1)
    assert huge != text
    _refused(_raw(src, tmp_path / "huge.kvc", huge), "overflows a float")
    nan = text.replace('"length":40', '"length":NaN', 1)
    _refused(_raw(src, tmp_path / "nan.kvc", nan), "NaN is not a number a saved cache holds")
    _refused(_raw(src, tmp_path / "array.kvc", "[1, 2]"), "is a list, not an object")
    for _label, edit, match in (
        ("tensor as string", lambda h: _layer(h).update(keys="t0"), "keys: expected a tensor; got str"),
        ("state as list", lambda h: _layer(h).update(state=[1, 2]), "a saved state is a mapping; got a list"),
        ("store as list", lambda h: _layer(h).update(store=[]), "store: expected a mapping"),
        ("layers as dict", lambda h: h["tree"].update(layers={}), "layers is a dict, not a list"),
        ("policy as list", lambda h: h["composition"].update(policy=[]), "the policy: expected a mapping"),
        ("layout", lambda h: h["composition"].update(layout=7), "layout=7 is not one of"),
        ("unknown header key", lambda h: h.update(surprise=1), r"header: unexpected \['surprise'\]"),
        ("layer count", lambda h: h["model"].update(layers=3), "3 layers recorded, 2 saved"),
        ("a param", lambda h: h["composition"]["policy"]["params"].update(window=4.0), "window must be an integer"),
        (
            "a nested part",
            lambda h: h["composition"]["policy"]["params"].update(window={"part": 1}),
            "expected a mapping",
        ),
        (
            "layer types",
            lambda h: h.update(layer_types=["full_attention"], layer_kwargs=[{}]),
            "not a list of 2 layer type",
        ),
    ):
        _refused(_edit(src, tmp_path / "edit.kvc", edit), match)


def test_bad_devices_are_cache_file_errors(files):
    _refused(files["log-minmax"], r"onto device='banana'", device="banana")
    if not torch.cuda.is_available():
        _refused(files["log-minmax"], r"onto device='cuda'", device="cuda")
    _refused(files["log-minmax"], r"onto device='banana'", device={0: "cpu", 1: "banana"})


# ---------------------------------------------------------------------------------- layers
def test_a_loaded_cache_refuses_a_layer_it_was_not_saved_with(files):
    """A file of a 2-layer model on a 3-layer one (no ``model=``): the third layer would start empty."""
    three = tiny_model("llama", layers=3)
    cache = CompressedCache.load(files["log-minmax"])
    with pytest.raises(CacheFileError, match="loaded from a file of 2 layers, and the model updates layer 2"):
        _steps(three, cache, _ids(1, seed=9))


def test_valid_files_still_continue_exactly(files, model, tmp_path):
    """Every composition above loads (the checks accept what save writes) and continues bit for bit."""
    for name, kwargs in {**COMPOSITIONS, "tiered": {"policy": "log", "window": 4, "action": _tiered()}}.items():
        cache = CompressedCache(**kwargs)
        _fill(model, cache, _ids(40), 30)
        path = tmp_path / f"{name}.kvc"
        cache.save(path, model=model)
        loaded = CompressedCache.load(path, model=model)
        nxt = _ids(6, seed=11)
        assert torch.equal(_steps(model, cache, nxt), _steps(model, loaded, nxt)), name


# ---------------------------------------------------------------------------------- fuzzing
def test_header_fuzzing_in_a_child_process_under_a_memory_limit(files, tmp_path):
    """Random edits of valid headers (values, types, shapes, nesting; checksums still valid) and of
    entropy-coded files' payloads: each is refused with a CacheFileError or loads and continues
    exactly as the original, each within 20 s, in a process whose address space is capped (see
    tests/persist_fuzz_worker.py)."""
    out = tmp_path / "fuzz.json"
    # the worker imports the kvpolicy of this checkout, not whichever one is installed
    path = os.pathsep.join([str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "KVPOLICY_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": path}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(HERE / "persist_fuzz_worker.py"), "--out", str(out), "--examples", "200"],
        capture_output=True, text=True, timeout=900, env=env, cwd=HERE,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [], report["failures"][:5]
    assert report["examples"] >= 200
    # the edits reach both outcomes: files refused and edits that load and continue exactly
    assert report["refused"] > 0 and report["continued"] > 0, report
    assert time.perf_counter() - start < 900
