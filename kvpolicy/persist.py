"""The file format of a saved cache: one safetensors file, no pickle, nothing executable.

A cache's state is a tree of JSON values and tensors (:meth:`kvpolicy.CompressedCache.save` builds
it). :func:`write` stores the tensors as safetensors tensors and the rest, with every tensor
replaced by a reference, as a JSON header in the safetensors metadata (key ``"kvpolicy"``):

.. code-block:: text

    {"format": "kvpolicy-cache", "version": 1, ..., "tree": {..., "keys": {"$tensor": "t3", ...}},
     "checksums": {"t3": "<sha256 of t3's bytes>", ...}}

Saved with a codec (``cache.save(path, codec=name)``: a :class:`Codec` a plugin registers through the
``kvpolicy_register_codecs`` hook), a stored tensor that codes smaller is stored as its coded payload,
listed under ``"coding"`` with the dtype and shape it decodes to and the codec's own parameters, and the
header names the codec (``"codec"``); such a file is version 2. Its checksum is the decoded tensor's: what
is loaded is what is checked. Loading it needs the codec's plugin; without it the error says so.

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
from typing import Any, ClassVar

import torch

from kvpolicy.errors import CacheFileError, ConfigError
from kvpolicy.state_check import dtype_name, dtype_of

FORMAT = "kvpolicy-cache"
#: the version of a file whose tensors are stored as they are held (this code reads it and writes it
#: without a codec, so older readers load it)
VERSION = 1
#: the version of a file with coded tensors (:class:`Codec`; older readers refuse it)
CODED_VERSION = 2
#: the versions this code reads; a file of another version is refused
VERSIONS = (VERSION, CODED_VERSION)
_META_KEY = "kvpolicy"


class Codec:
    """How a saved file stores its tensors coded: registered by name through the ``kvpolicy_register_codecs``
    hook, chosen by ``cache.save(path, codec=name)`` and named in the file, so that loading finds it again.

    A codec is lossless: :meth:`decode` of :meth:`encode`'s payload gives the tensor back bit for bit.
    :meth:`decode` reads untrusted bytes: it must check a payload against the declared dtype and shape
    before it allocates, and raise :class:`~kvpolicy.errors.CacheFileError` on anything malformed.
    """

    #: the name files record (``"codec"``) and ``save(codec=...)`` takes
    name: ClassVar[str] = ""
    #: the file versions written by this codec before files named their codec (read without a name)
    unnamed_versions: ClassVar[tuple[int, ...]] = ()

    def require(self) -> None:
        """Raise :class:`ImportError`, naming what to install, when the codec's dependencies are missing."""

    def encode(self, t: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor] | None:
        """``(params, payload)``: JSON parameters :meth:`decode` needs and a ``uint8`` payload, or ``None``
        when coding would not make ``t`` smaller (it is then stored as it is)."""
        raise NotImplementedError

    def decode(
        self, payload: torch.Tensor, dtype: torch.dtype, shape: list[int], params: dict[str, Any], what: str
    ) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` that ``payload`` codes (``what`` names it in errors)."""
        raise NotImplementedError


def codec_named(name: Any) -> Codec:
    """An instance of the codec registered as ``name``.

    Raises
    ------
    ConfigError
        When none is (the message lists those registered and says that codecs come from plugins).
    """
    from kvpolicy import registry

    if not isinstance(name, str) or name not in registry.names("codecs"):
        raise ConfigError(
            f"codec must be the name of a registered codec, one of {registry.names('codecs')}; got codec={name!r} "
            f"(codecs come from plugins: {registry.moved('codecs')})"
        )
    return registry.get("codecs", name)()


# ---------------------------------------------------------------------------------------- writing
def write(path: str | Path, header: dict[str, Any], tree: Any, codec: str | None = None) -> int:
    """Write ``header`` (JSON values) and ``tree`` (JSON values and tensors) to ``path`` atomically,
    each stored tensor coded by the registered :class:`Codec` named ``codec`` where that makes it smaller.

    Returns the file's size in bytes.

    Raises
    ------
    ConfigError
        ``codec`` names no registered codec.
    ImportError
        The codec's dependencies are missing (the message says what to install).
    """
    from safetensors.torch import save_file

    coder = codec_named(codec) if codec is not None else None
    if coder is not None:
        coder.require()
    tensors: list[torch.Tensor] = []
    skeleton = _strip(tree, tensors)
    stored, refs = _pack(tensors)
    skeleton = _fill(skeleton, refs)
    checksums = {name: _sha256(t) for name, t in stored.items()}
    coding: dict[str, dict[str, Any]] = {}
    for name, t in list(stored.items()) if coder is not None else []:
        coded = coder.encode(t)  # type: ignore[union-attr]
        if coded is not None:
            coding[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), **coded[0]}
            stored[name] = coded[1]
    version = {"version": CODED_VERSION, "codec": codec, "coding": coding} if coding else {"version": VERSION}
    meta = {**header, "format": FORMAT, **version, "tree": skeleton, "checksums": checksums}
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
#: the deepest nesting of JSON containers a header may hold (a saved cache needs about a dozen)
MAX_DEPTH = 64
#: the most dimensions a stored tensor reference may declare
MAX_DIMS = 8


def read(path: str | Path, device: str | torch.device | None = None) -> tuple[dict[str, Any], Any]:
    """The header and the tree :func:`write` stored, tensors on ``device`` (default: CPU).

    The header is untrusted: before any tensor is built it is checked to be JSON of bounded depth
    without NaN or infinite numbers, and every tensor reference to name a stored tensor, to declare
    a shape of non-negative sizes (an empty reference: no elements), and, for a view, strides that
    neither repeat an element nor reach beyond the stored tensor. The distinct views of one stored
    tensor declare at most as many bytes as it holds times the number of layers in the file (only
    positions that several layers hold once are stored so). Nothing is allocated from a declared shape;
    a coded tensor is decoded by its codec (:meth:`Codec.decode`, which checks the payload before it
    allocates), and its checksum is checked on the decoded bytes.

    Raises
    ------
    CacheFileError
        The file is missing, truncated, not a saved cache, of another format version, its header is
        malformed, a coded payload is corrupted, a tensor's (decoded) bytes do not match its checksum,
        or the file is coded by a codec no installed plugin registers (the message says what to install).
    """
    from safetensors import safe_open

    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise CacheFileError(f"no saved cache at {where!r} (not a file)")
    try:
        with safe_open(where, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            tensors = {name: f.get_tensor(name) for name in names}
    except CacheFileError:
        raise
    except Exception as exc:  # safetensors' own errors: truncated, bad header, bad offsets
        raise CacheFileError(
            f"{where!r} is not a readable saved cache (truncated or corrupted safetensors file): "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if _META_KEY not in meta:
        raise CacheFileError(
            f"{where!r} is a safetensors file but not a saved kvpolicy cache (no {_META_KEY!r} metadata)"
        )
    header = _parse(meta[_META_KEY], where)
    if header.get("format") != FORMAT:
        raise CacheFileError(f"{where!r}: header format is not {FORMAT!r}")
    if header.get("version") not in VERSIONS or isinstance(header.get("version"), bool):
        raise CacheFileError(
            f"{where!r}: format version {header.get('version')!r:.40} is not supported; this kvpolicy reads "
            f"versions {', '.join(map(str, VERSIONS))} (save the cache again with the kvpolicy that will load it)"
        )
    checksums = header.get("checksums")
    if not isinstance(checksums, dict) or set(checksums) != set(tensors):
        raise CacheFileError(f"{where!r}: the tensors in the file do not match the header's list")
    tensors = _decoded(header, tensors, where)
    for name, t in tensors.items():
        if _sha256(t) != checksums[name]:
            raise CacheFileError(f"{where!r}: tensor {name!r} is corrupted (its sha256 does not match the header)")
    tree = header.get("tree")
    layers = tree.get("layers") if isinstance(tree, dict) else None
    _check_references(tree, tensors, where, max(1, len(layers) if isinstance(layers, list) else 1))
    device = torch.device("cpu" if device is None else device)
    tensors = {name: t.to(device) for name, t in tensors.items()}
    return header, _rebuild(tree, tensors, device)


def _decoded(header: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """``tensors`` with the coded ones decoded: every coding entry is checked (a stored tensor, an allowed
    dtype, a shape of at most :data:`MAX_DIMS` sizes) before any is decoded, and each payload by its codec
    (:meth:`Codec.decode`) before it allocates."""
    coded = header["version"] == CODED_VERSION
    coding = header.get("coding")
    if not coded:
        if "coding" in header or "codec" in header:
            raise CacheFileError(f"{where!r}: a version {VERSION} file lists coded tensors")
        return tensors
    if not isinstance(coding, dict) or not coding or not set(coding) <= set(tensors):
        raise CacheFileError(f"{where!r}: its 'coding' entry is not a mapping of stored tensors to their coding")
    plans = []
    for name, entry in coding.items():
        if not isinstance(entry, dict) or not {"dtype", "shape"} <= set(entry):
            raise CacheFileError(f"{where!r}: the coding of tensor {name!r} is not a mapping of dtype, shape, ...")
        dtype = dtype_of(entry["dtype"], f"the coded dtype of tensor {name!r}")
        params = {k: v for k, v in entry.items() if k not in ("dtype", "shape")}
        plans.append((name, dtype, _ints(entry["shape"], "shape", where, 0), params))
    coder = _file_codec(header, where)
    try:
        coder.require()
    except ImportError as exc:
        raise CacheFileError(f"{where!r} holds coded tensors ({coder.name!r}); loading it needs: {exc}") from None
    out = dict(tensors)
    for name, dtype, shape, params in plans:
        out[name] = coder.decode(tensors[name], dtype, shape, params, f"{where!r}: tensor {name!r}")
    return out


def _file_codec(header: dict[str, Any], where: str) -> Codec:
    """The codec a coded file names (or, for a file of a version that named none, the codec that wrote those).

    Raises
    ------
    CacheFileError
        When no installed plugin registers it: the message says which plugin to install.
    """
    from kvpolicy import registry

    name = header.get("codec")
    if name is None:
        name = next((n for n, cls, _ in registry.entries("codecs") if header["version"] in cls.unnamed_versions), None)
        wanted = f"the codec of version {header['version']} files"
    else:
        wanted = f"codec {name!r}"
    if not isinstance(name, str) or name not in registry.names("codecs"):
        raise CacheFileError(
            f"{where!r} holds tensors coded by {wanted:.80}, which no installed plugin registers (registered "
            f"codecs: {registry.names('codecs')}); {registry.moved('codecs')}"
        )
    return registry.get("codecs", name)()


def _parse(text: str, where: str) -> dict[str, Any]:
    """The JSON header, refused unless it is an object of bounded depth with finite numbers only."""

    def no_constant(name: str) -> float:
        raise ValueError(f"{name} is not a number a saved cache holds")

    def finite_float(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"{literal[:40]} overflows a float")
        return value

    try:
        header = json.loads(text, parse_constant=no_constant, parse_float=finite_float)
    except RecursionError:
        raise CacheFileError(f"{where!r}: the cache's JSON header nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # json's own errors, and the refusals above
        raise CacheFileError(f"{where!r}: the cache's JSON header is corrupted ({exc})") from None
    if not isinstance(header, dict):
        raise CacheFileError(f"{where!r}: the cache's JSON header is a {type(header).__name__}, not an object")
    stack = [(header, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CacheFileError(f"{where!r}: the cache's JSON header nests deeper than {MAX_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return header


def _references(node: Any) -> list[dict[str, Any]]:
    """Every tensor reference (a mapping with a ``"$tensor"`` key) in ``node``."""
    out, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "$tensor" in item:
                out.append(item)
            else:
                stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


def _ints(value: Any, what: str, where: str, lo: int) -> list[int]:
    bad = not isinstance(value, list) or len(value) > MAX_DIMS
    bad = bad or any(isinstance(v, bool) or not isinstance(v, int) or v < lo for v in value)
    if bad:
        raise CacheFileError(
            f"{where!r}: a tensor reference's {what} {value!r:.80} is not a list of at most {MAX_DIMS} integers >= {lo}"
        )
    return value


def _check_references(tree: Any, tensors: dict[str, torch.Tensor], where: str, shares: int) -> None:
    """Refuse a tensor reference that could build anything but a view of stored bytes (see :func:`read`)."""
    declared: dict[str, set[tuple]] = {}
    for ref in _references(tree):
        name = ref["$tensor"]
        if name is None:  # an empty tensor, rebuilt from its shape and dtype
            if set(ref) != {"$tensor", "shape", "dtype"}:
                raise CacheFileError(f"{where!r}: an empty tensor reference has keys {sorted(ref)}")
            shape = _ints(ref["shape"], "shape", where, 0)
            if math.prod(shape):
                raise CacheFileError(
                    f"{where!r}: an empty tensor reference declares shape {shape} ({math.prod(shape)} elements)"
                )
            if not isinstance(ref["dtype"], str):
                raise CacheFileError(f"{where!r}: an empty tensor reference's dtype is not a name")
            dtype_of(ref["dtype"], "an empty tensor's dtype")
            continue
        if not isinstance(name, str) or name not in tensors:
            raise CacheFileError(f"{where!r}: the header refers to tensor {name!r:.40}, which the file does not hold")
        if set(ref) == {"$tensor"}:
            declared.setdefault(name, set()).add(("whole",))
            continue
        if set(ref) != {"$tensor", "offset", "shape", "stride"}:
            raise CacheFileError(f"{where!r}: a reference to tensor {name!r} has keys {sorted(ref)}")
        shape = _ints(ref["shape"], "shape", where, 0)
        stride = _ints(ref["stride"], "stride", where, 0)
        offset = ref["offset"]
        base = tensors[name]
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or len(stride) != len(shape):
            raise CacheFileError(f"{where!r}: a view of tensor {name!r} has offset {offset!r:.40} and strides {stride}")
        if base.dim() != 1:
            raise CacheFileError(f"{where!r}: a view of tensor {name!r}, which is not one-dimensional")
        if math.prod(shape):
            _check_strides(shape, stride, name, where)
            end = offset + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) + 1
            if end > base.numel():
                raise CacheFileError(f"{where!r}: a view of tensor {name!r} reaches beyond it (corrupted header)")
        declared.setdefault(name, set()).add((offset, tuple(shape), tuple(stride)))
    for name, views in declared.items():
        base = tensors[name]
        total = sum(base.numel() if view == ("whole",) else math.prod(view[1]) for view in views)
        if total > base.numel() * shares:
            raise CacheFileError(
                f"{where!r}: the views of tensor {name!r} declare {total} elements, more than its {base.numel()} "
                f"times the file's {shares} layer(s)"
            )


def _check_strides(shape: list[int], stride: list[int], name: str, where: str) -> None:
    """Refuse strides under which two indices of a view read the same element (a zero stride, or overlap)."""
    extent = 1  # elements spanned by the dimensions of smaller stride
    for size, st in sorted(((s, st) for s, st in zip(shape, stride, strict=True) if s > 1), key=lambda p: p[1]):
        if st < extent:
            raise CacheFileError(
                f"{where!r}: a view of tensor {name!r} with shape {shape} and strides {stride} reads some elements "
                "more than once (a zero or overlapping stride)"
            )
        extent = st * (size - 1) + extent


def _rebuild(node: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    if isinstance(node, dict):
        if "$tensor" in node:
            return _tensor(node, tensors, device)
        return {k: _rebuild(v, tensors, device) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, tensors, device) for v in node]
    return node


def _tensor(ref: dict[str, Any], tensors: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensor a reference :func:`_check_references` accepted names."""
    name = ref["$tensor"]
    if name is None:
        return torch.empty(ref["shape"], dtype=dtype_of(ref["dtype"]), device=device)
    base = tensors[name]
    if "offset" not in ref:
        return base
    return base.as_strided(ref["shape"], ref["stride"], ref["offset"])
