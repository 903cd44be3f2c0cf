"""The no-cache baseline: greedy decoding that runs the whole sequence again for every token.

Shapes: b = batch, P = prompt width, N = new tokens, v = vocab.

What a decoder without a KV-cache does; the bench's ``attn-nocache`` contender and the demo's
speed comparison both run this one loop. Prompts are left-padded like ``attn.generate`` does,
with the same positions and mask, so its tokens equal ``generate``'s greedy ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from attn.context import disable_kv_cache
from attn.masks import left_pad, padded_causal_mask, padding_positions

__all__ = ["greedy_without_cache"]


def greedy_without_cache(
    model: nn.Module,
    prompts: torch.Tensor | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    pad_id: int = 0,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Greedy generation with a full forward pass over the sequence for every new token.

    Args:
        model: a ``TransformerDecoder`` (its caches, if any, are left alone).
        prompts: a (b, P) id tensor or b id lists of any lengths.
        max_new_tokens: N.
        pad_id: the id the shorter prompts are left-padded with.
        on_step: called with each step's (b, v) logits, as soon as they are computed.

    Returns:
        (b, P + N) long: the padded prompts, then the generated tokens.
    """
    device = next(model.parameters()).device
    tokens, real = left_pad(prompts, pad_id, device)  # each (b, P)
    layers = getattr(model, "_orig_mod", model)
    with torch.inference_mode(), disable_kv_cache(layers):
        for _ in range(max_new_tokens):
            positions, mask = padding_positions(real), padded_causal_mask(real)
            logits = model(tokens, input_pos=positions, mask=mask, last_only=True)[:, -1]  # (b, v)
            if on_step is not None:
                on_step(logits)
            next_token = logits.float().argmax(-1, keepdim=True)  # (b, 1)
            tokens = torch.cat((tokens, next_token), dim=1)  # (b, s + 1)
            real = torch.cat((real, torch.ones_like(next_token, dtype=torch.bool)), dim=1)  # (b, s + 1)
    return tokens.clone()
