"""Attention masks and positions for left-padded batches.

Shapes: b = batch, s = queries, L = key slots (s without a cache, max_seq_len with one).
A mask is boolean, True where a query may attend to a key.

A padded query row would attend to nothing and give NaN; every query may therefore attend
to its own slot. Its output is garbage that nobody reads, but finite.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["id_sequence", "left_pad", "padded_causal_mask", "padding_positions", "slot_mask"]


def left_pad(
    rows: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
    pad_id: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-aligns id sequences of any lengths into one batch.

    Args:
        rows: a (b, s) id tensor, or b sequences of ids (lists or 1-d tensors).
        pad_id: the id put before the shorter rows.
        device: where the batch goes (default: the CPU).

    Returns:
        ``(tokens, padding_mask)``, each (b, P) with P the longest row: long ids, and bool
        True for real tokens.

    Raises:
        ValueError: no rows, an empty row, a row that is not one sequence (a 2-d tensor, a
            number), ids that are not integers (floats, bools), or a tensor that is not (b, s).

    Example::

        >>> left_pad([[5, 6], [7]], pad_id=0)
        (tensor([[5, 6], [0, 7]]), tensor([[True, True], [False, True]]))
    """
    if isinstance(rows, torch.Tensor) and rows.dim() != 2:
        raise ValueError(f"a tensor of rows must be (batch, seq_len), got shape {tuple(rows.shape)}")
    rows = [id_sequence(row, f"row {i}") for i, row in enumerate(rows)]
    if not rows:
        raise ValueError("left_pad needs at least one row, got an empty batch")
    empty = [i for i, row in enumerate(rows) if row.numel() == 0]
    if empty:
        raise ValueError(f"rows {empty} are empty; every row needs at least one token (e.g. a BOS id)")
    width = max(row.numel() for row in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (b, P)
    padding_mask = torch.zeros((len(rows), width), dtype=torch.bool)  # (b, P)
    for i, row in enumerate(rows):
        tokens[i, width - row.numel() :] = row.cpu()
        padding_mask[i, width - row.numel() :] = True
    return tokens.to(device), padding_mask.to(device)


def id_sequence(row: Sequence[int] | torch.Tensor, name: str) -> torch.Tensor:
    """One sequence of ids (a list, a 1-d tensor or array) as a 1-d long tensor; refuses what
    a cast would change silently. ``name`` says which argument it was, for the error."""
    try:
        ids = torch.as_tensor(row)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name} is not a sequence of int ids: {row!r} ({error})") from None
    if ids.dim() != 1:
        raise ValueError(
            f"{name} must be one sequence of ids (1-d), got shape {tuple(ids.shape)}; pass a (b, s) "
            "tensor itself, not a list holding it"
        )
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):  # [] is float32
        raise ValueError(f"{name} holds {ids.dtype} values, not integer ids: {ids.tolist()[:5]}")
    return ids.long()


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
