"""Python calls into kvpolicy during one layer's fused decode step, counted with ``sys.setprofile``.

Builds a tiny random Llama in code (as the tests do), prefills a prompt with a ``CompressedCache``
under kvpolicy's fused attention, then decodes a few tokens. During each decode step, every Python
call made while layer 1's attention module runs (``cache.update``, the attention function, the
merge) is recorded; a call into a kvpolicy module counts, and a *switch* is a call into a kvpolicy
module other than the one of the kvpolicy call before it. Printed: the counts of the first decode
step that demotes nothing and of the first that demotes (tokens moved into the store), per cache,
with the modules visited, and the same counts split into the layer's and attention's calls and the
stores' own (actions, backends, transforms, kernels: ``parts()``, ``add``).

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
    "one-liner (log, quantize, bits=2)": lambda: CompressedCache(policy="log", action="quantize", bits=2),
    "kvpolicy-3bit (tiered)": lambda: CompressedCache.from_preset("kvpolicy-3bit"),
}
#: modules whose calls are the stores' own work (see :meth:`Counter.split`)
STORE_SIDE = ("kvpolicy.actions", "kvpolicy.backends", "kvpolicy.transforms", "kvpolicy.kernels")
PROMPT = 200
STEPS = 40
LAYER = 1


def _module(filename: str) -> str | None:
    """``kvpolicy.x.y`` for a file of the kvpolicy package (None for any other file)."""
    path = filename if filename.startswith(ROOT) else str(Path(filename).resolve())
    if not path.startswith(ROOT + "/"):
        return None
    rel = Path(path).relative_to(ROOT).with_suffix("")
    return ".".join(("kvpolicy", *rel.parts))


class Counter:
    """Records ``(module, function)`` of every Python call into kvpolicy while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self._modules: dict[str, str | None] = {}

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        module = self._modules.get(filename)
        if filename not in self._modules:
            module = self._modules[filename] = _module(filename)
        if module is not None:
            self.calls.append((module, frame.f_code.co_qualname))

    @property
    def switches(self) -> int:
        mods = [m for m, _ in self.calls]
        return sum(a != b for a, b in itertools.pairwise(mods))

    def split(self) -> tuple[int, int, int]:
        """``(calls outside the stores, calls inside them, switches with a store's calls as one module)``:
        the stores' own work (``parts()``, ``add``: actions, backends, transforms, kernels)
        counted apart from the layer's and attention's."""
        outside = [m if not m.startswith(STORE_SIDE) else "store" for m, _ in self.calls]
        inside = sum(m == "store" for m in outside)
        switches = sum(a != b for a, b in itertools.pairwise(outside))
        return len(outside) - inside, inside, switches


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
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 96, (1, PROMPT + STEPS), generator=g)
        with torch.inference_mode():
            model(ids[:, :PROMPT], cache=cache, use_cache=True)
            model(ids[:, PROMPT : PROMPT + 1], cache=cache, use_cache=True)  # settles the prompt's demotion
            attn.forward = counted
            for t in range(PROMPT + 1, PROMPT + STEPS):
                layer = cache.layers[LAYER]
                before = int(layer.positions()["compressed"].numel())
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
                after = int(layer.positions()["compressed"].numel())
                steps[-1] = (after > before, steps[-1][1])
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
            modules = sorted({m for m, _ in found.calls})
            outside, inside, switches = found.split()
            print(
                f"{name}, {label}: {len(found.calls)} calls into kvpolicy, {found.switches} module switches, "
                f"{len(modules)} modules; outside the stores {outside} calls and {switches} switches (the stores "
                f"as one module), inside them {inside} calls"
            )
            print(f"    modules: {', '.join(modules)}")
            if args.verbose:
                for module, fn in found.calls:
                    print(f"      {module}:{fn}")


if __name__ == "__main__":
    main()
