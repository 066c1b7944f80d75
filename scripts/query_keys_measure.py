"""Where key error meets the queries: query-aware key quantization on SmolLM2-135M-Instruct.

One text of calibration files (``--context`` prefill tokens + ``--tokens`` later tokens, one causal
forward pass; keys and queries after RoPE, as a cache and its attention see them). Per layer and KV
head, the prefill's keys are quantized and scored by the *later* tokens' queries (those of the KV head's
query heads), which none of the fits below saw: the reported figure is the relative score error
``Σ (q · e)² / Σ (q · (k − μ))²`` summed over every head, query and key (``μ``: the prefill keys' mean).

Schemes (bits per element of keys, metadata included; the per-stream centre and weights are not counted,
they add ``16 · 64 / n`` or ``32 · 64 / n`` bits at ``n`` tokens: 0.5–1 % at 2k):

- ``minmax-ch``: min-max groups of 128 tokens per channel (KIVI's layout, mean-squared-error fitted ranges);
- ``channel boost``: the same with the ``c`` channels of highest sensitivity at 4 bits and the rest at 2 (the
  idea of Kitty); sensitivity ``range_c²`` (keys alone) or ``E[q_c²] · range_c²`` (with the prefill's queries);
- ``codebook``: the centred Lloyd-Max codebook after the Hadamard rotation (kvpolicy's ``scheme="codebook"``,
  ``key_centre=True``, ``transform="hadamard"``);
- ``codebook, diagonal``: keys multiplied per channel by ``w_c = (m_c / κ_c) ** 0.25`` before the rotation
  (``transform="query-hadamard"``: ``m`` the prefill queries' second moments, ``κ`` the prefill keys'
  variances); ``in the rotated basis``: the same weights computed and applied after the rotation;
- ``codebook, full matrix``: keys multiplied by ``A`` with ``A Aᵀ`` the geometric mean of ``Σ_k⁻¹`` and
  ``Σ_q`` (the matrix form of the same optimum), queries by ``A⁻ᵀ``; it needs a ``head_dim²`` matrix per
  layer, head and batch row, 0.5 bits per key element at 2k tokens in float16.

Result (``--context 2048 --tokens 256``, 30 layers × 3 KV heads, head_dim 64):

| scheme | bits/el | relative score error |
|---|---|---|
| minmax-ch 2-bit | 2.25 | 0.078 |
| codebook 2-bit | 2.25 | 0.101 |
| codebook 2-bit, diagonal, in the rotated basis | 2.25 | 0.104 |
| codebook 2-bit, diagonal | 2.25 | 0.071 |
| codebook 2-bit, full matrix | 2.25 (+0.5) | 0.056 |
| channel boost c=8, by range² | 2.50 | 0.042 |
| channel boost c=8, by E[q²] · range² | 2.50 | 0.031 |
| channel boost c=16, by range² | 2.75 | 0.025 |
| channel boost c=16, by E[q²] · range² | 2.75 | 0.019 |
| minmax-ch 3-bit | 3.25 | 0.023 |
| codebook 3-bit | 3.25 | 0.028 |
| codebook 3-bit, diagonal, in the rotated basis | 3.25 | 0.029 |
| codebook 3-bit, diagonal | 3.25 | 0.020 |
| codebook 3-bit, full matrix | 3.25 (+0.5) | 0.015 |

Weighting before the rotation cuts the codebook's score error by 30 %, for 64 float32 numbers per row,
layer and head; weights applied after it do nothing (the rotation has already spread the channels, and
unequal coordinates no longer suit the Gaussian codebook). The full matrix does better but its bytes cost
more than a bit of codebook buys. Channel boosts with query-weighted sensitivity are strong too, but mix two
code widths in one key, which no kernel of kvpolicy reads.

Usage::

    python scripts/query_keys_measure.py --context 2048 --tokens 256
"""

from __future__ import annotations

import argparse

import torch

from kvpolicy.formats.codebook import Codebook
from kvpolicy.formats.packed import MinMax
from kvpolicy.transforms.hadamard import Hadamard


