"""A decode step of a compressing cache compiles: ``torch._dynamo.explain`` finds no graph break in a step after a
prompt long enough that key groups are full (the fused step reads codes), the compiled steps (demotions included)
give the eager logits, ``generate(compile_config=...)`` compiles where ``is_compileable`` says so and gives the eager
tokens, and the C++ kernel is one custom operator the compiler traces around."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters
from transformers import CompileConfig

from kvpolicy import CompressedCache
from kvpolicy.actions.tiered import TieredStore
from kvpolicy.fused import enable_fused
from kvpolicy.tiny import random_model

pytestmark = pytest.mark.usefixtures("one_thread")

#: tokens of the prompt: past one 128-token key group of codes in every layer
PROMPT = 600
BUILD = {
    "one-liner": lambda model, backend: CompressedCache.for_model(model, backend=backend),
    "kvpolicy-3bit": lambda model, backend: CompressedCache.for_model(model, "kvpolicy-3bit", backend=backend),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _model() -> torch.nn.Module:
    model = random_model("llama", layers=2, seed=0)
    enable_fused(model)
    return model


def _ids(n: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(0))


def _prefilled(model: torch.nn.Module, cache: CompressedCache, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
        model(ids[:, PROMPT : PROMPT + 1], cache=cache, use_cache=True)  # settles the prompt's demotion


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", list(BUILD))
def test_a_decode_step_has_no_graph_break(name: str, backend: str) -> None:
    model = _model()
    cache = BUILD[name](model, backend)
    ids = _ids(PROMPT + 2)
    _prefilled(model, cache, ids)
    held = cache.positions(1)
    assert held["compressed"].numel() - held["staged_keys"].numel() >= 128, "the step would read no codes"
    before = cache.get_seq_length()
    with torch.no_grad():
        explained = dynamo.explain(lambda x: model(x, cache=cache, use_cache=True).logits)(ids[:, PROMPT + 1 :])
    assert [b.reason for b in explained.break_reasons] == []
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert cache.get_seq_length() == before + 1
    assert set(cache.attention_paths().values()) == {f"fused ({backend})"}


def test_action_none_compiles_fullgraph() -> None:
    model = _model()
    cache = CompressedCache.for_model(model, action="none")
    ids = _ids(40)
    with torch.no_grad():
        model(ids[:, :32], cache=cache, use_cache=True)
        step = torch.compile(lambda x: model(x, cache=cache, use_cache=True).logits, fullgraph=True, backend="eager")
        compiled = [step(ids[:, t : t + 1]) for t in range(32, 36)]
    reference = CompressedCache.for_model(model, action="none")
    with torch.no_grad():
        model(ids[:, :32], cache=reference, use_cache=True)
        eager = [model(ids[:, t : t + 1], cache=reference, use_cache=True).logits for t in range(32, 36)]
    for a, b in zip(compiled, eager, strict=True):  # the traced forward builds its causal mask another way
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(BUILD))
def test_compiled_steps_give_the_eager_logits(name: str) -> None:
    """Decode steps through groups filling and tiers moving: the compiled logits equal the eager ones."""
    model = _model()
    steps = 70
    ids = _ids(PROMPT + steps)
    logits = {}
    for mode in ("eager", "compiled"):
        cache = BUILD[name](model, "cpu")
        call = lambda x, cache=cache: model(x, cache=cache, use_cache=True).logits  # noqa: E731
        step = torch.compile(call, backend="aot_eager") if mode == "compiled" else call
        with torch.no_grad():
            model(ids[:, :PROMPT], cache=cache, use_cache=True)
            logits[mode] = torch.cat([step(ids[:, t : t + 1]) for t in range(PROMPT, PROMPT + steps)], dim=1)
        assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(BUILD))
@dynamo.config.patch(recompile_limit=256)  # a step recompiled per length would show, not stop at the limit
def test_decode_steps_reuse_their_graphs(name: str) -> None:
    """A step is compiled once per layout, not once per length: after the first demotions of each kind, 120
    more steps (which thin the log window, fill key groups and move tiers) compile no new graph, so a long
    decode runs compiled rather than recompiling until dynamo gives up and runs it eagerly."""
    model = _model()
    cache = BUILD[name](model, "cpu")
    steps, settled = 160, 40
    ids = _ids(PROMPT + steps)
    call = torch.compile(lambda x: model(x, cache=cache, use_cache=True).logits, backend="aot_eager", dynamic=True)
    graphs, compressed = [], []
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
        counters.clear()
        for t in range(PROMPT, PROMPT + steps):
            call(ids[:, t : t + 1])
            graphs.append(counters["stats"]["unique_graphs"])
            compressed.append(cache.positions(1)["compressed"].numel())
    assert compressed[-1] // 128 > compressed[settled] // 128, "no key group fills in the steps measured"
    assert graphs[-1] == graphs[settled], graphs
    assert set(cache.attention_paths().values()) == {"fused (cpu)"}


def _counting(runs: list[int]) -> object:
    """A compiler backend that adds one to ``runs[-1]`` whenever one of its graphs runs."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: object) -> object:
            runs[-1] += 1
            return gm.forward(*args)

        return run

    return backend


