"""Write the repository's generated results pages from ablation run directories.

Each page is written from the run directory of its grid (``kvpolicy ablate --out``):

- ``results``: ``lab/notebook/results.md`` (the lab notebook, outside the documentation site) from a run of
  ``examples/configs/results.toml`` (``runs/results``);
- ``frontier``: ``docs/frontier.md`` from a run of ``examples/configs/frontier.toml``
  (``results/frontier``, whose rows are committed).

Fill the run directory first (finished cells are skipped), then write the page; the page records both
commands in its header::

    kvpolicy ablate --config examples/configs/frontier.toml --out results/frontier --threads 2
    python scripts/write_pages.py frontier --run results/frontier --page docs/frontier.md

Before reading any row the script checks that ``--run`` holds a run (``config.json`` and
``results.jsonl``) and that ``--page`` and its images directory (``img/results`` or ``img/frontier``
beside it) can be written; a problem stops it with one line naming the argument, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpolicy.errors import ConfigError
from kvpolicy_lab.commands._types import check_output, out_file


@dataclass(frozen=True)
class Page:
    """One generated page: its grid, its default run directory and page, and its writer."""

    #: the grid file whose run the page reports
    config: str
    #: the run directory it is written from unless ``--run`` says otherwise
    run: str
    #: the page written unless ``--page`` says otherwise
    page: str
    #: what the sub-command's help says the page is
    help: str
    #: the module of the lab that writes it: its ``write_*_doc(run_dir, doc, command)`` and ``IMAGE_DIR``
    module: str
    writer: str

    def load(self) -> tuple[Callable[[Path, Path, str], Path], str]:
        """The page's writer and its images directory (relative to the page's directory)."""
        module = importlib.import_module(self.module)
        return getattr(module, self.writer), module.IMAGE_DIR


PAGES = {
    "results": Page("examples/configs/results.toml", "runs/results", "lab/notebook/results.md",
                    "the results page: the LogQuant comparisons, passkey, lines, cost, attention spikes",
                    "kvpolicy_lab.eval.docs_report", "write_results_doc"),
    "frontier": Page("examples/configs/frontier.toml", "results/frontier", "docs/frontier.md",
                     "the quality-per-byte page: bits per element against KL, the Pareto frontier, the targets",
                     "kvpolicy_lab.eval.frontier_report", "write_frontier_doc"),
}  # fmt: skip

#: the torch threads of the ablation runs the pages record (the results page's timings are on 2 CPU cores)
THREADS = 2


def run_dir(text: str) -> Path:
    """``--run``: the directory of a ``kvpolicy ablate`` run (it holds ``config.json`` and ``results.jsonl``)."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory; give the --out directory of a kvpolicy "
                                          "ablate run")  # fmt: skip
    missing = [name for name in ("config.json", "results.jsonl") if not (path / name).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"{text!r} has no {' and no '.join(missing)}; give the --out directory of "
                                          "a kvpolicy ablate run (run it first)")  # fmt: skip
    return path


#: the grid of the frontier page's section on the tail of the per-token KL (``--tail``)
TAIL_CONFIG = "examples/configs/frontier-tail.toml"


def tail_run(tail: Path) -> str:
    """The ablation run that fills the tail's run directory ``tail``."""
    return f"kvpolicy ablate --config {TAIL_CONFIG} --out {tail} --threads {THREADS}"


def reproduction(name: str, run: Path, page: Path, tail: Path | None = None) -> str:
    """The commands that regenerate page ``name`` (``results`` or ``frontier``), one per line: the
    ablation run that fills ``run`` (and the tail's run that fills ``tail``, when given) and this script
    writing ``page`` from them."""
    spec = PAGES[name]
    runs = f"kvpolicy ablate --config {spec.config} --out {run} --threads {THREADS}\n"
    if tail is None:
        return runs + f"python scripts/write_pages.py {name} --run {run} --page {page}"
    return runs + f"{tail_run(tail)}\npython scripts/write_pages.py {name} --run {run} --tail {tail} --page {page}"


def build_parser() -> argparse.ArgumentParser:
    """The script's parser: one sub-command per page of :data:`PAGES`."""
    parser = argparse.ArgumentParser(
        prog="write_pages.py",
        description="Write a generated results page from a kvpolicy ablate run directory (fill it first with "
        "kvpolicy ablate; finished cells are skipped). The page records both commands.",
    )
    sub = parser.add_subparsers(dest="page_name", required=True, metavar="{" + ",".join(PAGES) + "}")
    for name, spec in PAGES.items():
        p = sub.add_parser(name, help=spec.help, description=f"Write {spec.page} from a run of {spec.config}.",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
        p.add_argument("--run", type=run_dir, default=spec.run, metavar="DIR",
                       help=f"the run directory (kvpolicy ablate --config {spec.config} --out DIR)")  # fmt: skip
        p.add_argument("--page", type=out_file, default=spec.page, metavar="FILE",
                       help="the page to write; its plots go to an img/ directory beside it")  # fmt: skip
        if name == "frontier":
            p.add_argument("--tail", type=run_dir, default=None, metavar="DIR",
                           help=f"the run directory of the tail's grid (kvpolicy ablate --config {TAIL_CONFIG} "
                           "--out DIR): adds the section on the tail of the per-token KL")  # fmt: skip
        p.set_defaults(parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Check the arguments, then write the page; returns the exit status (argument errors exit 2)."""
    args = build_parser().parse_args(argv)
    write, images = PAGES[args.page_name].load()
    try:
        check_output(f"--page {str(args.page)!r}: its images directory", args.page.parent / images, "directory")
    except ConfigError as exc:
        args.parser.error(str(exc))
    tail = getattr(args, "tail", None)
    extra = {} if tail is None else {"tail": tail, "tail_command": tail_run(tail)}
    page = write(args.run, args.page, reproduction(args.page_name, args.run, args.page, tail), **extra)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
