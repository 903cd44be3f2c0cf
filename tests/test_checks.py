"""attn/checks.py: the shared argument checks accept exactly what their names say."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn.checks import bad_ids, check_positive_int, head_shape, is_int, is_number
from attn.errors import first_line

VALUES = st.one_of(
    st.integers(-5, 5), st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2),
    st.integers(-5, 5).map(np.int64),
)  # fmt: skip


@given(value=VALUES)
def test_is_int_is_a_python_int_and_never_a_bool(value: object) -> None:
    assert is_int(value) == (type(value) is int)


@given(value=VALUES)
def test_is_number_is_any_real_but_a_bool(value: object) -> None:
    expected = type(value) in (int, float, np.int64)
    assert is_number(value) == expected


@given(value=VALUES, or_none=st.booleans())
def test_check_positive_int_names_the_argument_and_the_value(value: object, or_none: bool) -> None:
    ok = (type(value) is int and value > 0) or (or_none and value is None)
    if ok:
        check_positive_int(value, "steps", or_none=or_none)
        return
    suffix = " or None" if or_none else ""
    with pytest.raises(ValueError, match=rf"^steps must be a positive int{suffix}, got "):
        check_positive_int(value, "steps", or_none=or_none)


def test_bad_ids_are_the_ones_outside_the_vocabulary_or_not_integers() -> None:
    ids = [0, 9, 10, -1, True, 2.0, np.int64(3), np.int64(12)]
    assert bad_ids(ids, 10) == [10, -1, True, 2.0, np.int64(12)]


def test_first_line_quotes_the_type_and_the_first_line() -> None:
    assert first_line(ValueError("bad thing\nmore detail")) == "ValueError: bad thing"
    assert first_line(KeyError()) == "KeyError"


@given(
    embed_dim=st.integers(1, 64),
    num_heads=st.integers(-1, 12),
    num_kv_heads=st.one_of(st.none(), st.integers(-1, 12)),
    head_dim=st.one_of(st.none(), st.integers(1, 16)),
)
def test_head_shape_fills_defaults_or_names_what_does_not_divide(embed_dim, num_heads, num_kv_heads, head_dim) -> None:
    kv = num_heads if num_kv_heads is None else num_kv_heads
    groups = num_heads > 0 and kv > 0 and num_heads % kv == 0
    splits = head_dim is not None or (num_heads > 0 and embed_dim % num_heads == 0)
    if not groups:
        with pytest.raises(ValueError, match=rf"num_heads \({num_heads}\) must be a positive multiple of num_kv_heads"):
            head_shape(embed_dim, num_heads, num_kv_heads, head_dim)
    elif not splits:
        with pytest.raises(ValueError, match=rf"embed_dim \({embed_dim}\) is not divisible by num_heads"):
            head_shape(embed_dim, num_heads, num_kv_heads, head_dim)
    else:
        assert head_shape(embed_dim, num_heads, num_kv_heads, head_dim) == (
            kv,
            head_dim if head_dim is not None else embed_dim // num_heads,
        )
