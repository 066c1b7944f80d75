"""kvpolicy-lab: the evaluation harness beside the kvpolicy library.

- :mod:`kvpolicy_lab.eval`: ablation grids, the runner and its executors (local, Ray, shards and
  merge), tasks, scorers, reports and plots, and the fetchers of the reference models and datasets;
- :mod:`kvpolicy_lab.bench`: decode, memory and backend benchmarks;
- :mod:`kvpolicy_lab.tune`: the preset search behind ``kvpolicy tune``;
- :mod:`kvpolicy_lab.commands`: ``kvpolicy demo``, ``ablate``, ``tune``, ``analyze`` and ``bench``,
  added to the ``kvpolicy`` command through its plugin hook (:mod:`kvpolicy_lab.plugin`).

The library never imports this package.
"""

__version__ = "0.1.0"
