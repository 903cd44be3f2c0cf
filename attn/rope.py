"""Rotary position embeddings (RoPE), Llama's rotate-half layout.

Shapes: b = batch, h = heads, s = sequence, d = head dim (even).

The cos/sin table is computed once for ``max_seq_len`` positions and always kept in fp32,
even after ``model.to(torch.bfloat16)``: positions far down the table lose too much to a
bf16 round trip.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotates pairs of channels ``(i, i + d/2)`` by an angle proportional to the position.

    Args:
        head_dim: size of each head (d); must be even.
        max_seq_len: number of positions in the table.
        base: the RoPE base (``rope_theta``).
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10_000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.base = base
        self.register_buffer("cos_sin", self._table(torch.device("cpu")), persistent=False)

    def _table(self, device: torch.device) -> torch.Tensor:
        with torch.inference_mode(False):
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
            inv_freq = 1.0 / (self.base**exponents)  # (d/2,)
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
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, base={self.base}"

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` (b, h, s, d) at positions ``input_pos``, (s,) or (b, s)."""
        cos, sin = self.cos_sin[:, input_pos]  # each (s, d) or (b, s, d)
        if input_pos.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (b, 1, s, d)
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)  # each (b, h, s, d/2)
        rotated = torch.cat((-x2, x1), dim=-1)  # (b, h, s, d)
        return (x32 * cos + rotated * sin).to(x.dtype)
