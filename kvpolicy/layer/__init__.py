"""One layer's engine in plain torch (no transformers): what ``CompressedLayer`` translates onto.

- :mod:`kvpolicy.layer.engine`: :class:`LayerEngine`, the held tokens (``HeldTokens``), the
  policy loop, the hand-out decision and the path each step took;
- :mod:`kvpolicy.layer.padded`: a left-padded batch as an engine of engines, one per row;
- :mod:`kvpolicy.layer.parts`: the parts a decode step hands fused attention;
- :mod:`kvpolicy.layer.path`: which path a step took, as a value.

The backend and fused-or-why of a layer are decided once, at its first step, by :func:`kvpolicy.spec.plan`.

Nothing is imported here, so :mod:`kvpolicy.handoff` can import :mod:`kvpolicy.layer.path` without a cycle.
"""
