"""attn/masks.py against loops written here."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from attn import padded_causal_mask, padding_positions
from attn.masks import slot_mask


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
