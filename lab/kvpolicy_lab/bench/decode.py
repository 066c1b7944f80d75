"""``kvpolicy bench decode``: decode latency, prefill time and bytes held, cache against cache.

Two modes:

``latency`` (default)
    For each context length and batch size, every cache variant is prefilled with the same random
    prompt (prefill ms: one timed forward, after an untimed 16-token forward through a throwaway cache
    of the same variant), then decode steps are timed in rounds by ``torch.utils.benchmark.Timer``
    (:func:`kvpolicy_lab.bench.timing.interleaved`): each round measures every variant once, one
    variant after the other, in a rotated order, so all variants see the same machine load. A
    measurement is the Timer's warm-up (two untimed decode steps; from 300 ``--steps`` up, a hundredth
    of them), then ``--steps`` timed steps, on ``--threads`` torch threads. The first ``--warmup``
    rounds are discarded. Decode ms/token is the median over the ``--reps`` measured rounds of (time
    of the ``--steps`` steps) / ``--steps``; the spread shown is their interquartile range. Each step
    appends to its cache, so a context grows by ``(--warmup + --reps) x (--steps + warm-up steps)``
    tokens through the run; bytes held are counted from the tensors each cache holds after the last
    step (``tokens_held`` tokens). With ``--fill synthetic`` the caches are filled by ``Cache.update``
    with random keys and values instead of a prefill (decode cost does not depend on the values held;
    prefill time is then not measured).
``capacity``
    At a fixed cache budget (``--budget-gib``), the largest batch of ``--context``-token sequences
    that fits, for ``DynamicCache`` and for each compressed variant, from the bytes per sequence
    measured at batch 1; then confirmed by filling caches of that batch size and running decode
    steps (whole-batch tokens/s): ``--reps`` Timer measurements of ``--steps`` steps, one variant
    after the other (each fills the budget alone, so they are not held at once to alternate).

Cache variants are named by short strings:

- ``dynamic``: transformers' ``DynamicCache``;
- ``one-liner``: ``CompressedCache(policy="log", action="quantize", bits=2)`` exactly as the README
  writes it (every default: ``backend="auto"``, ``check_finite=True``, the default group sizes), run
  with :func:`kvpolicy.fused.enable_fused` on the model (``--window`` does not apply);
- ``preset:<file.toml>``: ``CompressedCache.from_config(file)`` (a preset ``kvpolicy tune`` wrote, or the
  name of a shipped preset file such as ``preset:smollm2-8k-2.5bit``), or
  ``preset:<name>``: ``CompressedCache.from_preset(name)`` (a registered preset, e.g.
  ``preset:kvpolicy-3bit``); run with :func:`kvpolicy.fused.enable_fused` (``--window`` does not apply);
- ``hf-<quanto|hqq>-<bits>``: transformers' ``QuantizedCache(backend, config, nbits=bits)``;
- ``<policy>-<bits>-<backend>-<layout>-<fused|mat>``: ``CompressedCache(policy, action="quantize",
  bits, backend, layout, attention="auto" | "materialized")``; ``<bits>`` is one width (``2``) or
  ``k<key bits>v<value bits>`` (``k4v2``: ``key_bits=4, value_bits=2``); ``fused`` variants run with
  :func:`kvpolicy.fused.enable_fused` on the model, ``mat`` ones (and the baselines) with
  :func:`kvpolicy.attention.enable_scores`, so the agnostic layout's mask check can run; a trailing
  ``-rot`` adds ``transform="hadamard"`` (``log-k4v2-cpu-ordered-fused-rot``). These variants hold
  min-max groups of 64 (``group_size=64, fit="minmax"``, whatever the defaults), so their numbers
  stay comparable across releases; a trailing ``-mse`` gives ``fit="mse"`` and ``-kmse``
  ``key_fit="mse"`` (``log-2-cpu-ordered-fused-mse``, ``log-2-cpu-ordered-fused-rot-kmse``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpolicy.errors import ConfigError
from kvpolicy_lab.bench.timing import device_clock, interleaved, warmup_calls
from kvpolicy_lab.eval.caches import baseline_bytes, held_bytes
from kvpolicy_lab.eval.metrics import last_only

HELP = "decode ms/token, prefill ms and bytes held: DynamicCache vs QuantizedCache vs CompressedCache variants"

DEFAULT_VARIANTS = (
    "dynamic",
    "hf-quanto-2",
    "hf-quanto-4",
    "hf-hqq-2",
    "hf-hqq-4",
    "log-2-torch-ordered-mat",
    "log-2-torch-agnostic-mat",
    "log-2-torch-ordered-fused",
    "log-4-torch-ordered-fused",
    "recent-2-torch-ordered-fused",
)
#: the built-in model names (``--model`` also takes anything ``kvpolicy ablate --model`` does)
MODELS = ("smollm2", "gemma3-270m", "tiny-llama")
#: ``--dtype`` values (torch's names) -> dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """One cache configuration, parsed from its name (see the module docstring)."""

    name: str
    kind: str  # "dynamic", "one-liner", "preset", "hf", "kv"
    policy: str = ""
    bits: int = 0
    #: ``(key_bits, value_bits)`` of a ``k<K>v<V>`` variant (``bits`` is then 0)
    widths: tuple[int, int] | None = None
    backend: str = ""
    layout: str = "ordered"
    fused: bool = False
    transform: str = "none"
    #: ``"minmax"``, ``"mse"`` (``fit="mse"``) or ``"kmse"`` (``key_fit="mse"``)
    fit: str = "minmax"

    @classmethod
    def parse(cls, name: str) -> Variant:
        parts = name.split("-")
        if name == "dynamic":
            return cls(name, "dynamic")
        if name == "one-liner":
            return cls(name, "one-liner", policy="log", bits=2, backend="auto", fused=True)
        if name.startswith("preset:"):
            from kvpolicy import preset_source

            try:
                preset_source.check(name.removeprefix("preset:"))
            except ConfigError as exc:
                raise ConfigError(f"cache variant {name!r}: {exc}") from None
            return cls(name, "preset", fused=True)
        if parts[0] == "hf" and len(parts) == 3 and parts[1] in ("quanto", "hqq") and parts[2].isdigit():
            return cls(name, "hf", backend=parts[1], bits=int(parts[2]))
        transform, fit = "none", "minmax"
        if len(parts) > 5 and parts[-1] in ("mse", "kmse"):
            parts, fit = parts[:-1], parts[-1]
        if len(parts) == 6 and parts[5] == "rot":
            parts, transform = parts[:5], "hadamard"
        mixed = re.fullmatch(r"k(\d)v(\d)", parts[1]) if len(parts) == 5 else None
        if (
            len(parts) == 5
            and (parts[1].isdigit() or mixed)
            and parts[3] in ("ordered", "agnostic")
            and parts[4] in ("fused", "mat")
        ):
            bits, widths = (0, (int(mixed[1]), int(mixed[2]))) if mixed else (int(parts[1]), None)
            return cls(name, "kv", parts[0], bits, widths, parts[2], parts[3], parts[4] == "fused", transform, fit)
        from kvpolicy.errors import did_you_mean

        hint = did_you_mean(name, ["dynamic", "one-liner", *DEFAULT_VARIANTS])
        raise ConfigError(
            f"cache variant {name!r} not understood{hint} (use 'dynamic', 'one-liner', 'preset:<name or file.toml>', "
            "'hf-<quanto|hqq>-<bits>' or "
            "'<policy>-<bits|k<K>v<V>>-<backend>-<ordered|agnostic>-<fused|mat>[-rot][-mse|-kmse]' (e.g. "
            "log-2-torch-ordered-fused, log-k4v2-cpu-ordered-fused-rot, log-2-cpu-ordered-fused-mse))"
        )

    def build(self, config: Any, window: int) -> Any:
        """A fresh cache for a model with ``config``."""
        from transformers import DynamicCache, QuantizedCache

        # a hybrid model (sliding-window layers: Gemma 2/3) gets config=, so those layers stay transformers' own
        from kvpolicy.cache import is_hybrid

        hybrid = {"config": config} if is_hybrid(config) else {}
        if self.kind == "dynamic":
            return DynamicCache(**hybrid)
        if self.kind == "hf":
            return QuantizedCache(self.backend, config, nbits=self.bits)
        from kvpolicy import CompressedCache

        if self.kind == "one-liner":
            return CompressedCache(policy="log", action="quantize", bits=2, **hybrid)
        if self.kind == "preset":
            return CompressedCache.from_preset(self.name.removeprefix("preset:"), **hybrid)
        widths = dict(key_bits=self.widths[0], value_bits=self.widths[1]) if self.widths else dict(bits=self.bits)
        return CompressedCache(
            policy=self.policy, action="quantize", **widths, backend=self.backend, layout=self.layout,
            attention="auto" if self.fused else "materialized", window=window, check_finite=False,
            transform=self.transform, group_size=VARIANT_GROUP_SIZE, **_FIT_KEYWORDS[self.fit], **hybrid,
        )  # fmt: skip


#: the group size of ``<policy>-<bits>-...`` variants, keys and values alike (the ``one-liner`` variant
#: follows the defaults instead)
VARIANT_GROUP_SIZE = 64
#: a variant's fit suffix -> the ``CompressedCache`` keywords it stands for (min-max unless suffixed,
#: whatever the default)
_FIT_KEYWORDS: dict[str, dict[str, str]] = {
    "minmax": {"fit": "minmax"},
    "mse": {"fit": "mse"},
    "kmse": {"key_fit": "mse"},
}


# ---------------------------------------------------------------------- models
def tiny_llama(dtype: torch.dtype) -> torch.nn.Module:
    """A small random Llama (4 layers, 4 query / 2 kv heads of 64 channels), built in code."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=65536,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def load(model: str, dtype: torch.dtype, device: str, online: bool = False) -> torch.nn.Module:
    """The model ``--model`` names, in eval mode on ``device``.

    ``tiny-llama`` is this benchmark's own :func:`tiny_llama`; a local model directory is loaded without a
    tokenizer (the prompts are random token ids); any other name as ``kvpolicy ablate --model`` resolves it
    (:func:`kvpolicy_lab.eval.runner.open_model`: ``smollm2``, ``gemma3-270m``, ``tiny-<family>[-layers]``,
    a ``.gguf`` file, a hub id, fetched only when ``online``).

    Raises
    ------
    ConfigError
        The model cannot be found or loaded (one line saying why).
    """
    if model == "tiny-llama":
        return tiny_llama(dtype).to(device)
    path = Path(model).expanduser()
    if path.is_dir():
        from transformers import AutoModelForCausalLM

        from kvpolicy.model_folder import read_config

        read_config(path)  # a malformed config, or one that needs the folder's own code, is refused here
        try:
            loaded = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="sdpa", trust_remote_code=False
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"model {model!r} could not be loaded: {exc}") from exc
        return loaded.to(device).eval()
    from kvpolicy_lab.eval.runner import open_model

    return open_model(model, str(dtype).removeprefix("torch."), device, online)[0].eval()


