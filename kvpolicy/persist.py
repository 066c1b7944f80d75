"""The file format of a saved cache: one safetensors file, no pickle, nothing executable.

A cache's state is a tree of JSON values and tensors (:meth:`kvpolicy.CompressedCache.save` builds
it). :func:`write` stores the tensors as safetensors tensors and the rest, with every tensor
replaced by a reference, as a JSON header in the safetensors metadata (key ``"kvpolicy"``):

.. code-block:: text

    {"format": "kvpolicy-cache", "version": 1, ..., "tree": {..., "keys": {"$tensor": "t3", ...}},
     "checksums": {"t3": "<sha256 of t3's bytes>", ...}}

Tensors that share storage (positions a shared policy's layers hold once between them) are stored
once: a group of views is written as the span of storage they cover when that is smaller than their
copies, and each view is rebuilt with ``as_strided``, so a loaded cache shares what the saved one
shared. Every stored tensor carries a sha256, so a corrupted file is refused naming the tensor;
a truncated or malformed one is refused naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvpolicy.errors import CacheFileError

FORMAT = "kvpolicy-cache"
#: the version this code writes and reads; a file of another version is refused
VERSION = 1
_META_KEY = "kvpolicy"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
        torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str, what: str = "dtype") -> torch.dtype:
    """The dtype named ``name`` (one of the dtypes a saved cache may hold)."""
    if name not in _DTYPES:
        raise CacheFileError(f"{what}={name!r} is not a dtype a saved cache holds; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


# ---------------------------------------------------------------------------------------- writing
def write(path: str | Path, header: dict[str, Any], tree: Any) -> int:
    """Write ``header`` (JSON values) and ``tree`` (JSON values and tensors) to ``path`` atomically.

    Returns the file's size in bytes.
    """
    from safetensors.torch import save_file

    tensors: list[torch.Tensor] = []
    skeleton = _strip(tree, tensors)
    stored, refs = _pack(tensors)
    skeleton = _fill(skeleton, refs)
    checksums = {name: _sha256(t) for name, t in stored.items()}
    meta = {**header, "format": FORMAT, "version": VERSION, "tree": skeleton, "checksums": checksums}
    text = json.dumps(meta, separators=(",", ":"), allow_nan=False)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    os.close(fd)
    try:
        save_file({k: v.cpu() for k, v in stored.items()}, tmp, metadata={_META_KEY: text})
        os.replace(tmp, path)  # a reader never sees a half-written file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _strip(node: Any, out: list[torch.Tensor]) -> Any:
    """``node`` with every tensor replaced by ``{"$i": index into out}``."""
    if isinstance(node, torch.Tensor):
        out.append(node.detach())
        return {"$i": len(out) - 1}
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, str) or key.startswith("$"):
                raise TypeError(f"state keys must be strings not starting with '$'; got {key!r}")
        return {k: _strip(v, out) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_strip(v, out) for v in node]
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise TypeError(f"a saved cache's state holds JSON values and tensors only; got a {type(node).__name__}")


def _fill(node: Any, refs: list[dict[str, Any]]) -> Any:
    if isinstance(node, dict):
        if set(node) == {"$i"}:
            return refs[node["$i"]]
        return {k: _fill(v, refs) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, refs) for v in node]
    return node


def _pack(tensors: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Stored tensors by name, and the reference that rebuilds each of ``tensors``.

    Views of one storage are stored as the span they cover when that is smaller than their copies."""
    stored: dict[str, torch.Tensor] = {}
    refs: list[dict[str, Any]] = [{} for _ in tensors]
    groups: dict[tuple[str, int, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            refs[i] = {"$tensor": None, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
            continue
        groups.setdefault((str(t.device), t.untyped_storage().data_ptr(), t.dtype), []).append(i)
    for members in groups.values():
        lo = min(tensors[i].storage_offset() for i in members)
        hi = max(_end(tensors[i]) for i in members)
        unique = {(tensors[i].storage_offset(), tuple(tensors[i].shape), tuple(tensors[i].stride())) for i in members}
        copies = sum(math.prod(shape) for _, shape, _ in unique)
        if len(members) > 1 and hi - lo <= copies:
            name = f"t{len(stored)}"
            first = tensors[members[0]]
            stored[name] = first.as_strided((hi - lo,), (1,), lo).clone()
            for i in members:
                t = tensors[i]
                refs[i] = {
                    "$tensor": name, "offset": t.storage_offset() - lo, "shape": list(t.shape),
                    "stride": list(t.stride()),
                }  # fmt: skip
            continue
        done: dict[tuple, str] = {}
        for i in members:
            t = tensors[i]
            key = (t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key not in done:
                done[key] = f"t{len(stored)}"
                stored[done[key]] = t.contiguous()
            refs[i] = {"$tensor": done[key]}
    return stored, refs


def _end(t: torch.Tensor) -> int:
    """One past the last storage element ``t`` reads."""
    return t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True)) + 1


def _sha256(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------- reading
def read(path: str | Path, device: str | torch.device | None = None) -> tuple[dict[str, Any], Any]:
    """The header and the tree :func:`write` stored, tensors on ``device`` (default: CPU).

    Raises
    ------
    CacheFileError
        The file is missing, truncated, not a saved cache, of another format version, or a tensor's
        bytes do not match its checksum.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CacheFileError(f"no saved cache at {str(path)!r} (not a file)")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            tensors = {name: f.get_tensor(name) for name in names}
    except CacheFileError:
        raise
    except Exception as exc:  # safetensors' own errors: truncated, bad header, bad offsets
        raise CacheFileError(
            f"{str(path)!r} is not a readable saved cache (truncated or corrupted safetensors file): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if _META_KEY not in meta:
        raise CacheFileError(
            f"{str(path)!r} is a safetensors file but not a saved kvpolicy cache (no {_META_KEY!r} metadata)"
        )
    try:
        header = json.loads(meta[_META_KEY])
    except json.JSONDecodeError as exc:
        raise CacheFileError(f"{str(path)!r}: the cache's JSON header is corrupted ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheFileError(f"{str(path)!r}: header format is not {FORMAT!r}")
    if header.get("version") != VERSION:
        raise CacheFileError(
            f"{str(path)!r}: format version {header.get('version')!r} is not supported; this kvpolicy reads "
            f"version {VERSION} (save the cache again with the kvpolicy that will load it)"
        )
    checksums = header.get("checksums")
    if not isinstance(checksums, dict) or set(checksums) != set(tensors):
        raise CacheFileError(f"{str(path)!r}: the tensors in the file do not match the header's list")
    for name, t in tensors.items():
        if _sha256(t) != checksums[name]:
            raise CacheFileError(f"{str(path)!r}: tensor {name!r} is corrupted (its sha256 does not match the header)")
    device = torch.device("cpu" if device is None else device)
    tensors = {name: t.to(device) for name, t in tensors.items()}
    try:
        tree = _rebuild(header.get("tree"), tensors, str(path), device)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CacheFileError(f"{str(path)!r}: malformed tensor reference in the header ({exc})") from None
    return header, tree


def _rebuild(node: Any, tensors: dict[str, torch.Tensor], where: str, device: torch.device) -> Any:
    if isinstance(node, dict):
        if "$tensor" in node:
            return _tensor(node, tensors, where, device)
        return {k: _rebuild(v, tensors, where, device) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, tensors, where, device) for v in node]
    return node


def _tensor(ref: dict[str, Any], tensors: dict[str, torch.Tensor], where: str, device: torch.device) -> torch.Tensor:
    name = ref["$tensor"]
    if name is None:
        return torch.empty(ref["shape"], dtype=dtype_of(ref["dtype"]), device=device)
    if name not in tensors:
        raise CacheFileError(f"{where!r}: the header refers to tensor {name!r}, which the file does not hold")
    base = tensors[name]
    if "offset" not in ref:
        return base
    shape, stride, offset = ref["shape"], ref["stride"], ref["offset"]
    end = offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) + 1 if math.prod(shape) else offset
    if base.dim() != 1 or offset < 0 or end > base.numel():
        raise CacheFileError(f"{where!r}: a view of tensor {name!r} reaches beyond it (corrupted header)")
    return base.as_strided(shape, stride, offset)
