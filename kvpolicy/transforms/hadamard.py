"""The ``"hadamard"`` transform: a randomized Hadamard rotation per head (QuaRot, TurboQuant).

``R = diag(s) · H / √B``: random signs ``s`` (±1 per channel, drawn from ``seed``) followed by a
Walsh-Hadamard matrix ``H`` of order ``B``. After it, each coordinate is a signed mix of every
channel of its block, so the few outlier channels of keys stop dominating their quantization
groups and coordinates come close to Gaussian.

Head dims that are not a power of two use a block-diagonal ``H``: blocks of the largest power of
two ``B`` dividing ``head_dim`` (``head_dim=96``: three blocks of 32; ``80``: five of 16), at
least :data:`MIN_BLOCK`. ``R`` is built once per ``(seed, head_dim, device)`` with the fast
transform (``O(B log B)`` per row) and applied as one matrix product: on CPU at ``head_dim ≤ 256``
one ``(n, d) @ (d, d)`` product is 8-25× faster than ``log2(B)`` butterfly passes in torch
(docs/explanation/transforms.md has the measurement). The matrix (``head_dim² × 4`` bytes, 16 KiB at 64) is
shared by every layer and cache of a process and counted once in a memory report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpolicy.errors import ConfigError
from kvpolicy.transforms.base import Transform

#: the smallest Hadamard block served (a head_dim must be a multiple of it)
MIN_BLOCK = 8
#: the largest seed: ``torch.Generator.manual_seed`` takes ``0 <= seed < 2**64``
MAX_SEED = 2**64 - 1


def block_size(head_dim: int) -> int:
    """The largest power of two dividing ``head_dim``: the order of each Hadamard block."""
    return head_dim & -head_dim


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised fast Walsh-Hadamard transform over the last dim (a power of two), ``O(n log n)``.

    Parameters
    ----------
    x : torch.Tensor
        ``(..., n)``.

    Returns
    -------
    torch.Tensor
        ``(..., n)``: ``x H`` with ``H`` the Sylvester-ordered Hadamard matrix (entries ±1).
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"walsh_hadamard needs a power-of-two length; got {n}")
    shape = x.shape
    h = 1
    while h < n:
        pairs = x.reshape(-1, n // (2 * h), 2, h)
        x = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return x.reshape(shape)


@dataclass(frozen=True)
class Hadamard(Transform):
    """Randomized Hadamard rotation of demoted keys and values, the same for every head and layer.

    Parameters
    ----------
    seed : int
        Draws the random signs (a CPU ``torch.Generator``: the same seed gives the same rotation in
        every process and on every device); ``0 <= seed <= 2**64 - 1`` (:data:`MAX_SEED`).
    """

    seed: int = 0

    name = "hadamard"

    def __post_init__(self) -> None:
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
            raise ConfigError(
                f"Hadamard: seed must be an integer in [0, 2**64 - 1] (the seeds a torch.Generator takes); "
                f"got seed={seed!r}"
            )
        # built on first use per (head_dim, device); not a dataclass field (not a parameter)
        object.__setattr__(self, "_matrices", {})

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % MIN_BLOCK:
            raise ConfigError(
                f"Hadamard: head_dim={head_dim} is not a multiple of {MIN_BLOCK}; the rotation uses Hadamard blocks "
                f"of the largest power of two dividing head_dim (at least {MIN_BLOCK}), so head_dim must be a "
                f"multiple of {MIN_BLOCK} (e.g. 64, 80, 96, 128, 256); use transform='none' for this model"
            )

    def matrix(self, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``R``: ``(head_dim, head_dim)`` float32, orthogonal (``R Rᵀ = I``), on ``device``."""
        device = torch.device(device)
        key = (head_dim, str(device))
        m = self._matrices.get(key)
        if m is None:
            self.check_head_dim(head_dim)
            m = self._matrices.setdefault(key, self._build(head_dim).to(device))
        return m

    def _build(self, head_dim: int) -> torch.Tensor:
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
        b = block_size(head_dim)
        blocks = walsh_hadamard(torch.eye(b, dtype=torch.float64)) / b**0.5  # symmetric, orthogonal
        h = torch.block_diag(*[blocks] * (head_dim // b))
        return (signs[:, None] * h).to(torch.float32).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _apply(x, self.matrix(x.shape[-1], x.device))

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return _apply(y, self.matrix(y.shape[-1], y.device).T)

    def held(self, head_dim: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"rotation": self.matrix(head_dim, device)}


def _apply(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``x @ m`` computed in float32 (or wider), returned in ``x``'s dtype."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return torch.matmul(x.to(wide), m.to(wide)).to(x.dtype)