# ---------------------------------------------------------------------- measurement
@dataclass
class Row:
    """One measured cell."""

    model: str
    dtype: str
    device: str
    length: int
    batch: int
    variant: str
    prefill_ms: float
    decode_ms: float
    #: ms/token of each measured round, in round order (``decode_ms`` is their median)
    decode_ms_all: list[float] = field(default_factory=list)
    bytes_held: int = 0
    paths: str = ""
    ratio_ms: float = float("nan")
    ratio_bytes: float = float("nan")
    #: 8 x bytes held per cached element; ``bits16``: full-precision tensors counted at 16 bits
    bits_per_element: float = float("nan")
    bits16: float = float("nan")
    #: interquartile range of ``decode_ms_all`` (0 with one round)
    decode_iqr_ms: float = float("nan")
    #: tokens each cache holds after the last step: the context plus every decode step run, untimed ones too
    tokens_held: int = 0


#: tokens of the untimed forward that precedes each timed prefill
PREFILL_WARMUP_TOKENS = 16


def _attention(model: torch.nn.Module, variant: Variant) -> AbstractContextManager[None]:
    """``fused`` variants: kvpolicy's fused attention; the others: the score-reporting wrapper (outputs
    unchanged), which checks the mask so ``layout="agnostic"`` can be used (:mod:`kvpolicy.handoff`). The
    model's implementation is restored on exit (:func:`kvpolicy.modes.decode_mode`); the switch is outside
    every timed span."""
    from kvpolicy.modes import decode_mode

    return decode_mode(model, "fused" if variant.fused else "scores")


