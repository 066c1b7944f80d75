"""Python calls into kvpolicy during one layer's fused decode step, counted with ``sys.setprofile``.

Builds a tiny random Llama in code (as the tests do), prefills a prompt of :data:`PROMPT` tokens (long
enough that the keys' per-channel groups are full, so the fused step reads codes, not only staged
tokens) with a ``CompressedCache`` under kvpolicy's fused attention, then decodes. During each decode
step, every Python call made while layer 1's attention module runs (``cache.update``, the attention
function, the merge) is recorded; a call into a kvpolicy module counts, and a *switch* is a call into a
kvpolicy module other than the one of the kvpolicy call before it. Printed for the first decode step
that demotes nothing and the first that demotes (tokens moved into the store), per cache: the calls, the
switches and the modules visited, beside the targets (:data:`TARGETS`).

Usage::

    python scripts/count_calls.py            # the one-liner and kvpolicy-3bit
    python scripts/count_calls.py --verbose  # also the call sequence of each counted step
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import kvpolicy
from kvpolicy import CompressedCache
from kvpolicy.fused import disable_fused, enable_fused
from kvpolicy.tiny import random_model

ROOT = str(Path(kvpolicy.__file__).resolve().parent)
CACHES: dict[str, Callable[[], CompressedCache]] = {
    "one-liner": lambda: CompressedCache(policy="log", action="quantize", bits=2),
    "kvpolicy-3bit": lambda: CompressedCache.from_preset("kvpolicy-3bit"),
}
#: (calls, switches) a step that demotes nothing should stay within (None: no target)
TARGETS = {"one-liner": (30, 12), "kvpolicy-3bit": (45, None)}
PROMPT = 600
STEPS = 40
LAYER = 1


def _module(filename: str) -> str | None:
    """``kvpolicy.x.y`` for a file of the kvpolicy package (None for any other file)."""
    path = filename if filename.startswith(ROOT) else str(Path(filename).resolve())
    if not path.startswith(ROOT + "/"):
        return None
    return ".".join(("kvpolicy", *Path(path).relative_to(ROOT).with_suffix("").parts))


class Counter:
    """Records ``(module, function)`` of every Python call into kvpolicy while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._modules: dict[str, str | None] = {}

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if filename not in self._modules:
            self._modules[filename] = _module(filename)
        module = self._modules[filename]
        if module is not None:
            self.calls.append((module, frame.f_code.co_qualname))

    @property
    def switches(self) -> int:
        return sum(a != b for (a, _), (b, _) in itertools.pairwise(self.calls))


def measure(make: Callable[[], CompressedCache]) -> list[tuple[bool, Counter]]:
    """``(demoted, counter)`` for each decode step of layer :data:`LAYER`."""
    model = random_model("llama", layers=2, seed=0)
    enable_fused(model)
    attn = model.model.layers[LAYER].self_attn
    steps: list[tuple[bool, Counter]] = []
    forward = attn.forward

    def counted(*args, **kwargs):
        counter = Counter()
        sys.setprofile(counter)
        try:
            return forward(*args, **kwargs)
        finally:
            sys.setprofile(None)
            steps.append((False, counter))

    try:
        cache = make()
        ids = torch.randint(3, 96, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            model(ids[:, :PROMPT], cache=cache, use_cache=True)
            model(ids[:, PROMPT : PROMPT + 1], cache=cache, use_cache=True)  # settles the prompt's demotion
            held = cache.positions(LAYER)
            coded = held["compressed"].numel() - held["staged_keys"].numel()
            assert coded >= 128, f"only {coded} tokens held as key codes: the step would read no codes"
            attn.forward = counted
            for t in range(PROMPT + 1, PROMPT + STEPS):
                before = cache.positions(LAYER)["compressed"].numel()
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
                steps[-1] = (cache.positions(LAYER)["compressed"].numel() > before, steps[-1][1])
            paths = sorted({str(p) for p in cache.attention_paths().values()})
    finally:
        attn.forward = forward
        disable_fused(model)
    assert paths and all(p.startswith("fused") for p in paths), paths
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print each counted step's call sequence")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name, make in CACHES.items():
        steps = measure(make)
        for demotes in (False, True):
            found = next((c for d, c in steps if d == demotes), None)
            label = "a step that demotes" if demotes else "a step that does not demote"
            if found is None:
                print(f"{name}: no decode step found for {label}")
                continue
            calls, switches = TARGETS[name]
            target = (
                "" if demotes else f" (target: <= {calls} calls" + (f", <= {switches} switches)" if switches else ")")
            )
            modules = sorted({m for m, _ in found.calls})
            print(f"{name}, {label}: {len(found.calls)} calls, {found.switches} module switches{target}")
            print(f"    modules: {', '.join(modules)}")
            if args.verbose:
                for module, fn in found.calls:
                    print(f"      {module}:{fn}")


if __name__ == "__main__":
    main()
