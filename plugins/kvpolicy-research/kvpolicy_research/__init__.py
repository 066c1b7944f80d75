"""kvpolicy's research parts, registered through kvpolicy's entry points (nothing imports this by hand).

Transforms (:mod:`kvpolicy_research.transforms_plugin`): ``"lowrank"`` (:class:`~kvpolicy_research.lowrank.LowRank`)
and ``"query-hadamard"`` (:class:`~kvpolicy_research.query_weighted.QueryWeighted`). Formats and file codecs
(:mod:`kvpolicy_research.formats_plugin`): the ``"lattice"`` format and the ``"entropy"`` codec for saved caches.
"""
