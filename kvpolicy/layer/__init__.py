"""One layer's engine in plain torch (no transformers): what ``CompressedLayer`` translates onto.

- :mod:`kvpolicy.layer.composition`: :class:`Composition`, the cache's parts, built once and read by every
  layer; :class:`Plan`, one layer's backend, served action and fused-or-why, decided once at its first step
  (:func:`plan`); :func:`choose_backend`, what ``backend="auto"`` stands for;
- :mod:`kvpolicy.layer.engine`: :class:`LayerEngine`, the policy loop, the hand-out decision, the path each
  step took and the version;
- :mod:`kvpolicy.layer.held`: :class:`HeldTokens`, the tokens the engine holds, by segment, and the moves
  between segments;
- :mod:`kvpolicy.layer.padded`: :class:`PaddedEngine`, the engine's batch form for a left-padded batch, one
  single-row engine per row;
- :mod:`kvpolicy.layer.padding`: which columns of a step are pads;
- :mod:`kvpolicy.layer.parts`: the parts a decode step hands fused attention;
- :mod:`kvpolicy.layer.path`: which path a step took, as a value.

No module here imports the spec, the cache or the presets. Nothing is imported here, so
:mod:`kvpolicy.handoff` can import :mod:`kvpolicy.layer.path` without a cycle.
"""
