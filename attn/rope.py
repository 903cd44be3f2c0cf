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

from attn.casts import cast

__all__ = ["RopeScaling", "RotaryEmbedding", "inverse_frequencies", "rotate", "rotate_by"]


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint stretches RoPE's frequencies (``rope_scaling`` in ``config.json``).

    Attributes:
        kind: ``"linear"`` (every frequency divided by ``factor``), ``"llama3"`` (Llama 3.1+:
            low frequencies divided by ``factor``, high ones kept, a smooth blend between) or
            ``"yarn"`` (YaRN, Qwen2.5/Qwen3's long context: the same three bands, counted in
            turns per original context, and the attention logits scaled up).
        factor: the stretch.
        low_freq_factor, high_freq_factor: ``llama3`` only: the wavelength band, as fractions
            of ``original_max_seq_len``, over which the blend runs.
        original_max_seq_len: ``llama3`` and ``yarn``: the context the model was pretrained on.
        beta_fast, beta_slow: ``yarn`` only: channel pairs that turn more than ``beta_fast``
            times over the original context are kept, fewer than ``beta_slow`` times
            stretched, and those between blend.
        attention_factor: ``yarn`` only: cos and sin are multiplied by it (so q.k by its
            square); None: ``0.1 ln(factor) + 1``, the paper's.
        truncate: ``yarn`` only: round the blend's channel bounds outwards to whole pairs
            (transformers' default; False for checkpoints that say ``"truncate": false``).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "llama3", "yarn"):
            raise ValueError(f"RopeScaling.kind must be 'linear', 'llama3' or 'yarn', got {self.kind!r}")
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be positive, got {self.factor!r}")
        if self.original_max_seq_len <= 0:
            raise ValueError(f"RopeScaling.original_max_seq_len must be positive, got {self.original_max_seq_len}")
        if self.kind == "yarn" and not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(
                f"RopeScaling (yarn) needs 0 < beta_slow ({self.beta_slow}) <= beta_fast ({self.beta_fast})"
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"RopeScaling.attention_factor must be positive, got {self.attention_factor!r}")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling needs 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                f"({self.high_freq_factor})"
            )

    @property
    def attention_scale(self) -> float:
        """What cos and sin are multiplied by: 1, except for ``yarn``."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def inverse_frequencies(
    head_dim: int, base: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The (d/2,) fp32 angular frequencies: channel pair i turns ``base ** (-2i/d)`` per position,
    then stretched by ``scaling``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    positions_per_radian = base**exponents  # (d/2,)
    inv_freq = 1.0 / positions_per_radian  # (d/2,)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(positions_per_radian, head_dim, base, scaling)
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


def _yarn(positions_per_radian: torch.Tensor, head_dim: int, base: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN's blend of the (d/2,) frequencies: pair i keeps its frequency if it turns more than
    ``beta_fast`` times over the original context, is divided by ``factor`` if fewer than
    ``beta_slow`` times, and blends linearly in i between."""

    def pair_turning(turns: float) -> float:  # the (fractional) pair that turns `turns` times
        return head_dim * math.log(scaling.original_max_seq_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    first, last = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        first, last = math.floor(first), math.ceil(last)
    first, last = max(first, 0), min(last, head_dim - 1)
    span = last - first if last != first else 0.001
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=positions_per_radian.device)
    kept = 1 - ((pairs - first) / span).clamp(0, 1)  # (d/2,): 1 keeps the frequency, 0 stretches it
    stretched = 1.0 / (scaling.factor * positions_per_radian)
    return stretched * (1 - kept) + (1.0 / positions_per_radian) * kept  # (d/2,)


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
            scale = 1.0 if self.scaling is None else self.scaling.attention_scale
            sin = angles.sin()
            sin[:, : self.head_dim // 2] *= -1  # pre-signed for ``rotate``'s roll, which needs no negation
            return torch.stack((angles.cos(), sin)) * scale  # (2, L, d)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # Follow device moves, but rebuild the table in fp32 instead of casting it.
        super()._apply(fn, recurse)
        self.cos_sin = self._table(self.cos_sin.device)
        return self

    def extra_repr(self) -> str:
        scaling = "" if self.scaling is None else f", scaling={self.scaling}"
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, base={self.base}{scaling}"

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """The cosines and (first half negated) sines at ``positions``, (s,) or (b, s), gathered
        once per pass for every layer (``attn.plan``), stacked in one tensor (a compiled layer region takes no
        two views of one tensor): (2, s, d), or (2, b, 1, s, d) to broadcast over heads."""
        rotation = self.cos_sin[:, positions]  # (2, s, d) or (2, b, s, d)
        return rotation.unsqueeze(2) if positions.dim() == 2 else rotation

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` (b, h, s, d) at positions ``input_pos``, (s,) or (b, s)."""
        return rotate(x, self.rotation(input_pos))


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` (b, h, s, d) by ``rotation`` from ``RotaryEmbedding.rotation``, in fp32,
    and casts back to ``x``'s dtype.

    The textbook form is ``x * cos + cat(-x2, x1) * sin`` (x1, x2: the halves of ``x``). The
    table's sines come with their first half negated, so ``roll(x) * sin`` is the same product
    bit for bit (a sign commutes exactly with a product) in two ops fewer a call.
    """
    return rotate_by(x, rotation[0], rotation[1])


def rotate_by(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``rotate`` with the rotation's two halves taken apart once for every head group:
    ``cos`` and ``signed_sin``, each (s, d) or (b, 1, s, d)."""
    x32 = cast(x, torch.float32)
    return cast(x32 * cos + x32.roll(x.shape[-1] // 2, -1) * signed_sin, x.dtype)