@contextmanager
def _decoding(model: torch.nn.Module, variant: Variant) -> Iterator[None]:
    """The attention mode of ``variant`` (:func:`_attention`) and inference mode, around a measurement."""
    with _attention(model, variant), torch.inference_mode():
        yield


@torch.inference_mode()
def _prefill(
    model: torch.nn.Module, variant: Variant, ids: torch.Tensor, args: argparse.Namespace
) -> tuple[Any, torch.Tensor, float]:
    """A cache of ``variant`` holding ``ids``, the greedy next token, and the prefill ms (NaN when synthetic).

    The prefill is timed by hand, not by a ``Timer``: it must run exactly once into an empty cache, and
    ``Timer.timeit`` runs its statement at least twice untimed first (a second prefill into the same
    cache would attend over twice the context; one into a fresh cache would triple the slowest part of
    the run). A short untimed forward through a throwaway cache of the same variant warms the code
    paths first, so the first variant measured does not carry the process's first-call costs. The clock
    is the one the Timers read (:func:`kvpolicy_lab.bench.timing.device_clock`).
    """
    with _decoding(model, variant):
        cache = variant.build(model.config, args.window)
        if args.fill == "synthetic":
            _fill(model, cache, ids.shape[0], ids.shape[1], args.device, DTYPES[args.dtype])
            return cache, ids[:, -1:], float("nan")
        warm = variant.build(model.config, args.window)
        model(ids[:, :PREFILL_WARMUP_TOKENS], cache=warm, use_cache=True, **last_only(model))
        del warm
        clock = device_clock(args.device)
        start = clock()
        out = model(ids, cache=cache, use_cache=True, **last_only(model))  # as generate() does
        ms = (clock() - start) * 1e3
    return cache, out.logits[:, -1:].argmax(-1), ms


