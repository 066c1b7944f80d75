"""Attention statistics measured over calibration texts, written to a file beside a preset file.

:func:`measure` runs a model over texts and gathers, per layer and KV head, what
:class:`~kvpolicy_research.calibrated.CalibratedRotation` fits its rotations on: the queries' second moment
``E[q qᵀ]`` (over every query row of the KV head's query heads), the keys' covariance, and the values'
second moment weighted by the attention each value receives (the softmax probabilities, summed over the
queries and query heads that read it). Queries and keys are taken as attention sees them (after the
position embedding), through an attention function registered with transformers for the pass only.

:func:`save` writes them as a safetensors file whose metadata names the model (its ``model_type``, its
``name_or_path``) and the shapes; :func:`load` reads one back for a model only after checking, from the
file's header and before any tensor is read, that it is a statistics file of this kind for that model, with
the shapes the model's layers have: a file from another model or with the wrong shapes is refused with a
``ValueError`` naming the file and the difference. :meth:`Statistics.rotations` turns them into the
per-layer key and value bases of a :class:`CalibratedRotation`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpolicy.transforms.base import BindContext
from kvpolicy_research.calibrated import CalibratedRotation

#: the ``format`` entry of a statistics file's metadata
FORMAT = "kvpolicy-research.attention-statistics"
#: the format version this module writes and reads
VERSION = 1
#: the tensors a statistics file holds: name -> (layers, kv_heads, d, d) with d the key or the value head dim
TENSORS = {"query_moment": "key", "key_covariance": "key", "value_moment": "value"}
#: the largest header a statistics file may have (its metadata is a few hundred bytes)
MAX_HEADER = 1 << 20
#: the largest dims a statistics file may declare (checked before a tensor is allocated)
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 4096, 1024, 4096


@dataclass(frozen=True)
class Statistics:
    """Attention statistics of one model, per layer and KV head.

    Attributes
    ----------
    query_moment : torch.Tensor
        ``(layers, kv_heads, head_dim, head_dim)`` float32: ``E[q qᵀ]``.
    key_covariance : torch.Tensor
        ``(layers, kv_heads, head_dim, head_dim)`` float32: the keys' covariance.
    value_moment : torch.Tensor
        ``(layers, kv_heads, v_head_dim, v_head_dim)`` float32: ``Σ_t a_t v_t v_tᵀ / Σ_t a_t``, ``a_t`` the
        attention value ``t`` received.
    model : dict
        ``model_type``, ``name_or_path``, ``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` and
        ``v_head_dim`` of the model measured.
    tokens : int
        Tokens measured.
    """

    query_moment: torch.Tensor
    key_covariance: torch.Tensor
    value_moment: torch.Tensor
    model: dict[str, Any]
    tokens: int

    def rotations(self, transform: CalibratedRotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(key bases, key weights, value bases)`` of ``transform`` for every layer: ``(layers, kv_heads, d,
        d)`` float16, ``(layers, kv_heads, 1, d)`` float32 and ``(layers, kv_heads, dv, dv)`` float16."""
        u, w = transform.key_rotation(self.query_moment, self.key_covariance)
        return u, w, transform.value_rotation(self.value_moment)


def model_identity(config: Any) -> dict[str, Any]:
    """What a statistics file records of a model's ``config`` (a transformers ``PretrainedConfig``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {
        "model_type": str(text.model_type),
        "name_or_path": str(getattr(config, "_name_or_path", "") or getattr(config, "name_or_path", "")),
        "num_hidden_layers": int(text.num_hidden_layers),
        "num_key_value_heads": int(getattr(text, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "v_head_dim": int(getattr(text, "v_head_dim", None) or head_dim),
    }


class _Gather:
    """Sums over the texts, per layer (float64), fed by the attention function of :func:`measure`."""

    def __init__(self, layers: int) -> None:
        self.sums: list[dict[str, torch.Tensor] | None] = [None] * layers

    def add(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        allowed: torch.Tensor,
    ) -> None:
        b, hq, n, d = query.shape
        hk = key.shape[1]
        group = hq // hk
        q = query.detach().double().reshape(b, hk, group * n, d)
        k, v = key.detach().double(), value.detach().double()
        scores = (query.detach().double() @ k.repeat_interleave(group, dim=1).mT) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # (b, hq, n, n_k)
        received = probs.reshape(b, hk, group, n, -1).sum(dim=(2, 3))  # (b, hk, n_k)
        new = {
            "qq": (q.mT @ q).sum(0), "q_rows": torch.tensor(float(b * group * n), dtype=torch.float64),
            "kk": (k.mT @ k).sum(0), "k": k.sum(dim=(0, 2)), "k_rows": torch.tensor(float(b * k.shape[2])),
            "vv": (v.mT @ (received.unsqueeze(-1) * v)).sum(0), "a": received.sum(dim=(0, 2)),
        }  # fmt: skip
        held = self.sums[layer]
        self.sums[layer] = new if held is None else {name: held[name] + t for name, t in new.items()}

    def statistics(self, identity: dict[str, Any]) -> Statistics:
        if any(s is None for s in self.sums):
            missing = [i for i, s in enumerate(self.sums) if s is None]
            raise RuntimeError(
                f"no attention reached layers {missing[:8]}: the model's attention is not one measure() wraps"
            )
        qm, kc, vm = [], [], []
        for s in self.sums:
            assert s is not None
            qm.append(s["qq"] / s["q_rows"])
            mean = s["k"] / s["k_rows"]
            kc.append(s["kk"] / s["k_rows"] - mean.unsqueeze(-1) * mean.unsqueeze(-2))
            vm.append(s["vv"] / s["a"].clamp_min(1e-300)[:, None, None])
        tokens = int(self.sums[0]["k_rows"])  # type: ignore[index]
        return Statistics(*(torch.stack(t).float().contiguous() for t in (qm, kc, vm)), identity, tokens)  # type: ignore[call-arg]


@torch.no_grad()
def measure(model: Any, texts: Iterable[torch.Tensor]) -> Statistics:
    """Run ``model`` over ``texts`` (token ids ``(batch, n)`` each, no padding) and gather its statistics.

    The model's attention is swapped for the pass (and restored after, also on error) for a function that
    records each layer's queries, keys and values and returns what eager attention returns.
    """
    from transformers import AttentionInterface

    identity = model_identity(model.config)
    gather = _Gather(identity["num_hidden_layers"])

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        n, m = query.shape[2], key.shape[2]
        if isinstance(attention_mask, torch.Tensor):  # the model's own mask (sliding windows included)
            mask = attention_mask[..., :m]
            allowed = mask if mask.dtype == torch.bool else mask == 0
        else:
            allowed = torch.ones(n, m, dtype=torch.bool, device=query.device).tril(m - n)
        gather.add(module.layer_idx, query, key, value, scale, allowed)
        group = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scale)
        return out.transpose(1, 2).contiguous(), None

    name = "kvpolicy_research_measure"
    AttentionInterface.register(name, attend)
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        for ids in texts:
            model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    return gather.statistics(identity)


def save(stats: Statistics, path: str | Path) -> Path:
    """Write ``stats`` to ``path`` (safetensors, the model's identity and the shapes in its metadata)."""
    from safetensors.torch import save_file

    path = Path(path)
    meta = {"format": FORMAT, "version": str(VERSION), "tokens": str(stats.tokens), "model": json.dumps(stats.model)}
    tensors = {name: getattr(stats, name).contiguous() for name in TENSORS}
    save_file(tensors, str(path), metadata=meta)
    return path


def load(path: str | Path, config: Any) -> Statistics:
    """Read the statistics at ``path`` for the model of ``config``, refusing any file that is not one
    (:func:`load_for` with ``model_identity(config)``)."""
    return load_for(path, model_identity(config))


def load_for(path: str | Path, want: dict[str, Any]) -> Statistics:
    """Read the statistics at ``path`` for the model whose :func:`model_identity` is ``want``, refusing any file
    that is not one.

    Checked from the header alone, before a tensor is read: the format and version, the model's
    ``model_type``, layer count, KV heads and head dims recorded, and each tensor's dtype and shape against
    them; then the tensors' values (finite, symmetric second moments).

    Raises
    ------
    ValueError
        Naming ``path`` and what is wrong (another model, other shapes, not a statistics file).
    """
    path = Path(path)
    header = _header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
        raise ValueError(f"{path}: not a kvpolicy-research attention statistics file (version {VERSION})")
    try:
        recorded = json.loads(meta["model"])
        tokens = int(meta["tokens"])
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: its metadata does not name the model measured ({exc})") from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path}: its metadata does not name the model measured")
    for key in ("model_type", "num_hidden_layers", "num_key_value_heads", "head_dim", "v_head_dim"):
        if recorded.get(key) != want[key]:
            raise ValueError(
                f"{path}: statistics of another model ({key} {recorded.get(key)!r:.60}, this model's is {want[key]!r}; "
                f"measured on {recorded.get('name_or_path')!r:.200}); measure this model's with "
                "kvpolicy_research.calibration.measure"
            )
    layers, heads = want["num_hidden_layers"], want["num_key_value_heads"]
    if not (
        0 < layers <= MAX_LAYERS
        and 0 < heads <= MAX_HEADS
        and 0 < max(want["head_dim"], want["v_head_dim"]) <= MAX_HEAD_DIM
    ):
        raise ValueError(
            f"{path}: a model of {layers} layers, {heads} KV heads is beyond what a statistics file serves"
        )
    for name, role in TENSORS.items():
        d = want["head_dim"] if role == "key" else want["v_head_dim"]
        entry = header.get(name)
        shape = [layers, heads, d, d]
        if not isinstance(entry, dict) or entry.get("dtype") != "F32" or entry.get("shape") != shape:
            got = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else None
            raise ValueError(f"{path}: {name} must be F32 of shape {shape}; the file holds {got!r:.80}")
    extra = sorted(set(header) - set(TENSORS) - {"__metadata__"})
    if extra:
        raise ValueError(f"{path}: unexpected tensors {extra[:4]}")
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    for name, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{path}: {name} holds non-finite values")
        if not torch.allclose(t, t.mT, rtol=1e-4, atol=1e-6 * float(t.abs().max().clamp_min(1e-30))):
            raise ValueError(f"{path}: {name} is not symmetric (not a second moment)")
    if tokens < 1:
        raise ValueError(f"{path}: tokens={tokens} measured")
    return Statistics(tensors["query_moment"], tensors["key_covariance"], tensors["value_moment"], recorded, tokens)


#: rotations derived from statistics files: (file, model, transform, device) -> per layer (U, w, V or None); the
#: same tensors for every layer bound with them (a batch's rows, caches of one model), so a memory report
#: counts each once. Bounded: the oldest entry goes first.
_ROTATIONS: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
MAX_CACHED = 4


def layer_rotations(
    transform: CalibratedRotation, context: BindContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rotations of ``transform`` (whose ``statistics`` names a file) for the layer of ``context``.

    The file is read once per path (and again when it changes), checked by :func:`load_for` against the
    model of ``context.config`` and against the layer's own shapes (its KV heads and head dims, which differ
    from the config's under tensor parallelism), before any rotation is computed.

    Returns
    -------
    (torch.Tensor, torch.Tensor, torch.Tensor or None)
        ``U`` ``(1, kv_heads, d, d)`` float16, ``w`` ``(1, kv_heads, 1, d)`` float32 and ``V`` ``(1, kv_heads, dv,
        dv)`` float16 (``None`` when the transform leaves values to the Hadamard), on ``context.device``: one
        batch row, shared by every row.

    Raises
    ------
    ConfigError
        When the cache was built without the model's config (nothing to check the file against).
    ValueError
        Naming the file: another model, other shapes, not a statistics file, unreadable.
    """
    from kvpolicy.errors import ConfigError

    path = Path(transform.statistics)  # type: ignore[arg-type]
    if context.config is None:
        raise ConfigError(
            f"{transform!r} reads its rotations from {str(path)!r}, which must be checked against the model: build "
            "the cache for the model (CompressedCache.for_model(model, ...), or config=model.config), and load a "
            "saved one with CompressedCache.load(path, model=model)"
        )
    want = model_identity(context.config)
    got = {"num_key_value_heads": context.num_kv_heads, "head_dim": context.key_head_dim,
           "v_head_dim": context.value_head_dim}  # fmt: skip
    for key, value in got.items():  # the layer's own tensors, not only what the config says
        if want[key] != value:
            raise ValueError(
                f"{path}: the statistics of {want[key]} ({key}) serve layers of that shape; layer "
                f"{context.layer_idx} holds {value} (a model split across processes needs statistics of its share)"
            )
    if not 0 <= context.layer_idx < want["num_hidden_layers"]:
        raise ValueError(f"{path}: statistics of {want['num_hidden_layers']} layers; no layer {context.layer_idx}")
    try:
        stat = path.stat()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, tuple(sorted(want.items())),
           transform.power, transform.max_ratio, transform.rotate_values, str(context.device))  # fmt: skip
    layers = _ROTATIONS.get(key)
    if layers is None:
        stats = load_for(path, want)
        u, w, v = stats.rotations(transform)
        layers = [
            (u[i : i + 1].to(context.device).clone(), w[i : i + 1].to(context.device).clone(),
             v[i : i + 1].to(context.device).clone() if transform.rotate_values else None)
            for i in range(u.shape[0])
        ]  # fmt: skip
        while len(_ROTATIONS) >= MAX_CACHED:
            del _ROTATIONS[next(iter(_ROTATIONS))]
        _ROTATIONS[key] = layers
    return layers[context.layer_idx]


def _header(path: Path) -> dict[str, Any]:
    """The safetensors header of ``path``, read and bounded before anything else is."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            size = int.from_bytes(raw, "little")
            if not 0 < size <= MAX_HEADER:
                raise ValueError(f"a header of {size} bytes (at most {MAX_HEADER})")
            text = fh.read(size)
            if len(text) != size:
                raise ValueError("its header is cut short")
        header = json.loads(text)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a safetensors statistics file ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors statistics file")
    return header


__all__ = ["FORMAT", "Statistics", "layer_rotations", "load", "load_for", "measure", "model_identity", "save"]
