"""Attention-output relative error per layer, measured at the source.

:class:`AttentionErrorProbe` hooks every attention module of a model (modules with a ``layer_idx``
whose class name ends in ``Attention``). While it is active, each call of such a module through the
cache under test is repeated on the *same input* (hidden states, rotary embeddings) with a shadow
``DynamicCache`` that holds every key and value uncompressed. The relative error of layer ``l`` is

``||o_compressed - o_reference||_2 / ||o_reference||_2``

over the attention output (after the output projection) of the query tokens, per sequence of the
batch (:meth:`AttentionErrorProbe.per_layer_rows`), so it isolates the
distortion that the compressed keys and values of layer ``l`` cause, without the drift propagated
from earlier layers. The shadow cache must see every token: activate the probe before the prefill.
"""

from __future__ import annotations

from typing import Any

import torch

_CACHE_KWARGS = ("cache", "past_key_values")


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of ``model`` in layer order."""
    mods = [
        m
        for m in model.modules()
        if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)
    ]
    if not mods:
        raise ValueError(f"no attention modules with a layer_idx found in {type(model).__name__}")
    return sorted(mods, key=lambda m: m.layer_idx)


def _ratio(err: float, ref: float) -> float:
    return (err / ref) ** 0.5 if ref > 0 else float("nan")


class AttentionErrorProbe:
    """Context manager measuring the attention-output relative error of every layer.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers causal LM.

    Attributes
    ----------
    active : bool
        Record errors only while True (the shadow cache is always fed, so it stays complete).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.modules = attention_modules(model)
        # the model's own layer types (a hybrid model's sliding layers keep their window), so the
        # reference attends over exactly what the uncompressed model attends over
        self.shadow = DynamicCache(config=model.config)
        self.active = True
        self._handles: list[Any] = []
        self._inside = False
        # per layer: sums of squared error and of squared reference norms (per sequence of the batch:
        # ``(batch,)`` float64 tensors once a call is recorded), and steps recorded
        self._err: list[Any] = [0.0] * len(self.modules)
        self._ref: list[Any] = [0.0] * len(self.modules)
        self._steps = [0] * len(self.modules)

    def __enter__(self) -> AttentionErrorProbe:
        for m in self.modules:
            self._handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._inside:
            return
        out = output[0] if isinstance(output, tuple) else output
        key = next((k for k in _CACHE_KWARGS if k in kwargs), None)
        if key is None:
            raise RuntimeError(f"{type(module).__name__} was called without a cache keyword ({_CACHE_KWARGS})")
        call = dict(kwargs)
        call[key] = self.shadow
        hidden = args[0] if args else call.pop("hidden_states")
        q_len = hidden.shape[1]
        mask = call.get("attention_mask")
        if mask is not None and mask.shape[-1] != self._shadow_keys(module.layer_idx, q_len):
            # the mask was sized for a cache holding fewer keys (eviction); a single decoding query
            # needs no mask, and a multi-token one gets the causal default of sdpa/eager
            call["attention_mask"] = None
        self._inside = True
        try:
            ref = module(hidden, *args[1:], **call)
        finally:
            self._inside = False
        ref = ref[0] if isinstance(ref, tuple) else ref
        if self.active:
            i = self.modules.index(module)
            rows = tuple(range(1, out.dim()))
            self._err[i] = self._err[i] + (out.double() - ref.double()).pow(2).sum(rows)
            self._ref[i] = self._ref[i] + ref.double().pow(2).sum(rows)
            self._steps[i] += 1

    def _shadow_keys(self, layer_idx: int, q_len: int) -> int:
        """How many keys the shadow cache's layer returns for ``q_len`` new tokens (a sliding layer:
        its window; a layer not started yet: the new tokens)."""
        if layer_idx < len(self.shadow.layers):
            return self.shadow.layers[layer_idx].get_mask_sizes(q_len)[0]
        return q_len

    def per_layer(self) -> list[float]:
        """Relative error of each layer over every recorded call, the batch's sequences pooled (``nan``
        where nothing was recorded)."""
        return [_ratio(float(torch.as_tensor(e).sum()), float(torch.as_tensor(r).sum()))
                for e, r in zip(self._err, self._ref, strict=True)]  # fmt: skip

    def per_layer_rows(self, batch: int) -> list[list[float]]:
        """:meth:`per_layer` of each of the ``batch`` sequences alone: ``batch`` lists of one value per layer."""
        out = [[float("nan")] * len(self.modules) for _ in range(batch)]
        for i, (e, r) in enumerate(zip(self._err, self._ref, strict=True)):
            if isinstance(e, torch.Tensor):
                if e.numel() != batch:
                    raise ValueError(f"the probe recorded batches of {e.numel()} sequences; got batch={batch}")
                for b in range(batch):
                    out[b][i] = _ratio(float(e[b]), float(r[b]))
        return out

    def reset_errors(self) -> None:
        """Forget recorded errors (the shadow cache is kept)."""
        n = len(self.modules)
        self._err, self._ref, self._steps = [0.0] * n, [0.0] * n, [0] * n
