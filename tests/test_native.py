"""attn.native: the few-row bf16 kernel ``attn::bf16_matvec`` against a float64 reference,
its errors, and what happens where it cannot be built."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attn.native
from attn.native import BF16_MATVEC_MAX_ROWS, bf16_matvec_available, build_bf16_matvec

from .conftest import needs_bf16_matvec


def _bf16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_bf16_matvec
@given(
    outputs=st.integers(1, 70),  # blocks of 4 or 2 weight rows, and the rest
    features=st.integers(1, 140),  # 32 features a dot-product step, and a masked tail
    rows=st.integers(1, BF16_MATVEC_MAX_ROWS),
    layout=st.sampled_from(["(m, k)", "(m, 1, k)", "(1, m, k)"]),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=80, deadline=None)
def test_equals_a_float64_product_rounded_once_to_bf16(outputs, features, rows, layout, bias, threads, seed):
    """Each output is the fp32 sum rounded to bf16 once: within half a bf16 step of the exact
    product, plus the fp32 sum's own error (``features`` roundings of at most the sum of
    magnitudes)."""
    lead = {"(m, k)": (rows,), "(m, 1, k)": (rows, 1), "(1, m, k)": (1, rows)}[layout]
    x, weight = _bf16((*lead, features), seed), _bf16((outputs, features), seed + 1)
    shift = _bf16((outputs,), seed + 2) if bias else None
    torch.set_num_threads(threads)
    got = torch.ops.attn.bf16_matvec(x, weight, shift)
    assert got.shape == (*lead, outputs) and got.dtype == torch.bfloat16
    flat = x.double().reshape(rows, features)  # (m, k)
    exact = flat @ weight.double().T  # (m, n)
    magnitude = flat.abs() @ weight.double().abs().T
    if shift is not None:
        exact, magnitude = exact + shift.double(), magnitude + shift.double().abs()
    bound = exact.abs() * 2**-8 + magnitude * (features + 1) * 2**-23
    error = (got.double().reshape(rows, outputs) - exact).abs()
    assert bool((error <= bound).all()), f"worst error {float((error - bound).max()):.3g} past the bound"


@needs_bf16_matvec
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_close_to_f_linear_on_decode_shapes(rows):
    """The SmolLM2-135M shape's products and head: within one bf16 step of F.linear (both sum in
    fp32, in different orders), and equal in almost every output."""
    for outputs, features in [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]:
        x, weight = _bf16((rows, 1, features), outputs), _bf16((outputs, features), features)
        got, expected = torch.ops.attn.bf16_matvec(x, weight, None), F.linear(x, weight)
        step = expected.abs().float() * 2**-7 + 2**-20
        assert bool(((got.float() - expected.float()).abs() <= step).all()), (outputs, features)
        assert (got == expected).float().mean().item() > 0.95, (outputs, features)


@needs_bf16_matvec
@pytest.mark.parametrize(
    ("x", "weight", "bias", "message"),
    [
        (torch.ones(1, 8), torch.ones(4, 8), None, "takes bf16 tensors"),
        (
            torch.ones(9, 8, dtype=torch.bfloat16),
            torch.ones(4, 8, dtype=torch.bfloat16),
            None,
            "1 to 8 rows of x, got 9",
        ),
        (torch.ones(1, 6, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16), None, "end in the weight's 8"),
        (torch.ones(1, 4, dtype=torch.bfloat16), torch.ones(8, 4, dtype=torch.bfloat16).T, None, "contiguous"),
        (
            torch.ones(1, 8, dtype=torch.bfloat16),
            torch.ones(4, 8, dtype=torch.bfloat16),
            torch.ones(5, dtype=torch.bfloat16),
            r"bf16 \(4,\) vector",
        ),
    ],
)
def test_bad_input_names_the_values(x, weight, bias, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.attn.bf16_matvec(x, weight, bias)


def test_a_cpu_without_avx512_bf16_is_told_so_and_not_offered_the_kernel(monkeypatch):
    monkeypatch.setattr(attn.native, "_has_avx512_bf16", lambda: False)
    bf16_matvec_available.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="needs an x86 CPU with AVX512-BF16"):
            build_bf16_matvec()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not a build failure: no warning
            assert bf16_matvec_available() is False
    finally:
        bf16_matvec_available.cache_clear()


def test_a_failed_build_warns_once_with_the_compilers_error(monkeypatch):
    def fail(**kwargs):
        raise RuntimeError("Error building extension 'x': [1/2] c++ ...\nbf16_matvec.cpp:1:10: error: no compiler here")

    from torch.utils import cpp_extension

    monkeypatch.setattr(attn.native, "_has_avx512_bf16", lambda: True)
    monkeypatch.setattr(attn.native, "_built", False)  # as in a process that has not loaded it yet
    monkeypatch.setattr(cpp_extension, "load", fail)
    bf16_matvec_available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="error: no compiler here.*inductor's reductions"):
            assert bf16_matvec_available() is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert bf16_matvec_available() is False  # answered once: no second warning
    finally:
        bf16_matvec_available.cache_clear()
