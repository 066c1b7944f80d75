"""How much a cache distorts a model: teacher-forced next-token KL, top-1 agreement and ΔNLL against the
uncompressed ``DynamicCache`` (evaluation.md §2 and §5), on the user's own model and texts.

:func:`compare` runs each text twice, teacher-forced: once through the cache under test and once through
transformers' ``DynamicCache`` (the reference), with the same procedure. The first ``prompt_tokens``
tokens of a text are prefilled in one forward; the next ``decode_tokens`` tokens are the continuation
that is scored: the first of them is predicted by the prefill's last position, each later one by a
single-token decode step that reads the cache (``decode_tokens - 1`` steps), the true token always fed
next. Per text, over those positions:

- ``kl``: the mean of ``KL(p_reference || p_cache)`` of the next-token distributions, in nats;
- ``top1``: the share of positions where both argmaxes agree;
- ``delta_nll``: the mean negative log-likelihood of the true next tokens under the cache minus that
  under the reference, in nats per token.

Scoring the prefill's prediction too is the convention of kvpolicy's results pages, so figures measured
here compare with theirs. A :class:`QualityReport` holds one :class:`TextQuality` per text, the mean over
texts with its standard error across texts, the worst text (the largest KL) beside the mean, and the tail
of the per-token KL: its 99th and 99.9th percentiles over every scored token of every text
(:func:`token_percentile`). A mean can hide one text that a cache breaks, and one token in a thousand that
derails a long generation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpolicy.errors import ConfigError
from kvpolicy.prefill import last_only

#: evaluation.md §5: the least a headline number rests on
HEADLINE_TEXTS = 5
HEADLINE_TOKENS = 256
#: the metrics of a :class:`TextQuality`, in the order they are printed
METRICS = ("kl", "top1", "delta_nll")
#: the percentiles of the per-token KL reported beside the mean, by the name of their attribute
TAIL = {"kl_p99": 0.99, "kl_p999": 0.999}


def token_percentile(values: torch.Tensor | Sequence[float], q: float) -> float:
    """The ``q``-quantile of per-token values (KL in nats), by linear interpolation between order statistics.

    The method is numpy's and torch's default, ``"linear"`` (type 7 of Hyndman and Fan): with the ``n``
    values sorted, ``x[0] <= ... <= x[n-1]``, and ``h = (n - 1) q``, the quantile is
    ``x[floor(h)] + (h - floor(h)) (x[floor(h) + 1] - x[floor(h)])``. ``q = 0`` gives the smallest
    value and ``q = 1`` the largest.

    With few values the upper percentiles rest on the largest few: for ``n <= 1001`` the 99.9th
    percentile lies between the two largest values (``h >= n - 2``), so it is nearly the maximum, and for
    ``n <= 101`` so does the 99th. :class:`QualityReport` says so when it prints such a figure.

    Parameters
    ----------
    values : torch.Tensor or sequence of float
        ``(n,)`` values, ``n >= 1`` (any shape is flattened).
    q : float
        The quantile, in ``[0, 1]`` (0.999 for the 99.9th percentile).

    Returns
    -------
    float
        The quantile, computed in float64 (NaN when a value is NaN).

    Raises
    ------
    ConfigError
        ``q`` outside ``[0, 1]``, or no values.
    """
    if isinstance(q, bool) or not isinstance(q, int | float) or not 0.0 <= q <= 1.0:
        raise ConfigError(f"token_percentile: q must be a number in [0, 1]; got q={q!r}")
    x = torch.as_tensor(values, dtype=torch.float64).flatten().cpu()
    if x.numel() == 0:
        raise ConfigError("token_percentile: values must hold at least one value; got none")
    return float(torch.quantile(x, q, interpolation="linear"))


@dataclass(frozen=True)
class TextQuality:
    """The distortion of one text (see :mod:`kvpolicy_lab.quality`).

    Attributes
    ----------
    kl : float
        Mean next-token ``KL(p_reference || p_cache)`` over the scored positions, in nats (0: identical).
    top1 : float
        Share of scored positions whose argmax agrees with the reference's, in ``[0, 1]``.
    delta_nll : float
        Mean NLL of the true next tokens under the cache minus under the reference, in nats per token
        (positive: the cache predicts the text worse).
    tokens : int
        Positions scored.
    kl_tokens : tuple of float or None
        The KL at each scored position, in order (``tokens`` values; :attr:`kl` is their mean), from which
        the percentiles come; None for a row built without them (its percentiles are then NaN).
    """

    kl: float
    top1: float
    delta_nll: float
    tokens: int
    kl_tokens: tuple[float, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ConfigError(f"TextQuality: tokens must be an integer >= 1; got tokens={self.tokens!r}")
        if not 0.0 <= self.top1 <= 1.0:
            raise ConfigError(f"TextQuality: top1 must be a share in [0, 1]; got top1={self.top1!r}")
        if self.kl_tokens is not None:
            values = tuple(float(v) for v in self.kl_tokens)
            if len(values) != self.tokens:
                raise ConfigError(
                    f"TextQuality: kl_tokens must hold one KL per scored position (tokens={self.tokens}); got "
                    f"{len(values)} values"
                )
            mean = math.fsum(values) / len(values)
            if not math.isclose(mean, self.kl, rel_tol=1e-6, abs_tol=1e-12) and not math.isnan(mean):
                raise ConfigError(
                    f"TextQuality: kl must be the mean of kl_tokens; got kl={self.kl!r} and a mean of {mean!r}"
                )
            object.__setattr__(self, "kl_tokens", values)

    @property
    def kl_p99(self) -> float:
        """The 99th percentile of this text's per-token KL (:func:`token_percentile`; NaN without
        :attr:`kl_tokens`)."""
        return self._percentile(TAIL["kl_p99"])

    @property
    def kl_p999(self) -> float:
        """The 99.9th percentile of this text's per-token KL (NaN without :attr:`kl_tokens`)."""
        return self._percentile(TAIL["kl_p999"])

    def _percentile(self, q: float) -> float:
        return math.nan if self.kl_tokens is None else token_percentile(self.kl_tokens, q)


