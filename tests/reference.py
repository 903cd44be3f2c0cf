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

    Biases and q/k norms are used when the layer has them, and its score scale and soft-cap
    (Gemma); the sliding window is not (it is part of ``allowed``).

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
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + norm.eps) * norm_scale(norm)

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
            scores = qh @ kh.T * (attention.scale or 1 / math.sqrt(d))  # (s, s)
            if attention.softcap is not None:
                scores = attention.softcap * torch.tanh(scores / attention.softcap)
            scores = scores.masked_fill(~allowed[row], float("-inf"))
            out[row, :, head] = scores.softmax(-1) @ v[row, :, kv_head].double()
    return project(attention.o_proj, out.reshape(b, s, h * d))


def norm_scale(norm: torch.nn.Module) -> torch.Tensor:
    """What an RMSNorm multiplies by: its weight, or 1 + its weight (Gemma's)."""
    return 1 + norm.weight.double() if norm.unit_offset else norm.weight.double()


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
    config = model.config

    def allowed(layer: int) -> torch.Tensor:  # (b, s, s)
        causal = window_band(s, config.window_of(layer))  # slots, as transformers counts them
        return (causal & padding[:, None, :]) | torch.eye(s, dtype=torch.bool)

    def rms(x: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
        if norm is None:  # no sandwich norm here
            return x
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.norm_eps) * norm_scale(norm)

    def gate(x: torch.Tensor) -> torch.Tensor:
        if config.activation == "gelu_tanh":
            return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        return x * torch.sigmoid(x)

    x = model.tok_embeddings.weight.double()[tokens]
    if config.embed_scale:
        x = x * math.sqrt(config.embed_dim)
    for i, layer in enumerate(model.layers):
        attended = reference_attention(rms(x, layer.attn_norm), layer.attn, positions, allowed(i))
        x = x + rms(attended, layer.attn_out_norm)
        hidden = rms(x, layer.mlp_norm)
        product = gate(hidden @ layer.mlp.gate_proj.weight.double().T) * (hidden @ layer.mlp.up_proj.weight.double().T)
        x = x + rms(product @ layer.mlp.down_proj.weight.double().T, layer.mlp_out_norm)
    x = rms(x, model.norm)
    head = model.tok_embeddings.weight if model.output is None else model.output.weight
    logits = x @ head.double().T
    if config.logit_softcap is not None:
        logits = config.logit_softcap * torch.tanh(logits / config.logit_softcap)
    return logits
