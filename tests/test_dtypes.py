"""attn/dtypes.py: every spelling of a dtype maps to it, and back."""

from __future__ import annotations

import pytest
import torch

from attn.dtypes import DTYPES, dtype_from_name, long_name, short_name


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_spelling_round_trips(dtype: torch.dtype) -> None:
    for spelling in (long_name(dtype), short_name(dtype), str(dtype), dtype):
        assert dtype_from_name(spelling) is dtype
    assert str(dtype) == f"torch.{long_name(dtype)}"


@pytest.mark.parametrize("name", ["int8", "fp8", "float64", torch.int64, ""])
def test_other_dtypes_are_refused_naming_the_choices(name: object) -> None:
    with pytest.raises(ValueError, match=r"is not supported; use one of float32 \(fp32\), bfloat16 \(bf16\)"):
        dtype_from_name(name)