#: what shows that each kind of demotion happened in the measured steps, besides the log window thinning: a key
#: group fills (the one-liner stages keys) or a tier moves tokens down (kvpolicy-3bit's codebook codes stage nothing)
MOVES = {"one-liner": "a key group fills", "kvpolicy-3bit": "a tier moves"}


def _held(cache: CompressedCache) -> tuple[int, int, int]:
    """Layer 1's demoted tokens, keys staged for a key group, and tokens in the last tier of a tiered store."""
    positions = cache.positions(1)
    store = cache.layers[1].engine.held.store
    bottom = len(store.bottom) if isinstance(store, TieredStore) else 0
    return positions["compressed"].numel(), positions["staged_keys"].numel(), bottom


@pytest.mark.parametrize("name", list(BUILD))
@dynamo.config.patch(recompile_limit=256)
def test_a_step_that_demotes_nothing_runs_one_graph_after_demotions(name: str) -> None:
    """Compiled steps through demotions of every kind (the prompt's, the log window thinning, key groups filling,
    tiers moving): each step that demotes nothing runs one graph, and so does each step that demotes (its demotion
    runs eagerly in the forward's pre-hook, ahead of the model's frames, which stay whole). ``torch._dynamo.explain``
    cannot show this: it traces the step afresh, while a compiled step runs what dynamo kept from the steps before
    it, here counted by a backend that counts the graphs each step runs."""
    model = _model()
    cache = BUILD[name](model, "cpu")
    steps = 160
    ids = _ids(PROMPT + steps)
    runs: list[int] = []
    counting = _counting(runs)

    call = torch.compile(lambda x: model(x, cache=cache, use_cache=True).logits, backend=counting, dynamic=True)
    held = []
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)  # its demotion waits for the first compiled step
        for t in range(PROMPT, PROMPT + steps):
            runs.append(0)
            call(ids[:, t : t + 1])
            held.append(_held(cache))
    pairs = list(itertools.pairwise(held))
    assert held[-1][0] - held[0][0] >= 128, "the log window thins too little"
    if MOVES[name] == "a key group fills":
        assert any(b[1] < a[1] for a, b in pairs), "no key group fills in the steps measured"
    else:
        assert any(b[2] > a[2] for a, b in pairs), "no tier moves in the steps measured"
    demoting = [n for (a, b), n in zip(pairs, runs[1:], strict=True) if a != b]
    quiet = [n for (a, b), n in zip(pairs, runs[1:], strict=True) if a == b]
    assert len(quiet) > steps // 2 and len(demoting) >= 3
    assert set(quiet) == {1} and set(demoting) == {1}, runs


@dynamo.config.patch(recompile_limit=256)
def test_a_compiled_forward_called_without_the_hooks_keeps_its_layers_in_one_graph() -> None:
    """``torch.compile(model.forward)`` called directly skips the module's forward hooks: the step's demotions then
    run when the model asks the cache for its mask sizes, before its layers. A step that demotes splits the frames
    above that call, so later steps run in a few pieces (the embedding, the layers, the head), the same few for a
    model of any depth, never a piece per layer."""
    layers = 6
    model = random_model("llama", layers=layers, seed=0)
    enable_fused(model)
    cache = BUILD["kvpolicy-3bit"](model, "cpu")
    steps = 30
    ids = _ids(PROMPT + steps)
    runs: list[int] = []
    counting = _counting(runs)

    compiled = torch.compile(model.forward, backend=counting, dynamic=True)
    held = []
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
        model(ids[:, PROMPT : PROMPT + 1], cache=cache, use_cache=True)
        for t in range(PROMPT + 1, PROMPT + steps):
            runs.append(0)
            compiled(ids[:, t : t + 1], cache=cache, use_cache=True)
            held.append(_held(cache))
    first = next(i for i, (a, b) in enumerate(itertools.pairwise(held), start=1) if a != b)
    after = runs[first + 1 :]
    assert len(after) >= 20 and any(a != b for a, b in itertools.pairwise(held[first:])), "too few demotions"
    assert len(set(after)) == 1 and after[0] < layers, runs


