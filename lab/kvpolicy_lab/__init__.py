"""kvpolicy-lab: the evaluation harness beside the kvpolicy library.

- :mod:`kvpolicy_lab.eval`: ablation grids, the runner and its executors (local, Ray, shards and
  merge), tasks, scorers, reports and plots, and the fetchers of the reference models and datasets;
- :mod:`kvpolicy_lab.bench`: decode, memory and backend benchmarks;
- :mod:`kvpolicy_lab.tune`: the preset search behind ``kvpolicy tune``;
- :mod:`kvpolicy_lab.quality`: :func:`compare`, how much a cache distorts a model on your own texts;
- :mod:`kvpolicy_lab.estimation` and :mod:`kvpolicy_lab.capacity`: :func:`estimate`, the bytes a cache will
  hold from the model's config alone, and the longest prompt that fits a memory budget;
- :mod:`kvpolicy_lab.commands`: ``kvpolicy demo``, ``ablate``, ``tune``, ``analyze``, ``bench`` and
  ``estimate``, added to the ``kvpolicy`` command through its plugin hook (:mod:`kvpolicy_lab.plugin`).

``compare`` and ``estimate`` are imported lazily (``from kvpolicy_lab import compare``), so importing the
package imports neither torch nor transformers. The library never imports this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {"compare": "kvpolicy_lab.quality", "estimate": "kvpolicy_lab.estimation"}

__all__ = ["__version__", "compare", "estimate"]

if TYPE_CHECKING:
    from kvpolicy_lab.estimation import estimate
    from kvpolicy_lab.quality import compare


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvpolicy_lab' has no attribute {name!r}")