class DecodeStep:
    """One greedy decode step through a cache, as a statement for a ``Timer``: each call feeds the token
    the previous call chose and appends one token per sequence to ``cache``.

    Parameters
    ----------
    model : torch.nn.Module
        The causal LM.
    cache : Any
        The cache the steps extend (already holding the context).
    token : torch.Tensor
        ``(batch, 1)`` token ids for the first step.
    """

    def __init__(self, model: torch.nn.Module, cache: Any, token: torch.Tensor) -> None:
        self.model, self.cache, self.token = model, cache, token

    def __call__(self) -> None:
        self.token = self.model(self.token, cache=self.cache, use_cache=True).logits[:, -1:].argmax(-1)


def _threads(args: argparse.Namespace) -> int:
    """The torch thread count to time on: ``--threads``, else torch's current count."""
    return getattr(args, "threads", None) or torch.get_num_threads()


def latency(args: argparse.Namespace, model: torch.nn.Module, variants: list[Variant]) -> list[Row]:
    """Prefill ms, decode ms/token (interleaved Timer rounds) and bytes held per length, batch and variant.

    Parameters
    ----------
    args : argparse.Namespace
        The parsed flags of ``kvpolicy bench decode`` (see the module docstring).
    model : torch.nn.Module
        The loaded model.
    variants : list[Variant]
        The caches to compare; all of one length and batch are measured in the same rounds.

    Returns
    -------
    list[Row]
        One row per length, batch and variant, with ratios to ``dynamic`` where it was measured.
    """
    rows: list[Row] = []
    vocab = model.config.vocab_size
    by_name = {v.name: v for v in variants}
    for length in args.lengths:
        for batch in args.batch:
            g = torch.Generator().manual_seed(length + batch)
            ids = torch.randint(3, vocab, (batch, length), generator=g).to(args.device)
            steps: dict[str, DecodeStep] = {}
            prefill: dict[str, float] = {}
            for v in variants:
                cache, token, prefill[v.name] = _prefill(model, v, ids, args)
                steps[v.name] = DecodeStep(model, cache, token)
                print(f"  prefill {length:>6} x{batch} {v.name:<30} {prefill[v.name]:10.1f} ms", flush=True)
            measured = interleaved(
                steps, number=args.steps, repeats=args.reps, warmup=args.warmup, threads=_threads(args),
                around=lambda name: _decoding(model, by_name[name]), clock=device_clock(args.device),
            )  # fmt: skip
            for v in variants:
                cache, m = steps[v.name].cache, measured[v.name]
                paths = sorted(set(getattr(cache, "attention_paths", dict)().values()) - {None})
                tokens = cache.get_seq_length()
                base = baseline_bytes(model.config, tokens, batch)
                held = held_bytes(cache)
                rows.append(
                    Row(args.model, args.dtype, args.device, length, batch, v.name, prefill[v.name], m.median * 1e3,
                        [t * 1e3 for t in m.times], held, "; ".join(str(p) for p in paths),
                        bits_per_element=16 * held / base, bits16=16 * held_bytes(cache, at_16bit=True) / base,
                        decode_iqr_ms=m.iqr * 1e3, tokens_held=tokens)
                )  # fmt: skip
            del steps
    _ratios(rows)
    return rows


