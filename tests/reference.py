"""Naive reference implementations, written for the tests and sharing no code with attn.

Slow and obvious on purpose: explicit loops over heads, float64, explicit masks.
"""

from __future__ import annotations

import math

import torch


def reference_rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE as a complex product: channel i pairs with channel i + d/2."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angles = positions.to(torch.float64)[..., None] * freqs  # (..., s, d/2)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rotation
    return torch.cat((pairs.real, pairs.imag), dim=-1)


def reference_attention(
    x: torch.Tensor,
    attention: torch.nn.Module,
    positions: torch.Tensor,
    allowed: torch.Tensor,
) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V head by head, in float64.

    Biases and q/k norms are used when the layer has them; the sliding window is not (it is
    part of ``allowed``).

    Args:
        x: (b, s, e); attention: an attn.MultiHeadAttention (weights only are used);
        positions: (b, s); allowed: (b, s, s) bool.
    """
    b, s, _ = x.shape
    h, h_kv, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    x = x.double()

    def project(linear: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        out = inputs @ linear.weight.double().T
        return out if linear.bias is None else out + linear.bias.double()

    def head_norm(t: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
        if norm is None:
            return t
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()

    q = head_norm(project(attention.q_proj, x).view(b, s, h, d), attention.q_norm)
    k = head_norm(project(attention.k_proj, x).view(b, s, h_kv, d), attention.k_norm)
    v = project(attention.v_proj, x).view(b, s, h_kv, d)
    base = attention.rope.base
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    for row in range(b):
        for head in range(h):
            kv_head = head // (h // h_kv)
            qh = reference_rope(q[row, :, head], positions[row], base)  # (s, d)
            kh = reference_rope(k[row, :, kv_head], positions[row], base)  # (s, d)
            scores = qh @ kh.T / math.sqrt(d)  # (s, s)
            scores = scores.masked_fill(~allowed[row], float("-inf"))
            out[row, :, head] = scores.softmax(-1) @ v[row, :, kv_head].double()
    return project(attention.o_proj, out.reshape(b, s, h * d))


def window_band(s: int, window: int | None) -> torch.Tensor:
    """(s, s) bool: query i may see key j iff j <= i and, with a window, i - j < window."""
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        allowed &= torch.ones(s, s, dtype=torch.bool).triu(-(window - 1))
    return allowed


def reference_decoder(
    model: torch.nn.Module, tokens: torch.Tensor, padding: torch.Tensor | None = None
) -> torch.Tensor:
    """Full recomputation of a TransformerDecoder's logits, float64, no cache.

    ``padding`` (b, s) bool marks real tokens of a left-padded batch (default: all real).
    """
    b, s = tokens.shape
    if padding is None:
        padding = torch.ones(b, s, dtype=torch.bool)
    positions = (padding.long().cumsum(-1) - 1).clamp(min=0)
    causal = window_band(s, model.config.sliding_window)  # slots, as transformers counts them
    allowed = (causal & padding[:, None, :]) | torch.eye(s, dtype=torch.bool)  # (b, s, s)
    eps = model.config.norm_eps

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()

    x = model.tok_embeddings.weight.double()[tokens]
    for layer in model.layers:
        x = x + reference_attention(rms(x, layer.attn_norm.weight), layer.attn, positions, allowed)
        hidden = rms(x, layer.mlp_norm.weight)
        gate = hidden @ layer.mlp.gate_proj.weight.double().T
        up = hidden @ layer.mlp.up_proj.weight.double().T
        x = x + (torch.nn.functional.silu(gate) * up) @ layer.mlp.down_proj.weight.double().T
    x = rms(x, model.norm.weight)
    head = model.tok_embeddings.weight if model.output is None else model.output.weight
    return x @ head.double().T
