"""Shared fixtures: tiny randomly initialised models built in code, and teacher-forced decoding."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from kvpolicy.prefill import teacher_forced_logits
from kvpolicy.tiny import random_model, tiny_gemma3  # noqa: F401  (tests import tiny_gemma3 from here)

# No third-party plugin loads by entry point in the tests (each test that needs one registers it), except
# the lab's subcommands when kvpolicy-lab is installed (its tests drive the kvpolicy command), and the research
# plugin's parts when it is installed (the lab's tuning spaces, grids and analyses name them).
_LOADED = [ep for module, eps in (("kvpolicy_lab", ["kvpolicy_lab"]),
                                  ("kvpolicy_research", ["research-transforms", "research-formats"]))
           if importlib.util.find_spec(module) is not None for ep in eps]  # fmt: skip
if _LOADED:
    os.environ.setdefault("KVPOLICY_PLUGINS", ",".join(_LOADED))
else:
    os.environ.setdefault("KVPOLICY_DISABLE_PLUGIN_AUTOLOAD", "1")

# Hypothesis profiles. Tests that set their own ``max_examples`` keep it; the profile sizes the rest,
# above all the stateful fuzzing of tests/test_fuzz_stateful.py (one run per combination):
# "ci" (default) a few short runs, well under a minute for that file on 2 cores. Deterministic: the
# examples are derived from each test (``derandomize``) and no example database is read or written, so
# every run of the suite, here or on a fresh clone, draws the same examples and gives the same outcome.
# "deep" many long ones with fresh random examples each run, saved to the local .hypothesis database,
# for exploration: ``pytest --hypothesis-profile=deep`` (or HYPOTHESIS_PROFILE=deep). A failure it
# finds goes on the test as an explicit ``@example``, which every profile then runs.
# No deadline: model steps vary with the load of the machine.
settings.register_profile(
    "ci", max_examples=3, stateful_step_count=10, deadline=None, derandomize=True, database=None, print_blob=True
)
settings.register_profile("deep", max_examples=200, stateful_step_count=50, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _worker_threads() -> int | None:
    """Torch threads for one pytest-xdist worker: its share of the cores this process may run on (at
    least 1); None outside xdist or with a single worker (torch's default then).

    Each worker is a process with torch's default thread pool, one thread per core: ``-n auto`` workers
    would run cores x cores threads, and the tiny models' many small operations spend their time
    waiting for each other's threads (a test file ran 2x its CPU time and, next to other load on the
    machine, 100x its wall time so)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


WORKER_THREADS = _worker_threads()
if WORKER_THREADS is not None:
    torch.set_num_threads(WORKER_THREADS)
    # and the Python processes the tests start (torch reads it when it starts)
    os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))

FAMILIES = ("llama", "qwen2", "phi3", "mistral")
ATTN = ("sdpa", "eager")


def tiny_model(family: str, attn: str = "sdpa", layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM of ``family`` with head_dim 64 (so default group sizes fit).

    Random init gives near-uniform attention; :func:`kvpolicy.tiny.random_model` sharpens it so
    compression errors are visible.
    """
    return random_model(family, layers=layers, seed=seed, attn=attn)


def tiny_qwen3_next_config():
    """A hybrid config in miniature: Qwen3-Next with a linear-attention layer, then a full-attention one
    (1 kv head of head_dim 32)."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, layer_types=["linear_attention", "full_attention"], num_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=2,
        linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
    )  # fmt: skip
    return cfg


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (restored after): tiny models run faster so, above all on a
    shared machine. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def two_threads():
    """Torch on two threads for a module (restored after), whatever the xdist worker's share of the
    cores: code that splits its work over torch's thread pool (the ``cpu`` backend's kernel) runs it
    on several threads. Use with ``pytestmark = pytest.mark.usefixtures("two_threads")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def models():
    """Cache of tiny models by (family, attn)."""
    built: dict[tuple[str, str], torch.nn.Module] = {}

    def get(family: str, attn: str = "sdpa") -> torch.nn.Module:
        if (family, attn) not in built:
            built[(family, attn)] = tiny_model(family, attn)
        return built[(family, attn)]

    return get


@pytest.fixture(scope="session")
def cpu_kernel():
    """Build (first run in an environment: ~45 s, needs a C++ compiler and ninja) and load the ``cpu``
    backend's C++ attention kernel once per session, so its cost shows up in one fixture's setup."""
    from kvpolicy.kernels import cpu_attention

    return cpu_attention.load()


@pytest.fixture
def stored_blocks(monkeypatch) -> list[list[tuple]]:
    """Every block ``TorchBackend.quantize`` stores, run by run: the test appends an empty list before
    each run, and each call then adds ``(x, group_size, axis, out)`` to the last list (``x`` the input
    ``(B, H, n, D)``, ``group_size`` and ``axis`` the stream's format's, ``out`` the stored block)."""
    from kvpolicy.backends.torch_backend import TorchBackend

    runs: list[list[tuple]] = []
    original = TorchBackend.quantize

    def record(self, x, fmt, *args, **kwargs):
        out = original(self, x, fmt, *args, **kwargs)
        runs[-1].append((x.detach().clone(), fmt.group_size, fmt.axis, out))
        return out

    monkeypatch.setattr(TorchBackend, "quantize", record)
    return runs


def fused_and_materialized(family: str = "llama", length: int = 75, **kw):
    """Teacher-forced logits of a tiny GQA model of ``family`` through the fused and the materialised
    path, across group flushes with staging non-empty (group 16, window 8, 75 tokens, batch 2): ``(fused,
    materialised, the fused run's cache)``. ``kw`` are further ``CompressedCache`` keywords, or override
    those defaults (``None`` drops one: ``group_size=None`` for a composition without groups)."""
    from kvpolicy import CompressedCache
    from kvpolicy.fused import disable_fused, enable_fused

    model = tiny_model(family)
    ids = torch.randint(3, 96, (2, length), generator=torch.Generator().manual_seed(1))
    kw = {k: v for k, v in {"policy": "log", "window": 8, "group_size": 16, **kw}.items() if v is not None}
    ref = teacher_forced_logits(model, ids, 38, CompressedCache(**kw, attention="materialized"))
    enable_fused(model)
    try:
        cache = CompressedCache(**kw)
        got = teacher_forced_logits(model, ids, 38, cache)
    finally:
        disable_fused(model)
    return got, ref, cache


def saved_cache_continues(tmp_path, **kw):
    """A cache built from ``CompressedCache`` keywords ``kw``, filled with 30 tokens of a tiny llama, saved and
    loaded: asserts the loaded one equals it and continues with the very logits of a copy of it; returns
    ``(cache, loaded)``."""
    import copy

    from kvpolicy import CompressedCache

    model = tiny_model("llama")
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(**kw)
    with torch.no_grad():
        model(ids[:, :30], cache=cache, use_cache=True)
    path = tmp_path / "c.kvc"
    cache.save(path, model=model)
    loaded = CompressedCache.load(path, model=model)
    assert loaded.action == cache.action and repr(loaded) == repr(cache)
    want = teacher_forced_logits(model, ids[:, 30:], 1, copy.deepcopy(cache))
    assert torch.equal(teacher_forced_logits(model, ids[:, 30:], 1, loaded), want)
    return cache, loaded


def core_lines_matching(pattern: re.Pattern[str]) -> list[str]:
    """``path:line: text`` of every line of the core package's modules that ``pattern`` finds: what a test that
    no core module names a plugin's part reports."""
    root = Path(__file__).resolve().parent.parent
    return [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted((root / "kvpolicy").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
