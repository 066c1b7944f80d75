"""Markdown tables for the lab's reports, rendered with ``tabulate``.

The reports' tables are pipe tables without padding (``| a | b |`` over ``|---|---|``): a generated
page then changes only on the lines whose numbers change, never because a wider cell elsewhere
re-pads a whole column. :data:`COMPACT_PIPE` is that layout as a ``tabulate`` table format.
"""

from __future__ import annotations

from collections.abc import Sequence

from tabulate import TableFormat, tabulate

#: the column alignments a table accepts (``tabulate``'s names; right-aligned columns get ``---:``)
ALIGNMENTS = ("left", "right")


def _row(cells: list[str], widths: list[int], aligns: list[str]) -> str:
    return "| " + " | ".join(c.strip() for c in cells) + " |"


def _rule(widths: list[int], aligns: list[str]) -> str:
    return "|" + "".join("---:|" if a == "right" else "---|" for a in aligns)


#: a pipe table with one space inside each bar and no padding to the column's width
COMPACT_PIPE = TableFormat(
    lineabove=None,
    linebelowheader=_rule,
    linebetweenrows=None,
    linebelow=None,
    headerrow=_row,
    datarow=_row,
    padding=0,
    with_header_hide=None,
)


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]], align: Sequence[str] | None = None) -> str:
    """A Markdown pipe table of preformatted cells.

    Parameters
    ----------
    head
        The column headers.
    rows
        The body, one sequence of strings per row, each as long as ``head``; cells are written as given
        (no number parsing).
    align
        ``"left"`` or ``"right"`` per column (default: all left, written ``---``).

    Returns
    -------
    str
        The table, without a trailing newline.

    Raises
    ------
    ValueError
        When a row's length or ``align`` differs from ``head``'s, or an alignment is unknown.
    """
    for i, row in enumerate(rows):
        if len(row) != len(head):
            raise ValueError(f"md_table: row {i} has {len(row)} cells; the header has {len(head)}")
    aligns = list(align) if align is not None else ["left"] * len(head)
    if len(aligns) != len(head):
        raise ValueError(f"md_table: align has {len(aligns)} entries; the header has {len(head)} columns")
    unknown = [a for a in aligns if a not in ALIGNMENTS]
    if unknown:
        raise ValueError(f"md_table: align {unknown[0]!r}; allowed: {', '.join(ALIGNMENTS)}")
    if not rows:  # tabulate draws no columns for an empty body
        return _row(list(head), [], aligns) + "\n" + _rule([], aligns)
    return tabulate([list(r) for r in rows], list(head), tablefmt=COMPACT_PIPE, disable_numparse=True, colalign=aligns)