def _ratios(rows: list[Row]) -> None:
    base = {(r.length, r.batch): r for r in rows if r.variant == "dynamic"}
    for r in rows:
        b = base.get((r.length, r.batch))
        if b is not None:
            r.ratio_ms = r.decode_ms / b.decode_ms
            r.ratio_bytes = r.bytes_held / b.bytes_held if b.bytes_held else float("nan")


@torch.inference_mode()
def _fill(model: torch.nn.Module, cache: Any, batch: int, length: int, device: str, dtype: torch.dtype) -> None:
    """Fill ``cache`` with ``length`` synthetic (random normal) tokens per layer, as one prefill update (a
    store that fits itself on the queries, ``transform="query-hadamard"``, is given random queries too)."""
    from kvpolicy_lab.estimation import feed_random_queries

    cfg = model.config
    hk = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator(device=device).manual_seed(0)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, hk, length, d, generator=g, device=device, dtype=dtype)
        v = torch.randn(batch, hk, length, d, generator=g, device=device, dtype=dtype)
        cache.update(k, v, layer)
        feed_random_queries(cache.layers[layer], k, g)


def capacity(args: argparse.Namespace, model: torch.nn.Module, variants: list[Variant]) -> list[dict]:
    """Largest batch within the budget per variant, confirmed by decode steps at that batch."""
    budget = int(args.budget_gib * 2**30)
    n = args.context
    dtype = DTYPES[args.dtype]
    vocab = model.config.vocab_size
    out = []
    for v in variants:
        probe = v.build(model.config, args.window)
        _fill(model, probe, 1, n, args.device, dtype)
        token = torch.randint(3, vocab, (1, 1), device=args.device)
        with _attention(model, v), torch.inference_mode():
            model(token, cache=probe, use_cache=True)  # one step: demotions and flushes settle
        per_seq = held_bytes(probe)
        del probe
        fit = max(1, budget // per_seq) if args.max_batch is None else min(max(1, budget // per_seq), args.max_batch)
        cache = v.build(model.config, args.window)
        _fill(model, cache, fit, n, args.device, dtype)
        step = DecodeStep(model, cache, torch.randint(3, vocab, (fit, 1), device=args.device))
        m = interleaved({v.name: step}, number=args.steps, repeats=args.reps, threads=_threads(args),
                        around=lambda _, v=v: _decoding(model, v), clock=device_clock(args.device))[v.name]  # fmt: skip
        ms = m.median * 1e3
        held = held_bytes(cache)
        row = dict(variant=v.name, context=n, bytes_per_sequence=per_seq, batch=fit, bytes_held=held,
                   within_budget=held <= budget, decode_ms=ms, tokens_per_s=fit * 1e3 / ms,
                   decode_iqr_ms=m.iqr * 1e3)  # fmt: skip
        out.append(row)
        print(
            f"  {v.name:<30} {per_seq / 2**20:9.2f} MiB/seq  batch {fit:>4}  held {held / 2**30:6.3f} GiB  "
            f"{ms:8.1f} ms/step  {row['tokens_per_s']:8.1f} tok/s",
            flush=True,
        )
        del cache
    return out


# ---------------------------------------------------------------------- output
def table(rows: list[Row]) -> str:
    """The latency rows as a text table (``IQR``: the interquartile range of the decode ms/token rounds)."""
    head = (
        f"{'length':>7} {'batch':>5} {'cache':<30} {'prefill ms':>11} {'decode ms/tok':>14} {'IQR':>6} {'x dyn':>6} "
        f"{'MiB held':>9} {'x dyn':>6} {'bits/el':>8} {'@16-bit':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.length:>7} {r.batch:>5} {r.variant:<30} {r.prefill_ms:>11.1f} {r.decode_ms:>14.2f} "
            f"{r.decode_iqr_ms:>6.2f} {r.ratio_ms:>6.2f} "
            f"{r.bytes_held / 2**20:>9.1f} {r.ratio_bytes:>6.3f} {r.bits_per_element:>8.2f} {r.bits16:>8.2f}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Decode ms/token and MiB held against context length (:mod:`kvpolicy_lab.bench.sweep_plot`)."""
    from kvpolicy_lab.bench.sweep_plot import plot as sweep_plot

    sweep_plot(rows, path, title)


# ---------------------------------------------------------------------- CLI
def _variant(text: str) -> str:
    """A cache variant name that :meth:`Variant.parse` understands."""
    try:
        Variant.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``kvpolicy bench decode``; each value is checked at parse time."""
    from kvpolicy.commands._parser import add_list
    from kvpolicy.commands._types import positive_int, token_count
    from kvpolicy_lab.commands._types import non_negative_int, out_dir, positive_float

    parser.add_argument("--mode", choices=("latency", "capacity"), default="latency",
                        help="latency: ms/token and bytes per length and batch; capacity: the largest batch within "
                        "--budget-gib (see the description)")  # fmt: skip
    model_options(parser)
    add_list(parser, "--lengths", token_count, default=[1024, 2048, 4096, 8192, 16384], metavar="TOKENS",
             help="latency mode: context lengths (e.g. 1k 8k 16384)")  # fmt: skip
    add_list(parser, "--batch", positive_int, default=[1], metavar="N", help="latency mode: batch sizes")
    add_list(parser, "--caches", _variant, default=list(DEFAULT_VARIANTS), metavar="CACHE",
             help="cache variants: dynamic, one-liner, preset:<file.toml|preset|preset file name>, "
             "hf-<quanto|hqq>-<bits>, "
             "<policy>-<bits|kKvV>-<backend>-<ordered|agnostic>-<fused|mat>[-rot][-mse|-kmse]")  # fmt: skip
    parser.add_argument("--fill", choices=("model", "synthetic"), default="model",
                        help="latency mode: prefill with the model (timed), or fill caches with random keys/values "
                        "by Cache.update (no prefill time; for long contexts on slow machines)")  # fmt: skip
    parser.add_argument("--window", type=positive_int, default=42, help="policy window (log: W; recent: window)")
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="timed decode steps per variant per round (after 2 untimed ones)")  # fmt: skip
    parser.add_argument("--reps", type=positive_int, default=5, help="timed rounds (median, IQR)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="latency mode: untimed rounds first")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")  # fmt: skip
    parser.add_argument("--budget-gib", type=positive_float, default=1.0, help="capacity mode: cache budget in GiB")
    parser.add_argument("--context", type=token_count, default=8192, help="capacity mode: tokens per sequence (8k...)")
    parser.add_argument("--max-batch", type=positive_int, default=None,
                        help="capacity mode: cap the confirmed batch (default: no cap)")  # fmt: skip
    parser.add_argument("--out", type=out_dir, default=Path("bench-decode"), metavar="DIR",
                        help="directory for decode.json and decode.png (capacity.json in capacity mode)")  # fmt: skip


def model_options(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype``, ``--device`` and ``--online``, shared with ``kvpolicy bench memory``."""
    from kvpolicy.commands._types import DTYPES as NAMES
    from kvpolicy.commands._types import dtype_name, model_name
    from kvpolicy_lab.commands._types import available_device

    parser.add_argument("--model", type=model_name, default="smollm2",
                        help=f"{', '.join(MODELS)} (this benchmark's 4-layer random Llama), any model kvpolicy "
                        "ablate --model takes (tiny-<family>[-LAYERS], a .gguf file, a hub id), or a local model "
                        "directory (no tokenizer needed: the prompts are random token ids)")  # fmt: skip
    parser.add_argument("--dtype", type=dtype_name, choices=NAMES, default="float32", help="model dtype")
    parser.add_argument("--device", type=available_device, default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--online", action="store_true", help="allow downloading a hub model")


def check_model(args: argparse.Namespace) -> None:
    """Before any work: stay offline unless ``--online``, and refuse a model that cannot be found here."""
    import os

    from kvpolicy_lab.eval.grid import check_model_available

    if not args.online:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missing model fails in seconds, not after retries
    if args.model != "tiny-llama":
        check_model_available(args.model, args.online)


def run(args: argparse.Namespace) -> int:
    check_model(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = [Variant.parse(name) for name in args.caches]
    for v in variants:  # construct once: an unavailable backend fails before any model runs
        if v.kind in ("kv", "one-liner", "preset"):
            v.build(None, args.window)
    model = load(args.model, DTYPES[args.dtype], args.device, args.online)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(model=args.model, dtype=args.dtype, device=args.device, threads=_threads(args),
                torch=torch.__version__, machine=platform.processor() or platform.machine(),
                timer="torch.utils.benchmark.Timer", steps=args.steps, reps=args.reps,
                warmup_rounds=args.warmup if args.mode == "latency" else 0,
                warmup_steps_per_rep=warmup_calls(args.steps))  # fmt: skip
    if args.mode == "capacity":
        print(f"capacity: {args.context} tokens/sequence, budget {args.budget_gib} GiB, {args.model} {args.dtype}")
        rows = capacity(args, model, variants)
        (args.out / "capacity.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        print(f"wrote {args.out / 'capacity.json'}")
        return 0
    rows = latency(args, model, variants)
    print(table(rows))
    (args.out / "decode.json").write_text(json.dumps(dict(meta=meta, rows=[asdict(r) for r in rows]), indent=1))
    plot(rows, args.out / "decode.png", f"{args.model} {args.dtype} {args.device}")
    print(f"wrote {args.out / 'decode.json'} and {args.out / 'decode.png'}")
    return 0
