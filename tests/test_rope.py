"""attn/rope.py against a complex-number reference written here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attn.rope import RopeScaling, RotaryEmbedding, inverse_frequencies

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


@given(
    head_dim=st.sampled_from([8, 32, 64, 128]),
    base=st.sampled_from([1e4, 5e5, 1e6]),
    factor=st.floats(1.0, 40.0),
    original=st.integers(16, 65536),
    betas=st.tuples(st.floats(0.5, 64.0), st.floats(0.5, 64.0)).map(sorted),
    truncate=st.booleans(),
)
def test_yarn_frequencies_blend_from_kept_to_stretched(
    head_dim: int, base: float, factor: float, original: int, betas: list[float], truncate: bool
) -> None:
    """Each YaRN frequency lies between the stretched (divided by factor) and the kept one, and
    the share kept only falls from the fast pairs (first) to the slow ones (last)."""
    scaling = RopeScaling(
        "yarn", factor, original_max_seq_len=original, beta_slow=betas[0], beta_fast=betas[1], truncate=truncate
    )
    plain = inverse_frequencies(head_dim, base)
    yarn = inverse_frequencies(head_dim, base, scaling)
    assert ((yarn <= plain * (1 + 1e-6)) & (yarn >= plain / factor * (1 - 1e-6))).all()
    if factor > 1.01:
        kept = (yarn - plain / factor) / (plain - plain / factor)  # (d/2,): 1 kept, 0 stretched
        assert (kept[1:] <= kept[:-1] + 1e-4).all(), kept


def test_yarn_scales_cos_and_sin_by_the_attention_factor() -> None:
    paper = RotaryEmbedding(16, 32, 1e4, RopeScaling("yarn", 4.0, original_max_seq_len=8))
    assert paper.scaling is not None and paper.scaling.attention_scale == pytest.approx(
        0.1 * torch.log(torch.tensor(4.0)).item() + 1
    )
    given_factor = RotaryEmbedding(16, 32, 1e4, RopeScaling("yarn", 4.0, original_max_seq_len=8, attention_factor=1.5))
    unscaled = RotaryEmbedding(16, 32, 1e4)
    unscaled.cos_sin = torch.stack(_angles_table(given_factor))  # the same angles, not scaled
    x, positions = torch.randn(1, 2, 5, 16), torch.arange(20, 25)
    torch.testing.assert_close(given_factor(x, positions), 1.5 * unscaled(x, positions))
    assert RopeScaling("yarn", 1.0, original_max_seq_len=8).attention_scale == 1.0
    assert RopeScaling("llama3", 8.0).attention_scale == 1.0


def _angles_table(rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = inverse_frequencies(rope.head_dim, rope.base, rope.scaling)
    angles = torch.outer(torch.arange(rope.max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    sin = angles.sin()
    sin[:, : rope.head_dim // 2] *= -1  # the table's sines are pre-signed (attn.rope.rotate)
    return angles.cos(), sin


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kind="ntk", factor=2.0), r"kind must be 'linear', 'llama3' or 'yarn', got 'ntk'"),
        (dict(kind="yarn", factor=2.0, beta_fast=1.0, beta_slow=4.0), r"0 < beta_slow \(4.0\) <= beta_fast \(1.0\)"),
        (dict(kind="yarn", factor=2.0, attention_factor=0.0), r"attention_factor must be positive, got 0.0"),
        (dict(kind="yarn", factor=2.0, original_max_seq_len=0), r"original_max_seq_len must be positive, got 0"),
    ],
)
def test_bad_scalings_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RopeScaling(**kwargs)


@given(
    head_dim=st.sampled_from([2, 8, 64]),
    seq_len=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scaled=st.booleans(),
)
def test_rotation_equals_the_textbook_form_bit_for_bit(
    head_dim: int, seq_len: int, dtype: torch.dtype, scaled: bool
) -> None:
    """``x * cos + cat(-x2, x1) * sin`` with the plain sines, written here, equals ``rotate``."""
    scaling = RopeScaling("yarn", 4.0, original_max_seq_len=8) if scaled else None
    rope = RotaryEmbedding(head_dim, 32, 1e4, scaling)
    cos, sin = _angles_table(rope)
    scale = 1.0 if scaling is None else scaling.attention_scale
    cos, plain_sin = cos * scale, sin * scale
    plain_sin[:, : head_dim // 2] *= -1  # back to the plain sines
    x = torch.randn(2, 3, seq_len, head_dim).to(dtype)
    positions = torch.arange(3, 3 + seq_len)
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    expected = (x32 * cos[positions] + torch.cat((-x2, x1), dim=-1) * plain_sin[positions]).to(dtype)
    assert torch.equal(rope(x, positions), expected)
