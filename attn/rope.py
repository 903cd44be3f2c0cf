"""Rotary position embeddings (RoPE), Llama's rotate-half layout, with the scalings that
checkpoints use to stretch RoPE past the context they were trained on.

Shapes: b = batch, h = heads, s = sequence, d = head dim (even).

The cos/sin table is computed once for ``max_seq_len`` positions and always kept in fp32,
even after ``model.to(torch.bfloat16)``: positions far down the table lose too much to a
bf16 round trip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RopeScaling", "RotaryEmbedding", "inverse_frequencies"]


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE's frequencies (``rope_scaling`` in ``config.json``).

    Attributes:
        kind: ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"`` (Llama
            3.1+: low frequencies divided by ``factor``, high ones kept, a smooth blend
            between).
        factor: the stretch.
        low_freq_factor, high_freq_factor: ``llama3`` only: the wavelength band, as fractions
            of ``original_max_seq_len``, over which the blend runs.
        original_max_seq_len: ``llama3`` only: the context the model was pretrained on.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3"):
            raise ValueError(f"RopeScaling.kind must be 'linear' or 'llama3', got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor!r}")
        if self.kind == "llama3":
            if not 0 < self.low_freq_factor < self.high_freq_factor:
                raise ValueError(
                    f"RopeScaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                    f"({self.high_freq_factor})"
                )
            if self.original_max_seq_len <= 0:
                raise ValueError(f"RopeScaling.original_max_seq_len must be positive, got {self.original_max_seq_len}")


def inverse_frequencies(
    head_dim: int, base: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The (d/2,) fp32 angular frequencies: channel pair i turns ``base ** (-2i/d)`` per position,
    then stretched by ``scaling``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (base**exponents)  # (d/2,)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the pretrained context / low_freq_factor are stretched
    # by factor, shorter than context / high_freq_factor are kept, and those between blend
    # linearly in (context / wavelength).
    context = scaling.original_max_seq_len
    wavelength = 2 * math.pi / inv_freq  # (d/2,)
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    stretched = torch.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    in_band = (wavelength >= context / scaling.high_freq_factor) & (wavelength <= context / scaling.low_freq_factor)
    return torch.where(in_band, blended, stretched)


class RotaryEmbedding(nn.Module):
    """Rotates pairs of channels ``(i, i + d/2)`` by an angle proportional to the position.

    Args:
        head_dim: size of each head (d); must be even.
        max_seq_len: number of positions in the table.
        base: the RoPE base (``rope_theta``).
        scaling: a ``RopeScaling`` of the frequencies, or None for plain RoPE.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, base: float = 10_000.0, scaling: RopeScaling | None = None
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.base = base
        self.scaling = scaling
        self.register_buffer("cos_sin", self._table(torch.device("cpu")), persistent=False)

    def _table(self, device: torch.device) -> torch.Tensor:
        with torch.inference_mode(False):
            inv_freq = inverse_frequencies(self.head_dim, self.base, self.scaling, device)  # (d/2,)
            positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=device)
            angles = torch.outer(positions, inv_freq)  # (L, d/2)
            angles = torch.cat((angles, angles), dim=-1)  # (L, d)
            return torch.stack((angles.cos(), angles.sin()))  # (2, L, d)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Follow device moves, but rebuild the table in fp32 instead of casting it.
        super()._apply(fn, recurse)
        self.cos_sin = self._table(self.cos_sin.device)
        return self

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, base={self.base}{scaling}"

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` (b, h, s, d) at positions ``input_pos``, (s,) or (b, s)."""
        cos, sin = self.cos_sin[:, input_pos]  # each (s, d) or (b, s, d)
        if input_pos.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, s, d)
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)  # each (b, h, s, d/2)
        rotated = torch.cat((-x2, x1), dim=-1)  # (b, h, s, d)
        return (x32 * cos + rotated * sin).to(x.dtype)
