"""Code blocks of Markdown pages, and the checks tests/test_doc_snippets.py runs on them.

The rules themselves are written down in that test module's docstring; this module implements them:
:func:`page_blocks` reads a page's fenced blocks, :func:`check_bash` parses the command lines of a
``bash`` block, :func:`run_python` executes a ``python`` block in a page's namespace, and
:func:`tiny_tokenizer` / :func:`tiny_model` build the offline stand-ins a page may use.
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
REQUIREMENTS = ("cuda", "torchrun")
#: shell operators that end one simple command and start the next
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
#: placeholder model names: ``"your/model"``, ``"your-org/your-model"``, ``"<your model>"``
PLACEHOLDER = re.compile(r"^(<[^<>]+>|your[-_]?[\w.-]*/[\w./-]+)$")

_FILE = re.compile(r"^\s*<!--\s*file:\s*(?P<name>[\w.-]+)\s*-->\s*$")
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
        ``"python"`` or ``"bash"`` (the fence's language, normalised by :data:`LANGUAGES`), or
        ``"other"`` for a file block of another language.
    line : int
        1-based line number of the opening fence.
    source : str
        The block's text, its fence's indentation removed; line ``i`` of it is page line ``line + 1 + i``.
    file : str, optional
        The file name of a *file block*: one whose fence follows a ``<!-- file: NAME -->`` line. Its
        text is that file's contents, written out rather than run.
    """

    page: str
    lang: str
    line: int
    source: str
    file: str | None = None

    def __post_init__(self) -> None:
        allowed = {*LANGUAGES.values(), *(("other",) if self.file else ())}
        if self.lang not in allowed:
            raise ValueError(f"Block: lang must be one of {sorted(allowed)}; got lang={self.lang!r}")
        if self.file is not None and (Path(self.file).name != self.file or self.file.startswith(".")):
            raise ValueError(f"Block: file must be a plain file name; got file={self.file!r}")
        if self.line < 1:
            raise ValueError(f"Block: line must be >= 1; got line={self.line!r}")

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
    """The ``python`` and ``bash`` blocks and the file blocks of the Markdown page ``path``, in page order.

    Other fences (``text``, ``toml``, none) are read past, unless a ``<!-- file: NAME -->`` line
    right above the fence makes them a file block.

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
        if lang is not None or marker is not None:
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
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


def run_python(block: Block, namespace: dict[str, Any]) -> str | None:
    """Execute ``block`` in ``namespace``; ``None`` on success, else ``"page:line: Error: message"``."""
    try:
        code = compile_block(block)
    except SyntaxError as exc:
        return f"{block.page}:{exc.lineno}: SyntaxError in the block at line {block.line}: {exc.msg}"
    try:
        exec(code, namespace)
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == block.page]
        line = frames[-1].lineno if frames else block.line
        source_line = block.source.split("\n")[line - block.line - 1].strip() if frames else ""
        message = str(exc).strip().split("\n")[0][:500]
        return (f"{block.page}:{line}: {type(exc).__name__}: {message}\n"
                f"    in the block at line {block.line}: {source_line}")  # fmt: skip
    return None


# --- the tiny model a page runs on ----------------------------------------------------------------


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
