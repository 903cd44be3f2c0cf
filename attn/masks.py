"""Attention masks and positions for left-padded batches.

Shapes: b = batch, s = queries, L = key slots (s without a cache, max_seq_len with one).
A mask is boolean, True where a query may attend to a key.

A padded query row would attend to nothing and give NaN; every query may therefore attend
to its own slot. Its output is garbage that nobody reads, but finite.
"""

from __future__ import annotations

import torch

__all__ = ["padded_causal_mask", "padding_positions", "slot_mask"]


def padding_positions(padding_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions for a left-padded batch: each row counts only its real tokens.

    Args:
        padding_mask: (b, s) bool, True for real tokens.

    Returns:
        (b, s) long; the first real token of each row is at position 0, pads at 0.

    Example::

        >>> padding_positions(torch.tensor([[False, True, True]]))
        tensor([[0, 0, 1]])
    """
    return (padding_mask.long().cumsum(-1) - 1).clamp(min=0)


def slot_mask(key_valid: torch.Tensor, query_slots: torch.Tensor) -> torch.Tensor:
    """Causal mask over key slots, hiding the slots that hold padding.

    Args:
        key_valid: (b, L) bool, True where a slot holds a real token (or will, by the time
            the queries attend: include the queries' own slots).
        query_slots: (s,) long, the slot each query is written to.

    Returns:
        (b, s, L) bool: query i may attend slot j iff ``j <= query_slots[i]`` and slot j is
        valid, or j is its own slot.
    """
    slots = torch.arange(key_valid.shape[-1], device=key_valid.device)  # (L,)
    causal = slots[None, :] <= query_slots[:, None]  # (s, L)
    own = slots[None, :] == query_slots[:, None]  # (s, L)
    return (causal & key_valid[:, None, :]) | own  # (b, s, L)


def padded_causal_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """Causal mask for scoring a left-padded batch without a cache.

    Args:
        padding_mask: (b, s) bool, True for real tokens.

    Returns:
        (b, s, s) bool, for ``model(tokens, input_pos=padding_positions(m), mask=...)``.
    """
    s = padding_mask.shape[-1]
    return slot_mask(padding_mask, torch.arange(s, device=padding_mask.device))
