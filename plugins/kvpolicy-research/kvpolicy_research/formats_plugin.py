"""The research formats and file codecs, registered through kvpolicy's entry points (``research-formats``).

- ``"lattice"``: :class:`~kvpolicy_research.lattice.Lattice` (D4 lattice indices, four channels each, with a
  per-vector scale), served by the ``torch`` backend and the ``cpu`` kernel;
- ``"entropy"``: :class:`~kvpolicy_research.entropy.EntropyCodec`, lossless entropy coding of saved files
  (``cache.save(path, codec="entropy")``).

The classes are named by module, so kvpolicy imports them at their first lookup only.
"""

from __future__ import annotations

from kvpolicy.hookspecs import hookimpl


@hookimpl
def kvpolicy_register_formats() -> dict[str, object]:
    return {"lattice": "kvpolicy_research.lattice:Lattice"}


@hookimpl
def kvpolicy_register_codecs() -> dict[str, object]:
    return {"entropy": "kvpolicy_research.entropy:EntropyCodec"}
