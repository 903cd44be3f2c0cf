"""RMSNorm, the one normalization of the decoder (layers, final norm, q/k norms).

Shapes: ... = any leading dims, n = the normalized (last) dim.
"""

from __future__ import annotations

import torch
from torch import nn

from attn.casts import cast

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32.

    Args:
        dim: size of the normalized dim (n).
        eps: added to the mean square.
        unit_offset: Gemma's spelling: the scale is ``1 + weight`` (weights start at 0) and
            is applied in fp32 before the cast back; otherwise (Llama's) the scale is
            ``weight`` (weights start at 1), applied after the cast back.
    """

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., n) -> (..., n), in ``x``'s dtype (promoted with the weight's, Llama's spelling)."""
        x32 = cast(x, torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return cast(normed * (1.0 + cast(self.weight, torch.float32)), x.dtype)
        return self.weight * cast(normed, x.dtype)
