"""Text pictures of which positions a policy keeps at full precision (used by the docs)."""

from __future__ import annotations

from kvpolicy.policies.base import Policy


def render(policy: Policy, lengths: list[int], full: str = "#", compressed: str = ".") -> str:
    """One row per length ``T``: ``full`` where position ``t < T`` is at full precision, else
    ``compressed``.

    Parameters
    ----------
    policy : Policy
        A data-independent policy (the same selection for every layer, head and row).
    lengths : list of int
        Increasing values of ``T`` to draw.
    """
    state = policy.new_state()
    width = len(str(max(lengths)))
    rows = []
    for length in sorted(lengths):
        state.append(length - state.length)
        kept = set(state.full_positions())
        cells = "".join(full if t in kept else compressed for t in range(length))
        rows.append(f"T={length:<{width}} {cells}")
    return "\n".join(rows)
