"""attn/masks.py against loops written here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attn import padded_causal_mask, padding_positions
from attn.masks import left_pad, slot_mask


@st.composite
def left_padded(draw: st.DrawFn) -> torch.Tensor:
    width = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(1, width), min_size=1, max_size=4))
    return torch.tensor([[i >= width - n for i in range(width)] for n in lengths])


@given(left_padded())
def test_positions_count_real_tokens(mask: torch.Tensor) -> None:
    positions = padding_positions(mask)
    for row, pos in zip(mask.tolist(), positions.tolist(), strict=True):
        count = 0
        for real, p in zip(row, pos, strict=True):
            if real:
                assert p == count
                count += 1
            else:
                assert p == 0


@given(left_padded())
def test_padded_causal_mask(mask: torch.Tensor) -> None:
    full = padded_causal_mask(mask)
    b, s = mask.shape
    assert full.shape == (b, s, s)
    for r in range(b):
        for i in range(s):
            for j in range(s):
                assert bool(full[r, i, j]) == ((j <= i and bool(mask[r, j])) or i == j)
            assert full[r, i].any()  # no query row attends to nothing


def test_slot_mask_over_cache_slots() -> None:
    key_valid = torch.tensor([[False, True, True, True, True]])
    got = slot_mask(key_valid, torch.tensor([3]))
    assert got.tolist() == [[[False, True, True, True, False]]]


@given(st.lists(st.lists(st.integers(1, 99), min_size=1, max_size=6), min_size=1, max_size=4), st.integers(0, 9))
def test_left_pad_right_aligns_every_row(rows: list[list[int]], pad_id: int) -> None:
    tokens, padding_mask = left_pad(rows, pad_id)
    width = max(len(row) for row in rows)
    assert tokens.shape == padding_mask.shape == (len(rows), width)
    for i, row in enumerate(rows):
        assert tokens[i].tolist() == [pad_id] * (width - len(row)) + row
        assert padding_mask[i].tolist() == [False] * (width - len(row)) + [True] * len(row)
    same, same_mask = left_pad(tokens, pad_id)  # a tensor of rows: already aligned
    assert torch.equal(same, tokens) and bool(same_mask.all())


def test_left_pad_refuses_what_it_cannot_pad() -> None:
    with pytest.raises(ValueError, match=r"rows \[1\] are empty"):
        left_pad([[1], []], 0)
    with pytest.raises(ValueError, match="at least one row"):
        left_pad([], 0)
    with pytest.raises(ValueError, match=r"must be \(batch, seq_len\), got shape \(3,\)"):
        left_pad(torch.tensor([1, 2, 3]), 0)
