"""How much shared low-rank structure keys and values of SmolLM2-135M-Instruct have, and what it buys.

One text of calibration files (``--context`` prefill tokens + ``--tokens`` later tokens, one causal
forward pass: the keys and values each token gets are those the cache would see, after RoPE), rotated
by the cache's Hadamard transform (seed 0). Per layer and KV head: ``μ`` the prefill mean, ``U`` the
top-``r`` right singular vectors of the centred prefill. Reported, averaged over layers and heads:

- energy: the share of ``‖x − μ‖²`` that ``(x − μ) U`` keeps, on the prefill and on later tokens
  by distance from the end of the prefill;
- MSE (relative: ``‖x − x̂‖² / ‖x − μ‖²`` summed over tokens) and bits per element of centred
  codebook quantization at 1-4 bits against rank-``r`` coefficients (16 or 8 bits each; 8-bit with
  one scale per component, fitted on the prefill) plus a codebook residual. The residual is
  quantized in ``D`` dims; ``proj`` reconstructs ``μ + c Uᵀ + P⊥ r̂`` (the residual's quantization
  noise along ``U`` removed: the true residual has none there).

Bits per element: ``bits + 16 / D`` for a codebook vector (its scale), plus ``r · cbits / D`` for
the coefficients; the basis and centre, stored once per stream, are not counted here (at ``n``
tokens they add ``16 · (r + 1) / n`` bits: 0.07 at r = 8, n = 2048).

Queries: the score error ``Σ (q · e)²`` is summed over the queries of the ``--tokens`` later tokens
(the query heads of each KV head) and every key, relative to ``Σ (q · (x − μ))²``.

Result (``--context 2048 --tokens 256``, 30 layers × 3 KV heads, head_dim 64): centred keys and
values are far from low-rank. Rank 8 keeps 46 % of the keys' centred energy on the prefill and 38 %
on the later tokens (41 % at distance 1-64, 36 % at 129-256; values 39-40 %, steady); rank 16 keeps
66 % / 56 %. Removing a fraction ``e`` of the energy for ``r · cbits`` bits per vector pays only when
``1 − e`` is below the codebook's error ratio per bit (3.4× from 2 to 3 bits), i.e. ``e > 71 %`` for
the 64 bits of one more codebook bit; the best head reaches 58 % (keys) at rank 8. At equal bits
every low-rank variant loses, by MSE and by score error: 3.25 bits/el, keys, later tokens: codebook
3-bit MSE 0.032 (score error 0.0095) against rank 8 with 8-bit coefficients + 2-bit codebook residual
0.063 (0.019), rank 4 with 16-bit coefficients + 2-bit 0.082 (0.025); 2.25 bits: codebook 2-bit
0.115 (0.037) against rank 8 / 8-bit + 1-bit 0.22 (0.071). Values alike (0.033 against 0.062 at
3.25 bits). Per head, no key head and 3 of 90 value heads gain at equal bits, so an energy threshold
or shrinkage per head would not help either. Further out (``--tokens 2048``), rank 8 keeps 31 % of the
keys' energy at 513-1,024 tokens after the prefill and 27 % at 1,025-2,048, and the share of the later
queries' scores it keeps falls from 47 % (1-64) to 11 % (1,025-2,048); the values' stays at 35-43 %.

Usage::

    python scripts/lowrank_measure.py --context 2048 --tokens 256
    python scripts/lowrank_measure.py --context 2048 --tokens 2048
"""

from __future__ import annotations

import argparse
import math

import torch

from kvpolicy.transforms.hadamard import Hadamard

RANKS = (1, 2, 4, 8, 16)
#: distances from the end of the prefill whose energy is reported (those that start within ``--tokens``)
ALL_BINS = ((1, 64), (65, 128), (129, 256), (257, 512), (513, 1024), (1025, 2048), (2049, 4096))
BINS = ALL_BINS[:3]