@dynamo.config.patch(recompile_limit=64)
def test_the_model_compiled_whole_by_inductor_gives_the_eager_logits() -> None:
    """``torch.compile(model)`` with inductor's generated code (the module's forward hooks traced with it, the
    demotions announced in the pre-hook), through steps that thin the log window and move tiers: the logits are
    the eager ones within float noise. (Inductor once miscompiled a step that compared the announced length with
    the layer's: a symbol the generated code never bound.)"""
    model = _model()
    steps = 14
    ids = _ids(PROMPT + steps)
    logits = {}
    for mode in ("eager", "compiled"):
        cache = BUILD["kvpolicy-3bit"](model, "cpu")
        compiled = torch.compile(model, dynamic=True) if mode == "compiled" else model
        with torch.no_grad():
            model(ids[:, :PROMPT], cache=cache, use_cache=True)
            before = cache.positions(1)["compressed"].numel()
            out = [
                compiled(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(PROMPT, PROMPT + steps)
            ]
        assert cache.positions(1)["compressed"].numel() - before >= 4, "too few demotions in the steps"
        logits[mode] = torch.cat(out, dim=1)
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "compileable"),
    [
        ({}, True),
        ({"preset": "kvpolicy-3bit"}, True),
        ({"action": "none"}, True),
        ({"policy": "h2o", "action": "quantize"}, False),
    ],
)
def test_compiles_says_which_caches_trace(kwargs: dict, compileable: bool) -> None:
    cache = CompressedCache.for_model(_model(), **kwargs)
    assert cache.compiles is compileable
    # transformers' flag of static caches stays False: it would change how generate builds masks in eager runs
    assert cache.is_compileable is False


def test_a_scored_step_is_run_eagerly_by_the_compiler() -> None:
    """A policy that reads attention scores cannot be traced (``compiles`` is False): the compiler runs its
    step eagerly, and the logits are the eager ones (the scores reached the policy)."""
    model = _model()
    ids = _ids(80)
    logits = {}
    for mode in ("eager", "compiled"):
        cache = CompressedCache.for_model(model, policy="h2o", action="quantize", group_size=16)
        call = lambda x, cache=cache: model(x, cache=cache, use_cache=True).logits  # noqa: E731
        step = torch.compile(call, backend="eager") if mode == "compiled" else call
        with torch.no_grad():
            model(ids[:, :70], cache=cache, use_cache=True)
            logits[mode] = torch.cat([step(ids[:, t : t + 1]) for t in range(70, 80)], dim=1)
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", [None])
def test_generate_with_a_compiled_forward_gives_the_eager_tokens(preset: str | None) -> None:
    from torch._dynamo.utils import counters

    ids = _ids(300)
    out = {}
    for mode in ("eager", "compiled"):
        model = _model()
        model.eval()
        if mode == "compiled":
            model.forward = torch.compile(model.forward, backend="aot_eager")
        cache = CompressedCache.for_model(model, preset)
        counters.clear()
        out[mode] = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=12, do_sample=False
        )
        assert (counters["stats"]["unique_graphs"] > 0) == (mode == "compiled")
        assert set(cache.attention_paths().values()) == {"fused (cpu)"}
    assert torch.equal(out["compiled"], out["eager"])


def test_generate_compile_config_is_skipped_as_for_dynamic_cache() -> None:
    """``is_compileable`` is False: ``generate(compile_config=...)`` runs eagerly (transformers warns), as
    it does for ``DynamicCache``."""
    from torch._dynamo.utils import counters

    model = _model()
    model.eval()
    config = CompileConfig(backend="aot_eager", mode="default")
    config._compile_all_devices = True
    counters.clear()
    ids = _ids(40)
    model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=CompressedCache.for_model(model), max_new_tokens=3,
        do_sample=False, compile_config=config,
    )  # fmt: skip
    assert counters["stats"]["unique_graphs"] == 0


def test_the_cpu_kernel_is_one_custom_operator() -> None:
    """The backend's attend compiles with fullgraph (the kernel is ``kvpolicy::cpu_attend`` with a fake
    implementation) and gives the eager result bit for bit."""
    from kvpolicy.backends.cpu_backend import CpuBackend

    assert hasattr(torch.ops.kvpolicy, "cpu_attend")
    backend = CpuBackend()
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 256, 64), torch.randn(1, 2, 256, 48)
    query = torch.randn(1, 2, 3, 64)
    for qk, qv in [
        (backend.quantize(keys, 2, 128, "channel"), backend.quantize(values, 2, 16, "token")),
        (backend.quantize(keys, 3, None, "token", scheme="codebook"), backend.quantize(values, 4, 16, "token")),
    ]:
        eager = backend.attend(query, qk, qv, 0.125)
        traced = torch.compile(
            lambda q, qk=qk, qv=qv: backend.attend(q, qk, qv, 0.125), fullgraph=True, backend="aot_eager"
        )
        for a, b in zip(traced(query), eager, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=0, atol=0)
