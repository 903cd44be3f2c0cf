"""attn/rope.py against a complex-number reference written here."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from attn.rope import RotaryEmbedding

from .reference import reference_rope


@given(
    head_dim=st.sampled_from([2, 4, 8, 16]),
    seq_len=st.integers(1, 9),
    offset=st.integers(0, 40),
    base=st.sampled_from([10_000.0, 500_000.0, 100.0]),
    batched=st.booleans(),
)
def test_matches_complex_reference(head_dim: int, seq_len: int, offset: int, base: float, batched: bool) -> None:
    rope = RotaryEmbedding(head_dim, 64, base)
    x = torch.randn(2, 3, seq_len, head_dim)
    positions = torch.arange(offset, offset + seq_len)
    if batched:
        positions = torch.stack((positions, positions.flip(0)))  # (b, s), rows differ
        expected = reference_rope(x, positions[:, None, :], base)
    else:
        expected = reference_rope(x, positions, base)
    torch.testing.assert_close(rope(x, positions), expected.float(), rtol=1e-5, atol=1e-5)


def test_table_stays_fp32_after_dtype_cast() -> None:
    rope = RotaryEmbedding(8, 4096).to(torch.bfloat16)
    assert rope.cos_sin.dtype == torch.float32
    x = torch.randn(1, 1, 1, 8)
    position = torch.tensor([4000])
    torch.testing.assert_close(rope(x, position), reference_rope(x, position, 10_000.0).float(), rtol=1e-5, atol=1e-5)
