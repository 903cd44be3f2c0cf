"""RMSNorm, the one normalization of the Llama family (layers, final norm, Qwen3's q/k norm).

Shapes: ... = any leading dims, n = the normalized (last) dim.
"""

from __future__ import annotations

import torch
from torch import nn

from attn.casts import cast

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32 and cast back before the weight.

    Args:
        dim: size of the normalized dim (n).
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., n) -> (..., n), in ``x``'s dtype (promoted with the weight's)."""
        x32 = cast(x, torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * cast(normed, x.dtype)
