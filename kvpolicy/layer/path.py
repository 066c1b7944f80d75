"""Which path one decode step's attention took: a value (kind, reason, backend), not a sentence.

:meth:`kvpolicy.cache.CompressedCache.attention_paths` shows ``str(path)``: ``"fused (cpu)"``,
``"materialized (torch): <reason>"``, ``"full-precision"`` or ``"handed out, not attended"``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: the kinds of path, and what each means
KINDS = {
    "fused": "attention read the compressed segments where they lie (kvpolicy.fused)",
    "materialized": "the history was rebuilt at full precision for attention (the reason says why)",
    "full-precision": "nothing compressed was held: the plain view is the full-precision segment",
    "handed out": "handed to attention, not consumed yet",
}


@dataclass(frozen=True)
class StepPath:
    """How one step's attention read a layer's history.

    Parameters
    ----------
    kind : {"fused", "materialized", "full-precision", "handed out"}
        The path (see :data:`KINDS`).
    reason : str, optional
        Why a step was materialised (``None`` for the other kinds).
    backend : str, optional
        The name of the backend that served a fused or materialised step (shown in ``str``).
    """

    kind: str
    reason: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StepPath: kind must be one of {list(KINDS)}; got kind={self.kind!r}")

    def __str__(self) -> str:
        if self.kind == "handed out":
            return "handed out, not attended"
        head = self.kind if self.backend is None or self.kind == "full-precision" else f"{self.kind} ({self.backend})"
        return head if self.reason is None else f"{head}: {self.reason}"

    def noted(self, note: str, backend: str | None) -> StepPath:
        """This path with ``note`` (a layout that could not be used) appended to a materialised step's
        reason, or a materialised step for that note."""
        if self.kind == "materialized":
            return replace(self, reason=note if self.reason is None else f"{self.reason}; {note}")
        return StepPath("materialized", note, backend)


#: the path of a multi-token update (prefill, a later turn's prompt)
FULL_PRECISION = StepPath("full-precision")
HANDED_OUT = StepPath("handed out")