@dataclass(frozen=True)
class QualityReport:
    """What :func:`compare` measured: one row per text, their mean, its standard error, and the worst text.

    Attributes
    ----------
    texts : tuple of TextQuality
        One row per text, in the order given.
    cache : str
        The ``repr`` of the cache measured (of the first text's cache).
    prompt_tokens, decode_tokens : int
        The tokens prefilled and the tokens scored, per text.
    bits_per_element : float or None
        Bits per cached element the cache held after the last text (``memory_report()``, full-precision
        tensors counted at 16 bits, the figure that compares across dtypes), or None for a cache without
        a memory report.

    Notes
    -----
    The standard errors are across texts (``stdev / sqrt(n)``), since the positions of one text are
    correlated; they are ``nan`` for a single text. Differences smaller than two standard errors are
    noise, and evaluation.md §5 asks for at least 5 texts × 256 tokens for a headline number.

    The tail (:attr:`kl_p99`, :attr:`kl_p999`, :attr:`kl_max`) pools every scored token of every text
    (:attr:`scored_tokens` values) before taking the percentile, so that one bad token anywhere counts;
    each text's own percentiles are its row's (:attr:`TextQuality.kl_p99`). With 1,001 tokens or fewer in
    all, the 99.9th percentile lies between the two largest token KLs (:func:`token_percentile`), and the
    printed report says so.
    """

    texts: tuple[TextQuality, ...]
    cache: str
    prompt_tokens: int
    decode_tokens: int
    bits_per_element: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "texts", tuple(self.texts))
        if not self.texts or not all(isinstance(t, TextQuality) for t in self.texts):
            raise ConfigError(
                f"QualityReport: texts must be a non-empty sequence of TextQuality; got texts={self.texts!r:.80}"
            )

    @property
    def kl(self) -> float:
        """Mean over texts of each text's mean KL, in nats."""
        return self._mean("kl")

    @property
    def top1(self) -> float:
        """Mean over texts of each text's top-1 agreement, in ``[0, 1]``."""
        return self._mean("top1")

    @property
    def delta_nll(self) -> float:
        """Mean over texts of each text's ΔNLL, in nats per token."""
        return self._mean("delta_nll")

    @property
    def kl_se(self) -> float:
        """Standard error of :attr:`kl` across texts (``nan`` for one text)."""
        return self._se("kl")

    @property
    def top1_se(self) -> float:
        """Standard error of :attr:`top1` across texts (``nan`` for one text)."""
        return self._se("top1")

    @property
    def delta_nll_se(self) -> float:
        """Standard error of :attr:`delta_nll` across texts (``nan`` for one text)."""
        return self._se("delta_nll")

    @property
    def scored_tokens(self) -> int:
        """The positions scored, over all texts: the values the tail's percentiles are taken over."""
        return sum(t.tokens for t in self.texts)

    @property
    def kl_p99(self) -> float:
        """The 99th percentile of the per-token KL over every scored token of every text, in nats
        (:func:`token_percentile`; NaN when a row holds no :attr:`TextQuality.kl_tokens`)."""
        return self._pooled(TAIL["kl_p99"])

    @property
    def kl_p999(self) -> float:
        """The 99.9th percentile of the per-token KL over every scored token of every text, in nats (NaN when
        a row holds no per-token values); with 1,001 tokens or fewer it lies between the two largest."""
        return self._pooled(TAIL["kl_p999"])

    @property
    def kl_max(self) -> float:
        """The largest per-token KL of any text, in nats (NaN when a row holds no per-token values)."""
        return self._pooled(1.0)

    def _pooled(self, q: float) -> float:
        if any(t.kl_tokens is None for t in self.texts):
            return math.nan
        return token_percentile([v for t in self.texts for v in t.kl_tokens], q)  # type: ignore[union-attr]

    @property
    def worst_index(self) -> int:
        """The index of the text with the largest KL (the first of equal ones)."""
        return max(range(len(self.texts)), key=lambda i: self.texts[i].kl)

    @property
    def worst(self) -> TextQuality:
        """The row of the text with the largest KL."""
        return self.texts[self.worst_index]

    def _mean(self, name: str) -> float:
        return statistics.fmean(getattr(t, name) for t in self.texts)

    def _se(self, name: str) -> float:
        n = len(self.texts)
        return statistics.stdev(getattr(t, name) for t in self.texts) / math.sqrt(n) if n > 1 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict: the settings, each metric's mean, standard error and worst-text value, the KL's
        tail over all scored tokens (``kl``'s ``p99``, ``p999`` and ``max``), and the rows, each with its own
        percentiles and its per-token KL (``nan`` figures become ``None``)."""
        worst = self.worst
        out: dict[str, Any] = {
            "cache": self.cache, "prompt_tokens": self.prompt_tokens, "decode_tokens": self.decode_tokens,
            "bits_per_element": self.bits_per_element, "n_texts": len(self.texts), "worst_index": self.worst_index,
            "scored_tokens": self.scored_tokens,
        }  # fmt: skip
        for name in METRICS:
            out[name] = {"mean": self._mean(name), "se": _none(self._se(name)), "worst": getattr(worst, name)}
        out["kl"].update(p99=_none(self.kl_p99), p999=_none(self.kl_p999), max=_none(self.kl_max))
        out["texts"] = [
            {"kl": t.kl, "top1": t.top1, "delta_nll": t.delta_nll, "tokens": t.tokens, "kl_p99": _none(t.kl_p99),
             "kl_p999": _none(t.kl_p999), "kl_tokens": None if t.kl_tokens is None else list(t.kl_tokens)}
            for t in self.texts
        ]  # fmt: skip
        return out

    def __str__(self) -> str:
        n = len(self.texts)
        head = f"QualityReport: {n} text{'s' * (n != 1)} × {self.decode_tokens} tokens after {self.prompt_tokens}"
        if self.bits_per_element is not None:
            head += f", {self.bits_per_element:.2f} bits per element"
        rows = [("", "KL (nats)", "top-1", "ΔNLL (nats)")]
        rows.append(("mean", f"{self.kl:.4g}", f"{self.top1:.1%}", f"{self.delta_nll:+.4g}"))
        if n > 1:
            rows.append(("± s.e.", f"{self.kl_se:.2g}", f"{self.top1_se:.1%}", f"{self.delta_nll_se:.2g}"))
        worst = self.worst
        rows.append((f"worst (text {self.worst_index})", f"{worst.kl:.4g}", f"{worst.top1:.1%}",
                     f"{worst.delta_nll:+.4g}"))  # fmt: skip
        tail = not math.isnan(self.kl_max)
        if tail:
            rows += [("p99 of tokens", f"{self.kl_p99:.4g}", "", ""),
                     ("p99.9 of tokens", f"{self.kl_p999:.4g}", "", "")]  # fmt: skip
        width = [max(len(row[c]) for row in rows) for c in range(4)]
        lines = [head, f"  cache: {self.cache}"]
        for row in rows:
            cells = [row[0].ljust(width[0]), *(v.rjust(w) for v, w in zip(row[1:], width[1:], strict=True))]
            lines.append("  " + ("  ".join(cells)).rstrip())
        if tail:
            note = f"  (p99, p99.9: percentiles of the per-token KL over all {self.scored_tokens} scored tokens"
            near = [name for name, q in (("p99", 0.99), ("p99.9", 0.999)) if _near_max(self.scored_tokens, q)]
            if near:
                verb = "rests" if len(near) == 1 else "rest"
                note += f"; so few that {' and '.join(near)} {verb} on the largest two: max {self.kl_max:.4g}"
            lines.append(note + ")")
        if n < HEADLINE_TEXTS or self.decode_tokens < HEADLINE_TOKENS:
            lines.append(f"  (a headline number needs >= {HEADLINE_TEXTS} texts × {HEADLINE_TOKENS} tokens)")
        return "\n".join(lines)


def _none(value: float) -> float | None:
    """``value``, or None for NaN (JSON has no NaN)."""
    return None if math.isnan(value) else value


def _near_max(n: int, q: float) -> bool:
    """Whether :func:`token_percentile` of ``n`` values at ``q`` lies between the two largest (``(n-1) q >= n-2``)."""
    return (n - 1) * q >= n - 2


def compare(
    model: torch.nn.Module,
    cache: str | Mapping[str, Any] | Any | Callable[[], Any],
    texts: Sequence[str | torch.Tensor],
    *,
    prompt_tokens: int,
    decode_tokens: int,
    tokenizer: Any = None,
    progress: bool = False,
) -> QualityReport:
    """How much ``cache`` distorts ``model`` on ``texts``, against an uncompressed ``DynamicCache``.

    Each text is run teacher-forced through a fresh cache and through a fresh ``DynamicCache`` (see
    :mod:`kvpolicy_lab.quality` for the procedure and the metrics). Everything is checked before the model
    runs.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM. It runs under ``torch.inference_mode()`` in eval mode; each module's ``training``
        flag is restored afterwards. Its attention implementation is left as it is: when kvpolicy's fused
        attention is on (``enable_fused``, ``decode_mode(model, "fused")``), the cache is measured on the
        fused path (the reference ``DynamicCache`` runs the original implementation, as it does in use).
    cache : str, CacheSpec, mapping or callable
        The cache under test: a preset name or preset file (``"kvpolicy-3bit"``), a
        :class:`~kvpolicy.spec.CacheSpec`, a mapping of :class:`~kvpolicy.CompressedCache` keywords
        (``{"policy": "log", "bits": 2}``), each built for ``model`` as :meth:`CompressedCache.for_model`
        does (sliding-window layers stay transformers' own); or a zero-argument callable returning a
        fresh transformers ``Cache``, called once per text.
    texts : sequence of str or torch.Tensor
        The texts: strings (tokenized with ``tokenizer.encode``) or 1-D integer tensors of token ids, each
        at least ``prompt_tokens + decode_tokens`` tokens long (later tokens are not used).
    prompt_tokens : int
        Tokens prefilled in one forward (the context the cache compresses), ``>= 1``.
    decode_tokens : int
        Tokens scored after the prompt, ``>= 1``: the first predicted by the prefill, each later one by a
        single-token decode step.
    tokenizer : transformers tokenizer, optional
        Needed when ``texts`` holds strings.
    progress : bool
        Show a progress bar over the texts.

    Returns
    -------
    QualityReport
        One row per text (with its per-token KL), the mean and its standard error across texts, the worst
        text, and the 99th and 99.9th percentiles of the per-token KL over all scored tokens.

    Raises
    ------
    ConfigError
        A bad argument (naming it, its value and what is allowed): no texts, a text too short or not
        token ids, strings without a tokenizer, token ids outside the vocabulary, counts below 1, a cache
        that is not one of the forms above, or bad cache keywords.

    Examples
    --------
    >>> report = kvpolicy_lab.quality.compare(model, "kvpolicy-3bit", texts, tokenizer=tokenizer,
    ...                                   prompt_tokens=1024, decode_tokens=256)  # doctest: +SKIP
    >>> print(report)  # doctest: +SKIP
    """
    for name, value in (("prompt_tokens", prompt_tokens), ("decode_tokens", decode_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"compare: {name} must be an integer >= 1; got {name}={value!r}")
    ids = _token_ids(model, texts, tokenizer, prompt_tokens + decode_tokens)
    make = _cache_factory(model, cache)
    candidate = _fresh(make)  # bad cache keywords fail here, before any forward
    rows: list[TextQuality] = []
    described = repr(candidate)
    states = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        from tqdm.auto import tqdm

        with torch.inference_mode():
            for i, text in enumerate(tqdm(ids, desc="texts", disable=not progress, leave=False)):
                if i > 0:
                    candidate = None  # one text's caches held at a time
                    candidate = _fresh(make)
                rows.append(_one_text(model, text, prompt_tokens, candidate))
    finally:
        for module, training in states:
            module.training = training
    report = getattr(candidate, "memory_report", None)
    bits = report().bits_per_element_16bit if callable(report) else None
    return QualityReport(tuple(rows), described, prompt_tokens, decode_tokens, bits)


# ---------------------------------------------------------------------- the measurement
def next_token_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """``KL(p_reference || p_candidate)`` in nats at every position.

    Parameters
    ----------
    reference, candidate : torch.Tensor
        ``(..., vocab)`` logits.

    Returns
    -------
    torch.Tensor
        ``(...)`` float32 KL divergences; a token the reference gives probability 0 adds nothing.
    """
    log_p = torch.log_softmax(reference.float(), dim=-1)
    log_q = torch.log_softmax(candidate.float(), dim=-1)
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood, in nats, of ``targets`` (``(...)`` token ids) under ``logits``
    (``(..., vocab)``): a ``(...)`` float32 tensor."""
    return -torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _one_text(model: torch.nn.Module, ids: torch.Tensor, prompt: int, candidate: Any) -> TextQuality:
    """Teacher-force ``ids`` (``(prompt + decode,)`` on the model's device) through ``candidate`` and a
    ``DynamicCache`` in step, scoring each position as it comes (two ``(1, vocab)`` logits held at a time)."""
    from transformers import DynamicCache

    reference = DynamicCache(config=model.config)
    ids = ids.unsqueeze(0)
    kl, agree, delta = [], [], []
    for t in range(prompt - 1, ids.shape[1] - 1):
        if t == prompt - 1:  # the prefill: its last position predicts the first scored token
            ref, got = (_forward(model, ids[:, :prompt], c, last=True) for c in (reference, candidate))
        else:
            ref, got = (_forward(model, ids[:, t : t + 1], c) for c in (reference, candidate))
        target = ids[:, t + 1]
        kl.append(next_token_kl(ref, got))
        agree.append(ref.argmax(-1) == got.argmax(-1))
        delta.append(nll(got, target) - nll(ref, target))
    per_token = torch.cat(kl).double()
    return TextQuality(
        kl=float(per_token.mean()), top1=float(torch.cat(agree).double().mean()),
        delta_nll=float(torch.cat(delta).double().mean()), tokens=len(kl), kl_tokens=tuple(per_token.tolist()),
    )  # fmt: skip


def _forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any, last: bool = False) -> torch.Tensor:
    """The float32 logits of the last position of ``ids`` (``(1, n)``) fed through ``cache``: ``(1, vocab)``."""
    extra = last_only(model) if last else {}
    return model(ids, cache=cache, use_cache=True, **extra).logits[:, -1].float()


# ---------------------------------------------------------------------- the arguments
def _token_ids(model: torch.nn.Module, texts: Any, tokenizer: Any, needed: int) -> list[torch.Tensor]:
    """The first ``needed`` token ids of each text, ``(needed,)`` int64 on the model's device, checked."""
    if isinstance(texts, str | torch.Tensor) or not isinstance(texts, Sequence):
        raise ConfigError(
            f"compare: texts must be a list of strings or of 1-D token-id tensors; got a {type(texts).__name__} "
            "(wrap one text in a list: texts=[text])"
        )
    if not texts:
        raise ConfigError("compare: texts must hold at least one text; got texts=[] (evaluation.md asks for >= 5)")
    vocab = _vocab_size(model)
    out = []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            if tokenizer is None:
                raise ConfigError(
                    f"compare: texts[{i}] is a string, which needs tokenizer=; pass the model's tokenizer, or token "
                    "ids (1-D tensors) instead"
                )
            ids = torch.as_tensor(tokenizer.encode(text), dtype=torch.long)
        elif isinstance(text, torch.Tensor):
            if text.dim() != 1 or text.dtype.is_floating_point or text.dtype.is_complex or text.dtype == torch.bool:
                raise ConfigError(
                    f"compare: texts[{i}] must be a 1-D integer tensor of token ids; got a {text.dtype} tensor of "
                    f"shape {tuple(text.shape)}"
                )
            ids = text.long()
        else:
            raise ConfigError(
                f"compare: texts[{i}] must be a string or a 1-D tensor of token ids; got a {type(text).__name__}"
            )
        if ids.numel() < needed:
            raise ConfigError(
                f"compare: texts[{i}] has {ids.numel()} tokens; prompt_tokens + decode_tokens = {needed} are needed "
                "(use longer texts, or fewer prompt or decode tokens)"
            )
        ids = ids[:needed]
        low, high = int(ids.min()), int(ids.max())
        if vocab is not None and (low < 0 or high >= vocab):
            raise ConfigError(
                f"compare: texts[{i}] holds token id {low if low < 0 else high}, outside the model's vocabulary "
                f"[0, {vocab}); are these ids from another tokenizer?"
            )
        out.append(ids.to(_device(model)))
    return out


def _vocab_size(model: torch.nn.Module) -> int | None:
    embeddings = getattr(model, "get_input_embeddings", None)
    table = embeddings() if callable(embeddings) else None
    return getattr(table, "num_embeddings", None)


def _device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _cache_factory(model: torch.nn.Module, cache: Any) -> Callable[[], Any]:
    """A zero-argument function returning a fresh cache for ``model``, from any form :func:`compare` takes."""
    from kvpolicy import model_check
    from kvpolicy.cache import CompressedCache
    from kvpolicy.spec import CacheSpec

    if isinstance(cache, str):
        return lambda: CompressedCache.for_model(model, cache)
    if isinstance(cache, CacheSpec):
        config = model_check.check_model(model)
        return lambda: CompressedCache.from_spec(cache, config)
    if isinstance(cache, Mapping):
        keywords = dict(cache)
        if not all(isinstance(k, str) for k in keywords):
            raise ConfigError(f"compare: a cache mapping's keys must be CompressedCache keywords; got {list(keywords)}")
        return lambda: CompressedCache.for_model(model, **keywords)
    from transformers import Cache

    if isinstance(cache, Cache):
        raise ConfigError(
            f"compare: cache must build a fresh cache for each text; got a {type(cache).__name__} instance (pass "
            "a preset name, a CacheSpec, CompressedCache keywords, or a function: cache=lambda: ...)"
        )
    if callable(cache):
        return cache
    raise ConfigError(
        f"compare: cache must be a preset name, a CacheSpec, a mapping of CompressedCache keywords, or a "
        f"zero-argument callable returning a fresh transformers Cache; got a {type(cache).__name__}: {cache!r:.60}"
    )


def _fresh(make: Callable[[], Any]) -> Any:
    """``make()``, checked to be a transformers ``Cache``."""
    from transformers import Cache

    cache = make()
    if not isinstance(cache, Cache):
        raise ConfigError(
            f"compare: the cache callable must return a transformers Cache; it returned a {type(cache).__name__}"
        )
    return cache