def capture(context: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys ``(H, n, D)`` per layer and queries ``(H, g, n, D)`` (the ``g`` query heads of each KV head)."""
    from lowrank_measure import calibration_forward  # this folder's script: one forward over calibration text

    keys, _, queries = calibration_forward(context, tokens)
    return keys, queries


def minmax(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` ``(1, n, D)`` through min-max groups of 128 tokens per channel (whole groups only)."""
    n = x.shape[1] - x.shape[1] % 128
    fmt = MinMax(bits=bits, group_size=128, axis="channel", fit="mse")
    return fmt.quantize(x[None, :, :n].contiguous()).dequantize()[0].float()


def boost(x: torch.Tensor, sensitivity: torch.Tensor, c: int) -> torch.Tensor:
    """The ``c`` channels of highest ``sensitivity`` ``(D,)`` at 4 bits, the others at 2."""
    d = x.shape[-1]
    hi = sensitivity.topk(c).indices
    lo = torch.tensor([i for i in range(d) if i not in set(hi.tolist())])
    a, b = minmax(x[..., hi], 4), minmax(x[..., lo], 2)
    out = torch.empty(1, a.shape[1], d)
    out[..., hi], out[..., lo] = a, b
    return out


def codebook(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Centred codebook reconstruction of rotated ``y`` ``(1, n, D)``."""
    fmt = Codebook(bits=bits, meta_dtype="auto", centre=True)
    return fmt.quantize(y[None], centre=y.mean(1, keepdim=True)[None]).dequantize()[0].float()


def sqrtm(a: torch.Tensor) -> torch.Tensor:
    w, v = torch.linalg.eigh(a)
    return (v * w.clamp_min(1e-12).sqrt()) @ v.T


def schemes(x: torch.Tensor, qp: torch.Tensor, rot: Hadamard) -> dict[str, tuple[float, torch.Tensor]]:
    """Reconstructions of one head's prefill keys ``x`` ``(1, n, D)`` given its prefill queries ``qp`` ``(m, D)``."""
    d, n = x.shape[-1], x.shape[1]
    xc = x - x.mean(1, keepdim=True)
    m_q = (qp**2).mean(0)
    kappa = (xc[0] ** 2).mean(0)
    w = (m_q / kappa.clamp_min(1e-12)).pow(0.25)
    y = rot.forward(x)
    yq = rot.forward(qp)
    w_rot = ((yq**2).mean(0) / ((y - y.mean(1, keepdim=True))[0] ** 2).mean(0).clamp_min(1e-12)).pow(0.25)
    eye = 1e-6 * torch.eye(d)
    s_k, s_q = xc[0].T @ xc[0] / n + eye, qp.T @ qp / qp.shape[0] + eye
    root = sqrtm(s_k)
    inv_root = torch.linalg.inv(root)
    a = torch.linalg.cholesky(inv_root @ sqrtm(root @ s_q @ root) @ inv_root)
    rng = (x.amax(1) - x.amin(1))[0]
    out = {}
    for bits in (2, 3):
        out[f"minmax-ch {bits}-bit"] = (bits + 0.25, minmax(x, bits))
        out[f"codebook {bits}-bit"] = (bits + 0.25, rot.inverse(codebook(y, bits)))
        out[f"codebook {bits}-bit, diagonal"] = (bits + 0.25, rot.inverse(codebook(rot.forward(x * w), bits)) / w)
        out[f"codebook {bits}-bit, diagonal, in the rotated basis"] = (
            bits + 0.25, rot.inverse(codebook(y * w_rot, bits) / w_rot)
        )  # fmt: skip
        out[f"codebook {bits}-bit, full matrix"] = (
            bits + 0.25, rot.inverse(codebook(rot.forward(x @ a), bits)) @ torch.linalg.inv(a)
        )  # fmt: skip
    for c in (8, 16):
        out[f"channel boost c={c}, by range²"] = (2.25 + 2 * c / d, boost(x, rng**2, c))
        out[f"channel boost c={c}, by E[q²] · range²"] = (2.25 + 2 * c / d, boost(x, m_q * rng**2, c))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    keys, queries = capture(args.context, args.tokens)
    rot = Hadamard(0)
    acc: dict[str, list[float]] = {}
    for k, q in zip(keys, queries, strict=True):
        heads, _, d = k.shape
        for h in range(heads):
            prefill_q = q[h, :, : args.context].reshape(-1, d)
            later_q = q[h, :, args.context :].reshape(-1, d)
            gram = later_q.T @ later_q
            x = k[h : h + 1, : args.context]
            xc = (x - x.mean(1, keepdim=True))[0]
            ref = float((xc @ gram * xc).sum())
            for name, (bits, recon) in schemes(x, prefill_q, rot).items():
                m = recon.shape[1]  # per-channel groups: whole groups only
                e = (recon - x[:, :m])[0]
                row = acc.setdefault(name, [bits, 0.0, 0.0])
                row[1] += float((e @ gram * e).sum())
                row[2] += ref * m / args.context
    print("| scheme | bits/el | relative score error |\n|---|---|---|")
    for name, (bits, err, ref) in sorted(acc.items(), key=lambda t: (t[1][0], -t[1][1] / t[1][2])):
        print(f"| {name} | {bits:.2f} | {err / ref:.3f} |")


if __name__ == "__main__":
    main()