def lloyd(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids and boundaries of the Lloyd-Max quantizer of N(0, 1) (1-4 bits)."""
    if bits >= 2:
        from kvpolicy.formats.codebook import lloyd_max

        c, e, _ = lloyd_max(bits)
        return torch.tensor(c), torch.tensor(e)
    m = math.sqrt(2 / math.pi)
    return torch.tensor([-m, m]), torch.tensor([0.0])


def codebook(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Norm-corrected codebook reconstruction of ``x`` ``(n, D)`` (scale rounded to float16)."""
    c, e = lloyd(bits)
    d = x.shape[-1]
    norm = x.norm(dim=-1, keepdim=True)
    u = x * (math.sqrt(d) / norm.clamp_min(1e-30))
    q = c[torch.bucketize(u, e, right=True)]
    s = (norm / q.norm(dim=-1, keepdim=True)).half().float()
    return q * s


def calibration_forward(context: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One causal forward of SmolLM2-135M-Instruct over ``context + tokens`` tokens of calibration files: each
    layer's keys and values ``(H, n, D)`` (after RoPE, as a cache holds them) and queries after RoPE
    ``(H, g, n, D)`` (the ``g`` query heads of each KV head), float32."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvpolicy_lab.eval.models import load_smollm2
    from kvpolicy_lab.eval.tasks import CALIBRATION_FILES, encode, stdlib_text

    model, tok = load_smollm2()
    ids: list[int] = []
    for name in CALIBRATION_FILES:
        ids += encode(tok, stdlib_text(name))
        if len(ids) >= context + tokens:
            break
    ids = ids[: context + tokens]
    cache = DynamicCache()
    queries: list[torch.Tensor] = []

    def grab(module, args, kwargs):  # the layer's queries after RoPE
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        d = module.head_dim
        q = module.q_proj(h).view(1, h.shape[1], -1, d).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        queries.append(q[0].reshape(module.config.num_key_value_heads, -1, h.shape[1], d).float())

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    keys = [layer.keys[0].float() for layer in cache.layers]
    return keys, [layer.values[0].float() for layer in cache.layers], queries


def capture(context: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values ``(H, n, D)`` per layer for one calibration text, Hadamard-rotated, and the
    queries of the later tokens ``(H, g * tokens, D)`` (the ``g`` query heads of each KV head), rotated
    alike (a rotation keeps ``q · k``)."""
    keys, values, queries = calibration_forward(context, tokens)
    rot = Hadamard(0)
    later = [q[:, :, context:].reshape(q.shape[0], -1, q.shape[-1]) for q in queries]
    return [rot.forward(k) for k in keys], [rot.forward(v) for v in values], [rot.forward(q) for q in later]


def coefficients(c: torch.Tensor, cbits: int, scale: torch.Tensor) -> torch.Tensor:
    """``c`` rounded to ``cbits`` (16: float16; 8: int8 on a per-component ``scale``, clamped)."""
    if cbits == 16:
        return c.half().float()
    top = 2 ** (cbits - 1) - 1
    return (c / scale).round().clamp(-top, top) * scale


def add(out: dict, key: tuple, err: torch.Tensor, gram: torch.Tensor | None, parts: dict) -> None:
    """Add ``‖e‖²`` (and ``Σ (q · e)²`` over the later queries, under ``("q", *key)``) per part."""
    for k, s in parts.items():
        e = err[s]
        out[(*key, k)] = out.get((*key, k), 0.0) + float(e.pow(2).sum())
        if gram is not None:
            out[("q", *key, k)] = out.get(("q", *key, k), 0.0) + float(((e @ gram) * e).sum())


def analyse(x: torch.Tensor, context: int, out: dict, q: torch.Tensor | None = None) -> None:
    """Accumulate energy and error sums for one head's vectors ``x`` ``(n, D)`` (and, given the later
    queries ``q`` ``(m, D)`` of this KV head, the query-weighted errors)."""
    gram = None if q is None else q.T @ q
    pre = x[:context]
    mu = pre.mean(0, keepdim=True).half().float()
    xc = x - mu
    _, _, vh = torch.linalg.svd(xc[:context], full_matrices=False)
    parts = {"prefill": slice(0, context), "decode": slice(context, None)}
    for lo, hi in BINS:
        parts[f"d{lo}-{hi}"] = slice(context + lo - 1, context + hi)
    add(out, ("total",), xc, gram, parts)
    for r in RANKS:
        u = vh[:r].T.half().float()
        add(out, ("energy", r), (xc @ u) @ u.T, gram, parts)
    for bits in (1, 2, 3, 4):
        add(out, ("cb", bits), codebook(xc, bits) - xc, gram, parts)
    for r in RANKS:
        u = vh[:r].T.half().float()
        c_pre = xc[:context] @ u
        scale8 = c_pre.abs().amax(0) * 1.25 / 127
        for cbits in (16, 8):
            c = coefficients(xc @ u, cbits, scale8)
            res = xc - c @ u.T
            for bits in (1, 2, 3):
                rhat = codebook(res, bits)
                for proj in (False, True):
                    rh = rhat - (rhat @ u) @ u.T if proj else rhat
                    add(out, ("lr", r, cbits, bits, proj), c @ u.T + rh - xc, gram, parts)


def energy_table(title: str, acc: dict, prefix: tuple, parts: list[str]) -> None:
    """One row per rank: the share of ``acc[(*prefix, "total", part)]`` rank ``r`` keeps, per part."""
    print(f"\n## {title}")
    print("| r | " + " | ".join(parts) + " |")
    print("|---" * (len(parts) + 1) + "|")
    for r in RANKS:
        row = [f"{100 * acc[(*prefix, 'energy', r, p)] / acc[(*prefix, 'total', p)]:.1f} %" for p in parts]
        print(f"| {r} | " + " | ".join(row) + " |")


def report(name: str, acc: dict, d: int) -> None:
    """Print the energy tables and the error table of one stream (keys or values), summed over heads."""
    parts = ["prefill", "decode", *(f"d{lo}-{hi}" for lo, hi in BINS)]
    energy_table(f"{name}: energy of x - mu captured by rank r (fitted on prefill)", acc, (), parts)
    if ("q", "total", "prefill") in acc:
        title = f"{name}: share of sum (q.(x - mu))^2 over the later queries that rank r keeps"
        energy_table(title, acc, ("q",), parts)
    weighted = ("q", "total", "prefill") in acc
    print(
        f"\n## {name}: relative MSE ||x - x_hat||^2 / ||x - mu||^2 (prefill / decode)"
        + (", and relative score error sum (q.e)^2 / sum (q.(x - mu))^2 over the later queries" if weighted else "")
    )
    print("| scheme | bits/el | prefill | decode |" + (" q-err prefill | q-err decode |" if weighted else ""))
    print("|---|---|---|---|" + ("---|---|" if weighted else ""))
    rows = []

    def rel(key: tuple) -> tuple[float, ...]:
        out = [acc[(*key, p)] / acc[("total", p)] for p in ("prefill", "decode")]
        if weighted:
            out += [acc[("q", *key, p)] / acc[("q", "total", p)] for p in ("prefill", "decode")]
        return tuple(out)

    for bits in (1, 2, 3, 4):
        rows.append((bits + 16 / d, f"codebook {bits}b centred", *rel(("cb", bits))))
    for r in RANKS:
        for cbits in (16, 8):
            for bits in (1, 2, 3):
                for proj in (False, True):
                    k = ("lr", r, cbits, bits, proj)
                    label = f"r{r} c{cbits} + cb{bits}{' proj' if proj else ''}"
                    rows.append((bits + 16 / d + r * cbits / d, label, *rel(k)))
    for b, label, *errs in sorted(rows):
        if b <= 4.6:
            print(f"| {label} | {b:.3f} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    global BINS
    BINS = tuple(b for b in ALL_BINS if b[0] <= args.tokens)
    torch.manual_seed(0)
    keys, values, queries = capture(args.context, args.tokens)
    for name, tensors, qs in (("keys", keys, queries), ("values", values, None)):
        acc: dict = {}
        heads = []
        for i, layer in enumerate(tensors):
            for h, head in enumerate(layer):
                one: dict = {}
                analyse(head, args.context, one, None if qs is None else qs[i][h])
                heads.append(one)
                for k, v in one.items():
                    acc[k] = acc.get(k, 0.0) + v
        report(name, acc, tensors[0].shape[-1])
        per_head(name, heads, tensors[0].shape[-1])


def per_head(name: str, heads: list[dict], d: int) -> None:
    """Whether any head has enough low-rank structure for an energy threshold to pick a rank."""
    print(f"\n## {name}: per head ({len(heads)} heads), decode tokens")
    print("| r | energy min | median | max | heads where r c8 + cb1 proj beats the codebook of as many bits or more "
          "| same for r c8 + cb2 proj |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in RANKS:
        share = sorted(h[("energy", r, "decode")] / h[("total", "decode")] for h in heads)
        row = f"{100 * share[0]:.1f} % | {100 * share[len(share) // 2]:.1f} % | {100 * share[-1]:.1f} %"
        cells = []
        for bits in (1, 2):
            lr_bits = bits + 16 / d + r * 8 / d
            cb = math.ceil(lr_bits - 16 / d - 1e-9)  # the codebook width whose bits/el are >= lr_bits
            wins = (
                sum(h[("lr", r, 8, bits, True, "decode")] < h[("cb", cb, "decode")] for h in heads) if cb <= 4 else "-"
            )
            cells.append(f"{wins} (vs cb{cb}, {lr_bits:.3f} vs {cb + 16 / d:.2f} bits)")
        print(f"| {r} | {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
