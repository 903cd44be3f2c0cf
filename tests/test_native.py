"""attn.native: the few-row kernels ``attn::bf16_matvec``, ``attn::fp32_linear``,
``attn::amx_linear`` and ``attn::avx2_linear``, the
few-query attention kernel ``attn::decode_attention`` and the decoder layers' step
``attn::decode_layers`` against float64 references, the samplers' ``attn::first_argmax`` and
``attn::keep_top_k`` against ``torch.max`` and ``topk``, their errors, and what happens where they cannot be built."""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import attn.native
from attn.native import (
    AMX_FROM_ROWS,
    AMX_LINEAR_MAX_ROWS,
    AVX2_LINEAR_MAX_ROWS,
    BF16_MATVEC_MAX_ROWS,
    FP32_LINEAR_MAX_ROWS,
    KEEP_TOP_K_MOST,
    bf16_linear_kernel,
    bf16_matvec_available,
    build_native,
    decode_attention_available,
    decode_layers_available,
    native_product,
)

from .conftest import (
    OperatorCalls,
    avx2_only,
    examples,
    naive_attention,
    needs_amx,
    needs_avx2,
    needs_avx512,
    needs_bf16_matvec,
    tiny_model,
)


def _bf16(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _assert_product_rounded_once(op, outputs, features, rows, layout, bias, threads, seed, dtype=torch.bfloat16):
    """Each output is the fp32 sum rounded once to the dtype: within half a step of the exact
    product (bf16: 2^-8 relative, fp32: none more), plus the fp32 sum's own error (``features``
    roundings of at most the sum of magnitudes)."""
    lead = {"(m, k)": (rows,), "(m, 1, k)": (rows, 1), "(1, m, k)": (1, rows)}[layout]
    values = lambda shape, seed: _bf16(shape, seed).to(dtype)  # noqa: E731 - bf16 values, exact in fp32 too
    x, weight = values((*lead, features), seed), values((outputs, features), seed + 1)
    shift = values((outputs,), seed + 2) if bias else None
    torch.set_num_threads(threads)
    got = op(x, weight, shift)
    assert got.shape == (*lead, outputs) and got.dtype == dtype
    flat = x.double().reshape(rows, features)  # (m, k)
    exact = flat @ weight.double().T  # (m, n)
    magnitude = flat.abs() @ weight.double().abs().T
    if shift is not None:
        exact, magnitude = exact + shift.double(), magnitude + shift.double().abs()
    bound = exact.abs() * (2**-8 if dtype == torch.bfloat16 else 0) + magnitude * (features + 1) * 2**-23
    error = (got.double().reshape(rows, outputs) - exact).abs()
    assert bool((error <= bound).all()), f"worst error {float((error - bound).max()):.3g} past the bound"


_LAYOUTS = st.sampled_from(["(m, k)", "(m, 1, k)", "(1, m, k)"])


@needs_bf16_matvec
@given(
    outputs=st.integers(1, 70),  # blocks of 4 or 3 weight rows, and the rest
    # 32 features a dot-product step, and a masked tail; past 8 rows, an x over 32 KB turns every
    # other block's passes around (9 rows need 1821 features)
    features=st.integers(1, 140) | st.integers(1821, 1900),
    rows=st.integers(1, BF16_MATVEC_MAX_ROWS),
    layout=_LAYOUTS,
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
# two rows read one weight row a pass, three read four: each side of that choice, with a tail
@example(outputs=70, features=140, rows=2, layout="(m, k)", bias=True, threads=2, seed=1)
@example(outputs=70, features=140, rows=3, layout="(m, 1, k)", bias=False, threads=1, seed=2)
@example(outputs=70, features=1900, rows=16, layout="(m, k)", bias=True, threads=2, seed=3)  # passes turned
@settings(max_examples=examples(80), deadline=None)
def test_matvec_equals_a_float64_product_rounded_once_to_bf16(outputs, features, rows, layout, bias, threads, seed):
    _assert_product_rounded_once(torch.ops.attn.bf16_matvec, outputs, features, rows, layout, bias, threads, seed)


_EXACT_TERMS = st.tuples(st.integers(-255, 255), st.integers(-7, 7))  # m 2^e: 8 bits, exact in bf16


@needs_bf16_matvec
@given(
    terms=st.lists(st.tuples(_EXACT_TERMS, _EXACT_TERMS, _EXACT_TERMS), min_size=1, max_size=9),
    rows=st.integers(1, BF16_MATVEC_MAX_ROWS),
    bias=st.booleans(),
)
@example(terms=[((128, 0), (1, -1), (0, 0))], rows=1, bias=False)  # 128.5: a tie, down to 128 (even)
@example(terms=[((131, 0), (1, -1), (0, 0))], rows=16, bias=True)  # 131.5: a tie, up to 132
@settings(max_examples=examples(60), deadline=None)
def test_matvec_rounds_each_sum_as_torch_rounds_fp32_to_bf16(terms, rows, bias):
    """a + b (+ c), each of 8 significant bits with exponents 14 apart at most, is exact in fp32
    (24 bits); the kernel's bf16 output is then that sum as torch rounds it (nearest, ties to even)."""
    values = torch.tensor([[m * 2.0**e for m, e in row] for row in terms], dtype=torch.float64)  # (n, 3)
    weight = values[:, :2].to(torch.bfloat16)  # (n, 2): exact
    shift = values[:, 2].to(torch.bfloat16) if bias else None  # (n,)
    got = torch.ops.attn.bf16_matvec(torch.ones(rows, 2, dtype=torch.bfloat16), weight, shift)  # (rows, n)
    exact = values[:, 0] + values[:, 1] + (values[:, 2] if bias else 0)  # (n,)
    assert torch.equal(exact.float().double(), exact)  # the fp32 sum is exact
    want = exact.float().to(torch.bfloat16).expand(rows, -1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_bf16_matvec
def test_matvec_rounds_a_nan_sum_to_torchs_nan():
    x = torch.tensor([[1.0, float("nan")], [1.0, 2.0]], dtype=torch.bfloat16)
    got = torch.ops.attn.bf16_matvec(x, torch.ones(5, 2, dtype=torch.bfloat16), None)  # (2, 5)
    nan = torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16)  # 0x7fc0
    assert torch.equal(got[0].view(torch.int16), nan.expand(5))
    assert torch.equal(got[1], torch.full((5,), 3.0, dtype=torch.bfloat16))


@needs_bf16_matvec
@given(
    outputs=st.integers(1, 70),  # blocks of 4, 2 or 1 weight rows, and the rest
    # 16 features a step, and a masked tail; past 8 rows, an x over 32 KB turns every other
    # block's passes around (9 rows need 911 features)
    features=st.integers(1, 80) | st.integers(911, 960),
    rows=st.integers(1, FP32_LINEAR_MAX_ROWS),
    layout=_LAYOUTS,
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
@example(outputs=70, features=960, rows=16, layout="(m, k)", bias=True, threads=2, seed=3)  # passes turned
@settings(max_examples=examples(80), deadline=None)
def test_fp32_equals_a_float64_product(outputs, features, rows, layout, bias, threads, seed):
    _assert_product_rounded_once(
        torch.ops.attn.fp32_linear, outputs, features, rows, layout, bias, threads, seed, dtype=torch.float32
    )


@needs_avx2
@given(
    outputs=st.integers(1, 70),  # 48 weight rows a thread's unit, blocks of rows_per_pass, and the rest
    features=st.integers(1, 100) | st.integers(1821, 1900),  # 16-row tiles' passes turned (few_rows_linear)
    rows=st.integers(1, 3 * BF16_MATVEC_MAX_ROWS + 5),  # tiles of 16 rows, the last one fewer
    layout=_LAYOUTS,
    threads=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
@settings(max_examples=examples(80), deadline=None)
def test_invariant_linear_rows_are_the_few_row_kernels_row_alone(
    outputs, features, rows, layout, threads, dtype, seed, data
):
    """Each row of ``invariant_linear`` is, bit for bit, what the CPU's few-row kernel
    (``bf16_matvec`` or ``fp32_linear`` with AVX512-BF16, else ``avx2_linear``) gives that row
    alone, whatever the other rows and the row's place among them; and the product is the
    float64 product rounded once."""
    op = lambda x, weight, bias: torch.ops.attn.invariant_linear(x, weight)  # noqa: E731 - no bias
    _assert_product_rounded_once(op, outputs, features, rows, layout, False, threads, seed, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)  # all of fp32's bits: products that round, as in a model
    x, weight = (
        torch.randn(rows, features, generator=gen).to(dtype),
        torch.randn(outputs, features, generator=gen).to(dtype),
    )
    got = torch.ops.attn.invariant_linear(x, weight)  # (rows, outputs)
    alone = torch.ops.attn.avx2_linear
    if bf16_matvec_available():
        alone = torch.ops.attn.bf16_matvec if dtype == torch.bfloat16 else torch.ops.attn.fp32_linear
    row = data.draw(st.integers(0, rows - 1), label="row")
    assert torch.equal(got[row : row + 1], alone(x[row : row + 1], weight, None))
    shuffled = torch.randperm(rows, generator=gen)
    assert torch.equal(torch.ops.attn.invariant_linear(x[shuffled], weight), got[shuffled])


@needs_avx2
@given(
    outputs=st.integers(1, 70),  # blocks of 4, 3 or 1 weight rows, and the rest
    features=st.integers(1, 80),  # 16 features a step, and a tail summed one by one
    rows=st.integers(1, AVX2_LINEAR_MAX_ROWS),  # passes of up to 4 rows
    layout=_LAYOUTS,
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(80), deadline=None)
def test_avx2_equals_a_float64_product_rounded_once(outputs, features, rows, layout, bias, threads, dtype, seed):
    _assert_product_rounded_once(
        torch.ops.attn.avx2_linear, outputs, features, rows, layout, bias, threads, seed, dtype=dtype
    )


@needs_amx
@given(
    outputs=st.integers(1, 200),  # blocks of 16 outputs, a short last one, threads' shares
    steps=st.integers(1, 5),  # 32 features a tile
    rows=st.integers(1, AMX_LINEAR_MAX_ROWS),  # one tile of 16 rows or two, zero-padded
    layout=_LAYOUTS,
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(80), deadline=None)
def test_amx_equals_a_float64_product_rounded_once_to_bf16(outputs, steps, rows, layout, bias, threads, seed):
    _assert_product_rounded_once(torch.ops.attn.amx_linear, outputs, 32 * steps, rows, layout, bias, threads, seed)


@needs_amx
def test_each_row_count_gets_the_faster_kernel():
    amx, matvec = torch.ops.attn.amx_linear.default, torch.ops.attn.bf16_matvec.default
    assert [bf16_linear_kernel(rows, 576) for rows in (1, AMX_FROM_ROWS - 1)] == [matvec, matvec]
    assert [bf16_linear_kernel(rows, 576) for rows in (AMX_FROM_ROWS, 16, AMX_LINEAR_MAX_ROWS)] == [amx] * 3
    assert bf16_linear_kernel(AMX_LINEAR_MAX_ROWS + 1, 576) is None  # a matrix product
    assert bf16_linear_kernel(8, 48) is matvec and bf16_linear_kernel(16, 48) is None  # no tiles: 48 features


@pytest.mark.parametrize(
    ("kernel", "rows", "dtype"),
    [pytest.param("bf16_matvec", rows, torch.bfloat16, marks=needs_bf16_matvec) for rows in (1, 4, 8)]
    + [pytest.param("amx_linear", rows, torch.bfloat16, marks=needs_amx) for rows in (5, 16, 32)]
    + [pytest.param("fp32_linear", rows, torch.float32, marks=needs_bf16_matvec) for rows in (9, 16)]
    + [pytest.param("avx2_linear", rows, torch.bfloat16, marks=needs_avx2) for rows in (1, 3, 16)]
    + [pytest.param("avx2_linear", rows, torch.float32, marks=needs_avx2) for rows in (2, 16)],
)
def test_close_to_f_linear_on_decode_shapes(kernel, rows, dtype):
    """The SmolLM2-135M shape's products and head: within one step of the dtype of F.linear
    (both sum in fp32, in different orders), and equal in almost every bf16 output."""
    for outputs, features in [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]:
        x, weight = _bf16((rows, 1, features), outputs).to(dtype), _bf16((outputs, features), features).to(dtype)
        got, expected = getattr(torch.ops.attn, kernel)(x, weight, None), F.linear(x, weight)
        if dtype == torch.float32:  # sums of 576-1536 products in two orders
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
            continue
        # Each is an fp32 sum rounded once to bf16: half a bf16 step of each result, plus twice
        # the worst-case error of an fp32 sum of `features` products (features * 2^-24 of the
        # sum of their magnitudes), which binds where the products cancel.
        magnitudes = F.linear(x.abs().double(), weight.abs().double())
        bound = (got.double().abs() + expected.double().abs()) * 2**-8 + 2 * features * 2**-24 * magnitudes
        assert bool(((got.double() - expected.double()).abs() <= bound).all()), (outputs, features)
        assert (got == expected).float().mean().item() > 0.95, (outputs, features)


def _bad(kernel, x, weight, bias, message, mark):
    return pytest.param(kernel, x, weight, bias, message, marks=mark)


_BF16 = {"dtype": torch.bfloat16}


@pytest.mark.parametrize(
    ("kernel", "x", "weight", "bias", "message"),
    [
        _bad("bf16_matvec", torch.ones(1, 8), torch.ones(4, 8), None, "takes bf16 tensors", needs_bf16_matvec),
        _bad(
            "bf16_matvec",
            torch.ones(BF16_MATVEC_MAX_ROWS + 1, 8, **_BF16),
            torch.ones(4, 8, **_BF16),
            None,
            f"1 to {BF16_MATVEC_MAX_ROWS} rows of x, got {BF16_MATVEC_MAX_ROWS + 1}",
            needs_bf16_matvec,
        ),
        _bad(
            "bf16_matvec",
            torch.ones(1, 6, **_BF16),
            torch.ones(4, 8, **_BF16),
            None,
            "end in the weight's 8",
            needs_bf16_matvec,
        ),
        _bad(
            "bf16_matvec", torch.ones(1, 4, **_BF16), torch.ones(8, 4, **_BF16).T, None, "contiguous", needs_bf16_matvec
        ),
        _bad(
            "bf16_matvec",
            torch.ones(1, 8, **_BF16),
            torch.ones(4, 8, **_BF16),
            torch.ones(5, **_BF16),
            r"bf16 \(4,\) vector",
            needs_bf16_matvec,
        ),
        _bad(
            "fp32_linear",
            torch.ones(1, 8, **_BF16),
            torch.ones(4, 8, **_BF16),
            None,
            "takes fp32 tensors",
            needs_bf16_matvec,
        ),
        _bad("fp32_linear", torch.ones(17, 8), torch.ones(4, 8), None, "1 to 16 rows of x, got 17", needs_bf16_matvec),
        _bad(
            "fp32_linear", torch.ones(1, 8), torch.ones(4, 8), torch.ones(5), r"fp32 \(4,\) vector", needs_bf16_matvec
        ),
        _bad(
            "avx2_linear",
            torch.ones(1, 8, dtype=torch.half),
            torch.ones(4, 8, dtype=torch.half),
            None,
            "takes bf16 or fp32 tensors, got x Half",
            needs_avx2,
        ),
        _bad("avx2_linear", torch.ones(1, 8, **_BF16), torch.ones(4, 8), None, "takes bf16 tensors", needs_avx2),
        _bad("avx2_linear", torch.ones(17, 8), torch.ones(4, 8), None, "1 to 16 rows of x, got 17", needs_avx2),
        _bad("avx2_linear", torch.ones(1, 6), torch.ones(4, 6).T, None, "contiguous", needs_avx2),
        _bad("avx2_linear", torch.ones(1, 8), torch.ones(4, 8), torch.ones(5), r"\(4,\) vector", needs_avx2),
        _bad(
            "invariant_linear",
            torch.ones(1, 8, dtype=torch.half),
            torch.ones(4, 8, dtype=torch.half),
            None,
            "takes bf16 or fp32 tensors, got x Half",
            needs_avx2,
        ),
        _bad("invariant_linear", torch.ones(0, 8), torch.ones(4, 8), None, "one row of x or more", needs_avx2),
        _bad(
            "invariant_linear",
            torch.ones(3, 8),
            torch.ones(4, 6),
            None,
            r"weight's 6 features, got x \[3, 8\]",
            needs_avx2,
        ),
        _bad("invariant_linear", torch.ones(3, 8, **_BF16), torch.ones(4, 8), None, "bf16", needs_avx2),
        _bad("invariant_linear", torch.ones(1, 6), torch.ones(4, 6).T, None, "contiguous", needs_avx2),
        _bad("amx_linear", torch.ones(1, 32), torch.ones(4, 32), None, "takes bf16 tensors", needs_amx),
        _bad(
            "amx_linear",
            torch.ones(33, 32, **_BF16),
            torch.ones(4, 32, **_BF16),
            None,
            "1 to 32 rows of x, got 33",
            needs_amx,
        ),
        _bad("amx_linear", torch.ones(1, 48, **_BF16), torch.ones(4, 48, **_BF16), None, "a multiple of 32", needs_amx),
        _bad("amx_linear", torch.ones(1, 32, **_BF16), torch.ones(64, 32, **_BF16)[::2], None, "contiguous", needs_amx),
        _bad(
            "amx_linear",
            torch.ones(1, 32, **_BF16),
            torch.ones(4, 32, **_BF16),
            torch.ones(5, **_BF16),
            r"bf16 \(4,\) vector",
            needs_amx,
        ),
    ],
)
def test_bad_input_names_the_values(kernel, x, weight, bias, message):
    arguments = (x, weight) if kernel == "invariant_linear" else (x, weight, bias)  # no bias in its schema
    with pytest.raises(RuntimeError, match=message):
        getattr(torch.ops.attn, kernel)(*arguments)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@needs_avx512
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 9),  # a task takes a kv head's group x queries, up to 16 (more: parts)
    queries=st.integers(1, 2),
    length=st.integers(1, 40),  # 16 slots a vector step of the softmax, and a masked tail
    spare=st.integers(0, 5),  # k and v as views of a cache with more slots
    head_dim=st.sampled_from([16, 32, 48, 64, 128]),  # 64 and 128: unrolled loops; bf16 48: a half load
    dtype=st.sampled_from(sorted(_DTYPES)),
    mask_form=st.sampled_from(["(s, L)", "(b, 1, s, L)", "(b, h, s, L)", "(b, 1, s, 1)", "every other of 2L"]),
    scale=st.sampled_from([None, 0.3]),
    threads=st.sampled_from([1, 2]),
    widen=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(80), deadline=None)
def test_attention_equals_a_float64_loop(
    batch, kv_heads, group, queries, length, spare, head_dim, dtype, mask_form, scale, threads, widen, seed
):
    """fp32 scores, softmax and sums, rounded once to the dtype: within rounding of the exact
    attention of the same (rounded) inputs; a query that may attend nothing gets zeros. bf16
    scores both ways: by vdpbf16ps where the CPU has AVX512-BF16, and from widened rows."""
    gen = torch.Generator().manual_seed(seed)
    heads, kind = kv_heads * group, _DTYPES[dtype]
    q = torch.randn(batch, heads, queries, head_dim, generator=gen).to(kind)
    k, v = (torch.randn(batch, kv_heads, length + spare, head_dim, generator=gen).to(kind)[:, :, :length] for _ in "kv")
    # Slots 1 apart, 0 apart (one bool for every slot of a query), 2 apart (a strided view).
    shapes = {
        "(s, L)": (queries, length),
        "(b, 1, s, L)": (batch, 1, queries, length),
        "(b, h, s, L)": (batch, heads, queries, length),  # the heads of a task with other spans
        "(b, 1, s, 1)": (batch, 1, queries, 1),
        "every other of 2L": (batch, 1, queries, 2 * length),
    }
    mask = torch.rand(shapes[mask_form], generator=gen) < 0.7  # some rows may allow nothing
    mask = mask[..., ::2] if mask_form == "every other of 2L" else mask
    torch.set_num_threads(threads)
    got = torch.ops.attn.decode_attention(q, k, v, mask, head_dim**-0.5 if scale is None else scale, widen)
    assert got.shape == q.shape and got.dtype == kind and got.is_contiguous()
    tolerance = {"fp32": 1e-5, "bf16": 2**-8, "fp16": 2**-10}[dtype]
    expected = naive_attention(q, k, v, mask, scale)
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=1e-5)
    blank = ~mask.expand(batch, heads, queries, length).any(-1)  # (b, h, s)
    assert bool((got[blank] == 0).all())


@needs_avx512
@given(
    length=st.integers(1, 40),
    head_dim=st.sampled_from([16, 64]),
    dtype=st.sampled_from(sorted(_DTYPES)),
    per_head=st.booleans(),
    widen=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(60), deadline=None)
def test_attention_never_reads_a_masked_slot_into_the_output(length, head_dim, dtype, per_head, widen, seed):
    """NaN keys and values in every slot the first head of each kv group may not attend, before
    its last allowed slot and after it, give that head the output that zeros there give: a masked
    slot's score is dropped by selection, not by a weight of 0 times its value, also where the
    group's other head (read in the same pass over the values) may attend the slot."""
    gen = torch.Generator().manual_seed(seed)
    kind = _DTYPES[dtype]
    q = torch.randn(2, 4, 1, head_dim, generator=gen).to(kind)  # heads 0, 1 on kv head 0; 2, 3 on 1
    k, v = (torch.randn(2, 2, length, head_dim, generator=gen).to(kind) for _ in "kv")
    mask = torch.rand(2, 4 if per_head else 1, 1, length, generator=gen) < 0.6
    first = mask[:, ::2] if per_head else mask.expand(2, 2, 1, length)  # (b, kv heads, 1, L)
    hidden = ~first.reshape(2, 2, length, 1)
    attend = functools.partial(torch.ops.attn.decode_attention, q, attn_mask=mask, scale=0.25, widen=widen)
    clean = attend(k.masked_fill(hidden, 0), v.masked_fill(hidden, 0))
    checked = slice(None, None, 2) if per_head else slice(None)  # the others may attend a NaN slot
    # NaN keys and values; NaN values alone (a key's NaN score gets no weight in any head, so
    # only finite keys give the group's other head a NaN value with a weight).
    for keys in (k.masked_fill(hidden, float("nan")), k.masked_fill(hidden, 0)):
        poisoned = attend(keys, v.masked_fill(hidden, float("nan")))
        assert not bool(poisoned[:, checked].isnan().any())
        torch.testing.assert_close(poisoned[:, checked], clean[:, checked], rtol=0, atol=0)


@needs_avx512
@given(
    groups=st.integers(1, 3),
    group=st.integers(1, 4),  # rows that share slots (a fork's copies)
    kv_heads=st.integers(1, 2),
    heads_per_kv=st.sampled_from([1, 3, 9]),  # 9: more than a task's 8 queries of one head
    queries=st.integers(1, 2),
    length=st.integers(1, 40),
    shared_at=st.floats(0, 1),
    head_dim=st.sampled_from([16, 64, 128]),
    dtype=st.sampled_from(sorted(_DTYPES)),
    per_row=st.booleans(),
    threads=st.sampled_from([1, 2]),
    widen=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(60), deadline=None)
def test_attention_reads_shared_slots_from_each_groups_first_row(
    groups, group, kv_heads, heads_per_kv, queries, length, shared_at, head_dim, dtype, per_row, threads, widen, seed
):
    """Rows ``b`` whose first ``shared`` slots copy row ``b - b % group``'s (``fork_caches``):
    the attention that reads those slots from that row (``group``, ``shared``) equals, bit for
    bit, the one that reads every row's own, and stays so with other values in the copies."""
    gen = torch.Generator().manual_seed(seed)
    kind, batch, shared = _DTYPES[dtype], groups * group, int(shared_at * length)
    q = torch.randn(batch, kv_heads * heads_per_kv, queries, head_dim, generator=gen).to(kind)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, generator=gen).to(kind) for _ in "kv")
    for cache in (k, v):
        cache[:, :, :shared] = cache[::group, :, :shared].repeat_interleave(group, 0)
    mask = torch.rand((batch, 1, queries, length) if per_row else (queries, length), generator=gen) < 0.7
    torch.set_num_threads(threads)
    expected = torch.ops.attn.decode_attention(q, k, v, mask, 0.3, widen)
    assert torch.equal(torch.ops.attn.decode_attention(q, k, v, mask, 0.3, widen, group, shared), expected)
    copies = torch.arange(batch) % group != 0
    for cache in (k, v):
        cache[copies, :, :shared] = torch.randn(cache[copies, :, :shared].shape, generator=gen).to(kind)
    assert torch.equal(torch.ops.attn.decode_attention(q, k, v, mask, 0.3, widen, group, shared), expected)


@needs_avx512
@pytest.mark.parametrize(
    ("group", "shared", "message"),
    [
        (3, 0, "group must divide the 4 rows and shared be >= 0 .* got group 3 and shared 0"),
        (0, 0, "got group 0 and shared 0"),
        (2, -1, "got group 2 and shared -1"),
    ],
)
def test_attention_bad_shared_slots_name_the_values(group, shared, message):
    q, k, v, mask = _tensors((4, 2, 1, 16), (4, 1, 4, 16))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.attn.decode_attention(q, k, v, mask, 0.25, False, group, shared)


@needs_avx512
def test_attention_for_cpus_without_avx512_bf16_holds_no_bf16_instruction():
    """The kernel is built for AVX512-BF16 (its vdpbf16ps scores), and its widening instantiations
    run on CPUs with AVX-512 but no BF16 (Ice Lake): the compiler must have put no bf16
    instruction in them, or they would fault there. Read from the built library's object code."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: the object code cannot be read")
    torch.ops.attn.decode_attention(
        *(torch.ones(1, 1, 1, 16) for _ in "qkv"), torch.ones(1, 1, 1, 1, dtype=torch.bool), 1.0
    )
    name = attn.native._extension_name()
    library = next(line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if name in line)
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    bodies = {}  # function name: its instructions
    for block in listing.stdout.split("\n\n"):
        header = re.match(r"[0-9a-f]+ <(.*)>:\n", block)
        if header and "attend<" in header.group(1):
            bodies[header.group(1)] = block[header.end() :]
    widened = {name: body for name, body in bodies.items() if ", false>(" in name}
    bf16_dots = {name: body for name, body in bodies.items() if ", true>(" in name}
    assert widened and bf16_dots, sorted(bodies)
    assert all("vdpbf16ps" in body for body in bf16_dots.values())  # the search sees one where it is
    for name, body in widened.items():
        mnemonics = {line.split()[1] for line in body.splitlines() if len(line.split()) > 1}
        found = sorted(mnemonic for mnemonic in mnemonics if "bf16" in mnemonic)
        assert not found, f"{name}: {found}"


@needs_avx512
def test_attention_on_a_decode_shape_is_rounded_once_and_no_further_from_exact_than_sdpa():
    """The SmolLM2-135M shape at 16 rows (9 heads on 3 kv heads, 64 dims, 192 slots, the last 20
    masked), bf16: each output within half a bf16 step (plus fp32 noise) of the exact attention,
    and no further from it than the stock kernel's (which rounds its weights to bf16)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, 9, 1, 64, generator=gen).bfloat16()
    k, v = (torch.randn(16, 3, 192, 64, generator=gen).bfloat16() for _ in "kv")
    mask = torch.ones(16, 1, 1, 192, dtype=torch.bool)
    mask[..., 172:] = False
    got = torch.ops.attn.decode_attention(q, k, v, mask, 0.125)
    stock = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    exact = naive_attention(q, k, v, mask)
    error = (got.double() - exact).abs()
    assert bool((error <= exact.abs() * 2**-8 + 1e-6).all()), float(error.max())  # bf16: u = 2^-8
    assert error.max() <= (stock.double() - exact).abs().max()


def _tensors(q_shape, kv_shape, dtype=torch.float32, kv_dtype=None, mask_shape=None, mask_dtype=torch.bool):
    q = torch.zeros(q_shape, dtype=dtype)
    k = torch.zeros(kv_shape, dtype=kv_dtype or dtype)
    mask = torch.ones(mask_shape or (1, 1, q_shape[2], kv_shape[2]), dtype=mask_dtype)
    return q, k, k.clone(), mask


@needs_avx512
@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (_tensors((1, 2, 1, 16), (1, 1, 4, 16), kv_dtype=torch.bfloat16), "must share a dtype, got Float, BFloat16"),
        (_tensors((1, 2, 1, 16), (1, 1, 4, 16), dtype=torch.float64), "fp32, bf16 or fp16, got Double"),
        (_tensors((1, 2, 1, 8), (1, 1, 4, 8)), "multiple of 16 up to 512, got 8"),
        (_tensors((1, 3, 1, 16), (1, 2, 4, 16)), "h a multiple of h_kv"),
        (
            _tensors((1, 2, 1, 16), (1, 1, 4, 16), mask_shape=(1, 1, 1, 5)),
            r"broadcast to \(b, h, s, L\) = \(1, 2, 1, 4\)",
        ),
        (_tensors((1, 2, 1, 16), (1, 1, 4, 16), mask_dtype=torch.float32), "takes a bool mask, got Float"),
        (_tensors((1, 2, 16), (1, 1, 4, 16)), r"takes q \(b, h, s, d\)"),
    ],
)
def test_attention_bad_input_names_the_values(tensors, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.attn.decode_attention(*tensors, 0.25)


_SPECIAL_LOGITS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0.0": -0.0, "0.0": 0.0}


@needs_avx2
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 200),  # past 32 and 8 at a time, and their tails
    levels=st.integers(1, 4),  # few distinct values: ties everywhere
    specials=st.lists(st.tuples(st.sampled_from(sorted(_SPECIAL_LOGITS)), st.integers(0, 2**16)), max_size=4),
    transposed=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
@example(rows=1, vocab=40, levels=1, specials=[("nan", 39)], transposed=False, threads=1, seed=0)  # NaN in the tail
@example(rows=2, vocab=9, levels=1, specials=[("-inf", 0)] * 9, transposed=False, threads=1, seed=0)
@settings(max_examples=examples(100), deadline=None)
def test_first_argmax_is_max_indices_ties_nans_and_zeros_included(
    rows, vocab, levels, specials, transposed, threads, seed
):
    """``attn::first_argmax`` gives ``torch.max(x, -1).indices``: the first of tied largest
    values, the first NaN where a row has one, -0.0 and 0.0 alike; for any layout of x."""
    build_native()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-2, levels, (rows, vocab), generator=gen).float()  # (b, v)
    for name, where in specials:
        logits.view(-1)[where % logits.numel()] = _SPECIAL_LOGITS[name]
    if transposed:  # the same values, column-major
        logits = logits.t().contiguous().t()
    torch.set_num_threads(threads)
    assert torch.equal(torch.ops.attn.first_argmax(logits), logits.max(-1).indices)


@needs_avx2
def test_first_argmax_splits_a_vocabulary_of_rows_between_threads():
    """16 rows of 49,152 logits on 2 threads (the rows split between them), ties placed across
    rows and a NaN in one: max's indices."""
    build_native()
    logits = torch.randn(16, 49_152, generator=torch.Generator().manual_seed(0))  # (b, v)
    logits[3, [100, 40_000]] = 9.0  # a tie: the first
    logits[7, [5, 49_151]] = math.nan
    logits[11, -1] = 9.0  # the very last logit
    torch.set_num_threads(2)
    tokens = torch.ops.attn.first_argmax(logits)
    assert torch.equal(tokens, logits.max(-1).indices)
    assert tokens[[3, 7, 11]].tolist() == [100, 5, 49_151]


@needs_avx2
@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.zeros(2, 3, dtype=torch.bfloat16), r"takes fp32 \(b, v\) CPU logits with v >= 1, got \[2, 3\] BFloat16"),
        (torch.zeros(3), r"got \[3\] Float"),
        (torch.zeros(2, 0), r"v >= 1, got \[2, 0\]"),
    ],
)
def test_first_argmax_bad_input_names_the_values(logits, message):
    build_native()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.attn.first_argmax(logits)


def _top_k_reference(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The samplers' cut as ATen computes it: below the k-th largest (topk's), -inf."""
    return logits.masked_fill(logits < logits.topk(k, dim=-1).values[:, -1:], float("-inf"))


@needs_avx2
@given(
    rows=st.integers(1, 5),
    vocab=st.integers(1, 300),  # 8 at a time and the tails, k up to the whole row
    levels=st.integers(1, 6),  # few distinct values: ties at the cut
    specials=st.lists(st.tuples(st.sampled_from(sorted(_SPECIAL_LOGITS)), st.integers(0, 2**16)), max_size=8),
    k_share=st.integers(1, 1000),  # k = vocab * k_share / 1000, at least 1
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
@example(rows=1, vocab=20, levels=6, specials=[("nan", i) for i in range(5)], k_share=250, threads=1, seed=0)  # k NaNs
@example(rows=2, vocab=300, levels=6, specials=[], k_share=1000, threads=2, seed=3)  # k = v: nothing cut
@settings(max_examples=examples(100), deadline=None)
def test_keep_top_k_cuts_as_topk_and_masked_fill(rows, vocab, levels, specials, k_share, threads, seed):
    """``attn::keep_top_k`` leaves the logits as ``masked_fill_(x < topk(k).values[:, -1:],
    -inf)`` does: ties at the k-th value kept, a row's NaNs ranked above every number (a row of
    k NaNs or more keeps all) and never cut, infinities and signed zeros as they compare."""
    build_native()
    k = min(max(1, vocab * k_share // 1000), KEEP_TOP_K_MOST)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, levels, (rows, vocab), generator=gen).float()  # (b, v)
    for name, where in specials:
        logits.view(-1)[where % logits.numel()] = _SPECIAL_LOGITS[name]
    expected = _top_k_reference(logits, k)
    torch.set_num_threads(threads)
    torch.ops.attn.keep_top_k(logits, k)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0, equal_nan=True)


@needs_avx2
@pytest.mark.parametrize("k", [1, 50, KEEP_TOP_K_MOST])
def test_keep_top_k_on_a_vocabulary_of_normal_logits(k):
    """16 rows of 49,152 normal logits (the heap's least rises as it meets them, most are
    skipped 8 at a time), one row with NaNs, on 2 threads: as topk and masked_fill_."""
    build_native()
    logits = torch.randn(16, 49_152, generator=torch.Generator().manual_seed(k)) * 3  # (b, v)
    logits[5, ::1000] = math.nan
    expected = _top_k_reference(logits, k)
    torch.set_num_threads(2)
    torch.ops.attn.keep_top_k(logits, k)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0, equal_nan=True)
    assert int((logits[0] > float("-inf")).sum()) == k  # distinct normal values: exactly k kept


@needs_avx2
@pytest.mark.parametrize(
    ("logits", "k", "message"),
    [
        (
            torch.zeros(2, 3),
            0,
            r"k must be in \[1, 3\] \(the logits a row, at most 256; topk is the faster past that\), got 0",
        ),
        (torch.zeros(2, 3), 4, r"k must be in \[1, 3\].*got 4"),
        (torch.zeros(2, 300), 257, r"k must be in \[1, 256\].*got 257"),
        (torch.zeros(2, 3, dtype=torch.bfloat16), 1, r"contiguous fp32 \(b, v\) CPU logits, got \[2, 3\] BFloat16"),
        (torch.zeros(3, 2).t(), 1, r"got \[2, 3\] Float \(not contiguous\)"),
    ],
)
def test_keep_top_k_bad_input_names_the_values(logits, k, message):
    build_native()
    before = logits.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.attn.keep_top_k(logits, k)
    assert torch.equal(logits, before)


@given(
    rows=st.integers(1, 19),  # groups of 8 and a short last group
    vocab=st.integers(1, 300),
    scale_exp=st.integers(-30, 30),  # values of any size, sums that round at every step
    specials=st.lists(st.tuples(st.sampled_from(sorted(_SPECIAL_LOGITS)), st.integers(0, 2**16)), max_size=4),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
@example(rows=3, vocab=5, scale_exp=0, specials=[("-0.0", 0), ("-0.0", 5)], threads=1, seed=0)  # -0.0 first
@example(rows=11, vocab=2, scale_exp=0, specials=[("-0.0", 16)], threads=2, seed=0)  # the short group's
@settings(max_examples=examples(100), deadline=None)
def test_running_sums_are_cumsums_in_fp64_bit_for_bit(rows, vocab, scale_exp, specials, threads, seed):
    """``attn::running_sums`` writes ``torch.cumsum(x, -1, dtype=torch.float64)``: the same
    additions in the same order from 0 (-0.0 + 0 is 0.0, a NaN or infinity carried on as ATen
    carries it), for any number of rows (8 at once, then the rest) and threads."""
    build_native()
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, vocab, generator=gen) * 2.0**scale_exp  # (b, v)
    for name, where in specials:
        x.view(-1)[where % x.numel()] = _SPECIAL_LOGITS[name]
    out = torch.full((rows, vocab), 7.0, dtype=torch.float64)
    torch.set_num_threads(threads)
    torch.ops.attn.running_sums(x, out)
    expected = torch.cumsum(x, -1, dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(out.signbit(), expected.signbit())


def test_running_sums_of_a_vocabulary_of_probabilities():
    """16 rows of 49,152 softmax probabilities on 2 threads (a group of 8 rows a thread): the
    sums the sampler inverts, as torch.cumsum gives them, each row's last about 1."""
    build_native()
    probs = torch.softmax(torch.randn(16, 49_152, generator=torch.Generator().manual_seed(0)) * 3, -1)  # (b, v)
    out = torch.empty(16, 49_152, dtype=torch.float64)
    torch.set_num_threads(2)
    torch.ops.attn.running_sums(probs, out)
    assert torch.equal(out, torch.cumsum(probs, -1, dtype=torch.float64))
    torch.testing.assert_close(out[:, -1], torch.ones(16, dtype=torch.float64), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("x", "out", "message"),
    [
        (
            torch.zeros(2, 3, dtype=torch.bfloat16),
            torch.zeros(2, 3, dtype=torch.float64),
            r"fp32 \(b, v\) CPU "
            r"probabilities, got \[2, 3\] BFloat16",
        ),
        (torch.zeros(3, 2).t(), torch.zeros(2, 3, dtype=torch.float64), r"got \[2, 3\] Float \(not contiguous\)"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.float64), r"got \[3\] Float"),
        (
            torch.zeros(2, 3),
            torch.zeros(2, 4, dtype=torch.float64),
            r"fp64 CPU tensor of x's shape \[2, 3\], got "
            r"\[2, 4\] Double",
        ),
        (torch.zeros(2, 3), torch.zeros(2, 3), r"of x's shape \[2, 3\], got \[2, 3\] Float"),
        (torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.float64).t(), r"got \[2, 3\] Double \(not contiguous\)"),
    ],
)
def test_running_sums_bad_input_names_the_values(x, out, message):
    build_native()
    before = out.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.attn.running_sums(x, out)
    assert torch.equal(out, before)


def test_every_header_the_sources_include_is_hashed_into_the_build():
    """torch's builder rebuilds when a source or a flag changes: a header missing from
    ``_HEADERS`` could leave a stale build after an edit."""
    included = set()
    for source in attn.native._SOURCES:
        text = Path(source).read_text()
        included |= set(re.findall(r'^#include "([^"]+)"', text, flags=re.MULTILINE))
    assert included == {header.name for header in attn.native._HEADERS}


def test_the_build_name_follows_the_text_of_every_source_and_header(tmp_path, monkeypatch):
    """An edited header or source builds anew, under its own name, and so does a copy of the same
    sources elsewhere: two copies of attn on one torch never rebuild each other's extension (a
    process holding the former one would be left mapping a deleted file)."""
    source, header = tmp_path / "kernel.cpp", tmp_path / "kernel.h"
    source.write_text("// one\n")
    header.write_text("// one\n")
    monkeypatch.setattr(attn.native, "_SOURCES", [str(source)])
    monkeypatch.setattr(attn.native, "_HEADERS", [header])
    names = [attn.native._extension_name()]
    header.write_text("// two\n")
    names.append(attn.native._extension_name())
    source.write_text("// two\n")
    names.append(attn.native._extension_name())
    elsewhere = tmp_path / "copy" / "kernel.cpp"  # the same text in another copy of attn
    elsewhere.parent.mkdir()
    elsewhere.write_text(source.read_text())
    monkeypatch.setattr(attn.native, "_SOURCES", [str(elsewhere)])
    names.append(attn.native._extension_name())
    assert len(set(names)) == 4
    release = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    assert all(re.fullmatch(rf"attn_native_{release}_[0-9a-f]{{12}}", name) for name in names), names


_LOAD_IN_A_FRESH_PROCESS = (
    "import warnings, attn.native\n"
    "with warnings.catch_warnings(record=True) as caught:\n"
    "    warnings.simplefilter('always')\n"
    "    attn.native.build_native()\n"
    "print('built', *[str(w.message) for w in caught], sep='\\n')\n"
)


def _build_directory() -> Path:
    from torch.utils import cpp_extension

    attn.native.build_native()  # built and cached, so the fresh processes below only load it
    return Path(cpp_extension._get_build_directory(attn.native._extension_name(), verbose=False))


@needs_avx2
def test_a_lock_left_by_a_killed_build_is_cleared_with_a_warning_not_waited_on_forever():
    stale = _build_directory() / "lock"  # what torch's builder leaves when its process is killed
    stale.touch()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=240
        )
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("built\n")
    assert f"removed {stale}, left by a build of the native kernels that was killed" in done.stdout


@needs_avx2
def test_a_build_waits_for_a_live_builder_and_leaves_its_lock_alone():
    import fcntl

    directory = _build_directory()
    with open(directory / "attn-build.flock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another attn process, building
        held.truncate(0)
        held.write(str(os.getpid()))  # as attn's builder leaves its pid for the processes that wait
        held.flush()
        (directory / "lock").touch()  # torch's lock file of that live build
        waiting = subprocess.Popen(
            [sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                waiting.wait(timeout=15)  # torch imported, then blocked on the flock
            assert (directory / "lock").exists()
        except BaseException:
            waiting.kill()
            raise
        finally:
            (directory / "lock").unlink(missing_ok=True)  # the live build finishes
    out, err = waiting.communicate(timeout=240)
    assert waiting.returncode == 0, err
    assert out == "built\n"  # no warning: nothing is wrong
    # One note on stderr that it waited (15 s, past the quiet 5), naming the holder and the directory.
    note = (
        f"attn: another process (pid {os.getpid()}) is building or loading the native kernels in {directory}; "
        "waiting for it to finish (a build runs once per machine, torch release and copy of attn)"
    )
    assert err.splitlines().count(note) == 1, err
    with open(directory / "attn-build.flock") as left:
        assert left.read() == str(waiting.pid)  # the pid of the last holder, for the next to wait


@pytest.mark.parametrize("quiet_s", [5.0, 0.2])
def test_a_short_wait_for_the_flock_is_quiet_and_a_long_one_is_named(tmp_path, monkeypatch, capsys, quiet_s):
    import fcntl
    import threading

    monkeypatch.setattr(attn.native, "_QUIET_WAIT_S", quiet_s)
    path = tmp_path / "attn-build.flock"
    path.write_text("4242")  # the holder's pid, as attn's builder leaves it
    with open(path, "a+") as other, open(path, "a+") as held:  # two open files: two flocks, as two processes
        fcntl.flock(other, fcntl.LOCK_EX)
        threading.Timer(1.0, fcntl.flock, (other, fcntl.LOCK_UN)).start()  # the holder finishes in 1 s
        started = time.monotonic()
        attn.native._take_flock(held, tmp_path)
        assert time.monotonic() - started >= 0.9  # it waited for the holder
    err = capsys.readouterr().err
    if quiet_s > 1.0:
        assert err == ""  # a moment's wait (another process loading the kernels) says nothing
    else:
        note = f"attn: another process (pid 4242) is building or loading the native kernels in {tmp_path};"
        assert err.startswith(note)


def test_where_the_file_system_refuses_an_flock_the_build_goes_on_and_leaves_torchs_lock_alone(tmp_path, monkeypatch):
    import errno
    import fcntl

    def refuse(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    (tmp_path / "lock").touch()  # a live builder's, or a dead one's: no telling without the flock
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with attn.native._sole_builder(tmp_path):
            entered = True
    assert entered
    assert (tmp_path / "lock").exists()


def test_a_cpu_without_avx2_is_told_so_and_not_offered_the_kernels(monkeypatch):
    for probe in ("_has_avx2", "_has_avx512", "_has_avx512_bf16"):
        monkeypatch.setattr(attn.native, probe, lambda: False)
    attn.native._built_here.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="need an x86 CPU with AVX2"):
            build_native()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not a build failure: no warning
            assert decode_attention_available() is False
            assert bf16_matvec_available() is False
            assert bf16_linear_kernel(1, 576) is None and bf16_linear_kernel(16, 576) is None
            assert native_product(1, 576, torch.float32) is None
    finally:
        attn.native._built_here.cache_clear()


@needs_avx2
@pytest.mark.parametrize("avx512", [False, True])
def test_a_cpu_with_avx2_and_no_avx512_bf16_gets_the_avx2_products_and_layers(monkeypatch, avx512):
    """An AVX2 CPU, and an AVX-512 one without BF16 (Skylake-SP to Ice Lake): attn::avx2_linear's
    products and attn::decode_layers' AVX2 build; attn::decode_attention where it has AVX-512."""
    avx2_only(monkeypatch)
    if avx512:
        monkeypatch.setattr(attn.native, "_has_avx512", lambda: True)
    avx2 = torch.ops.attn.avx2_linear.default
    for dtype in (torch.bfloat16, torch.float32):
        assert [native_product(rows, 576, dtype) for rows in (1, AVX2_LINEAR_MAX_ROWS)] == [avx2, avx2]
        assert native_product(AVX2_LINEAR_MAX_ROWS + 1, 576, dtype) is None  # a matrix product
    assert native_product(1, 576, torch.float16) is None
    assert decode_attention_available() is avx512
    assert decode_layers_available() is True and attn.native.avx2_layers() is True  # its AVX2 build


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_avx2_cpus_decode_steps_run_attns_products_and_match_an_uncached_pass(monkeypatch, dtype):
    """Without AVX-512, in a decode step of layers attn::decode_layers does not compute (heads of
    8 dims: its heads are a multiple of 16) every linear is an attn::avx2_linear call, and its
    logits are those of a pass without the cache."""
    avx2_only(monkeypatch)
    model = tiny_model(2).to(dtype)
    assert model.config.head_dim % 16 != 0
    tokens = torch.randint(0, 61, (3, 6), generator=torch.Generator().manual_seed(0))
    model.setup_caches(3, 6)
    with attn.cached_inference(model):
        steps = [model(tokens[:, :4])]
        with OperatorCalls() as calls:
            steps += [model(tokens[:, i : i + 1]) for i in (4, 5)]
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.layers.modules()) + 1  # and the output layer
    assert calls.names.count("attn.avx2_linear.default") == 2 * linears
    assert not any("decode_layers" in name or "linear_pointwise" in name for name in calls.names)
    with torch.no_grad():
        want = model(tokens)
    tolerance = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    torch.testing.assert_close(torch.cat(steps, 1), want, **tolerance)


def test_a_cpu_without_avx512_bf16_is_not_offered_the_bf16_kernel(monkeypatch):
    monkeypatch.setattr(attn.native, "_has_avx512_bf16", lambda: False)
    assert bf16_matvec_available() is False


def test_a_failed_build_warns_once_with_the_compilers_error(monkeypatch):
    def fail(**kwargs):
        raise RuntimeError(
            "Error building extension 'x': [1/2] c++ ...\nfew_rows_linear.cpp:1:10: error: no compiler here"
        )

    from torch.utils import cpp_extension

    monkeypatch.setattr(attn.native, "_has_avx512", lambda: True)
    monkeypatch.setattr(attn.native, "_has_avx2", lambda: True)
    monkeypatch.setattr(attn.native, "_built", False)  # as in a process that has not loaded it yet
    monkeypatch.setattr(cpp_extension, "load", fail)
    attn.native._built_here.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="error: no compiler here.*inductor's code"):
            assert decode_attention_available() is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert decode_attention_available() is False  # answered once: no second warning
            assert bf16_matvec_available() is False
    finally:
        attn.native._built_here.cache_clear()


# -- attn::decode_layers -----------------------------------------------------------------------

_LAYER_WEIGHTS = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down")


def _layer_inputs(batch, embed_dim, heads, kv_heads, head_dim, hidden_dim, length, dtype, biases, seed, qk_norm=False):
    """A decode step's inputs for one layer: x (b, 1, e), 9 weights (11 with q and k norms), 4
    biases (some None), caches (b, h_kv, L, d) holding stale values, each scaled to keep
    activations near 1."""
    gen = torch.Generator().manual_seed(seed)

    def values(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype)

    e, qd, kvd = embed_dim, heads * head_dim, kv_heads * head_dim
    shapes = [(e,), (qd, e), (kvd, e), (kvd, e), (e, qd), (e,), (hidden_dim, e), (hidden_dim, e), (e, hidden_dim)]
    weights = [values(*s, scale=1.0 if len(s) == 1 else s[1] ** -0.5) for s in shapes]
    if qk_norm:
        weights += [values(head_dim), values(head_dim)]
    for i in (0, 5, 9, 10)[: 4 if qk_norm else 2]:
        weights[i] = weights[i].abs() + 0.5  # norm weights near 1
    bias = [values(n, scale=0.1) if on else None for n, on in zip((qd, kvd, kvd, e), biases, strict=True)]
    caches = [values(batch, kv_heads, length, head_dim) for _ in "kv"]
    return values(batch, 1, e), weights, bias, caches


def _float64_layer(x, weights, biases, k_cache, v_cache, slot, mask, rotation, eps, scale):
    """The layer in float64, rounded to x's dtype where the eager layer rounds (11 weights: each
    head's q and k normed before RoPE, as Qwen3): each norm's
    normalized value and product by its weight, each linear's output, RoPE's, attention's
    output, each residual sum, SiLU's output and its product with the up projection."""
    dtype, (b, _, e), d = x.dtype, x.shape, k_cache.shape[-1]

    def rounded(t):
        return t.to(dtype).double()

    def norm(h, weight):
        return rounded(weight.double() * rounded(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)))

    def linear(h, weight, bias=None):
        out = h @ weight.double().T
        return rounded(out if bias is None else out + bias.double())

    h0 = x.double().reshape(b, e)
    normed = norm(h0, weights[0])
    q, k, v = (linear(normed, weights[i], biases[i - 1]).view(b, -1, d) for i in (1, 2, 3))  # (b, h or h_kv, d)
    if len(weights) == 11:
        q, k = norm(q, weights[9]), norm(k, weights[10])
    cos, sin = rotation.double().reshape(2, -1, 1, d)  # each (1 or b, 1, d)
    q, k = (rounded(t * cos + t.roll(d // 2, -1) * sin) for t in (q, k))
    keys, values = k_cache.double().clone(), v_cache.double().clone()  # (b, h_kv, L, d)
    keys[:, :, slot], values[:, :, slot] = k, v
    span, group = mask.shape[-1], q.shape[1] // k.shape[1]
    keys, values = (t[:, :, :span].repeat_interleave(group, 1) for t in (keys, values))  # (b, h, n, d)
    scores = torch.einsum("bhd,bhnd->bhn", q, keys) * scale
    scores = scores.masked_fill(~mask.reshape(-1, 1, span), float("-inf"))  # (b, h, n)
    attended = rounded(torch.einsum("bhn,bhnd->bhd", scores.softmax(-1), values)).reshape(b, -1)
    h1 = rounded(h0 + linear(attended, weights[4], biases[3]))
    normed = norm(h1, weights[5])
    gate, up = linear(normed, weights[6]), linear(normed, weights[7])
    down = linear(rounded(rounded(gate * torch.sigmoid(gate)) * up), weights[8])
    return rounded(h1 + down).view(b, 1, e)


@needs_bf16_matvec
@given(
    dtype=st.sampled_from(["fp32", "bf16"]),
    batch=st.sampled_from([1, 2, 3, 5, 8, 9, 16]),  # bf16 from 5: AMX, q/k/v and gate/up in one call each
    num_layers=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 10),  # past 8: the AVX2 attention takes a group in parts
    head_dim=st.sampled_from([16, 32, 48, 64]),  # 48: half a head is not whole vectors
    embed_dim=st.sampled_from([32, 48, 64]),
    hidden_dim=st.sampled_from([32, 48, 96]),
    length=st.integers(1, 40),
    slot_at=st.floats(0, 1, exclude_max=True),
    span_at=st.floats(0, 1),
    per_row=st.booleans(),  # the mask and the rotation per row, or one for every row
    biases=st.tuples(*[st.booleans()] * 4),
    qk_norm=st.booleans(),
    final_norm=st.booleans(),
    threads=st.sampled_from([1, 2]),
    avx2=st.booleans(),  # the AVX2 build (attn::avx2_linear, avx2_layers.cpp), as on a CPU without AVX-512
    sharing=st.integers(1, 4),  # rows in groups that share their first slots (a fork), where it divides the rows
    shared_at=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(80), deadline=None)
def test_decode_layers_equal_float64_layers_and_write_only_their_slot(
    dtype, batch, num_layers, kv_heads, group, head_dim, embed_dim, hidden_dim, length, slot_at, span_at, per_row,
    biases, qk_norm, final_norm, threads, avx2, sharing, shared_at, seed,
):  # fmt: skip
    """The layers' output is the float64 layers' in turn, each rounded where eager rounds, within
    the products' and attention's own fp32 rounding (which can flip a bf16 rounding on the way),
    and then, with ``final_norm``, the model's final RMSNorm of it (an eps of its own); each
    layer's cache gets its key and value for this token at the slot, and every other slot is
    unchanged bit for bit. Both builds: AVX-512 and AVX2. Rows in groups whose first slots copy
    the group's first row (``group``, ``shared``) read them from that row: the float64 layers
    read each row's copy, and the op's call gets other values in the copies."""
    kind, heads = _DTYPES[dtype], kv_heads * group
    widths = (embed_dim, heads * head_dim, hidden_dim)
    if avx2 and batch > AVX2_LINEAR_MAX_ROWS:
        return  # rows attn::avx2_linear does not take: the decoder never asks
    if not avx2 and any(attn.native.native_product(batch, width, kind) is None for width in widths):
        return  # rows this CPU's products of these widths do not take: the decoder never asks (test_native_step.py)
    layers = [
        _layer_inputs(batch, embed_dim, heads, kv_heads, head_dim, hidden_dim, length, kind, biases, seed + i, qk_norm)
        for i in range(num_layers)
    ]
    x = layers[0][0]
    gen = torch.Generator().manual_seed(seed + 1)
    slot = int(slot_at * length)
    sharing = sharing if batch % sharing == 0 else 1
    shared = int(shared_at * slot)  # slots below the one this token writes
    for cache in (c for layer in layers for c in layer[3]):  # (b, h_kv, L, d)
        cache[:, :, :shared] = cache[::sharing, :, :shared].repeat_interleave(sharing, 0)
    span = slot + 1 + int(span_at * (length - slot - 1))
    mask = torch.rand((batch, 1, span) if per_row else (1, span), generator=gen) < 0.6
    mask[..., slot] = True  # a query always sees its own slot
    angles = torch.rand((batch if per_row else 1, head_dim // 2), generator=gen) * 6.3
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([-angles.sin(), angles.sin()], -1)  # the first half negated, as RotaryEmbedding.rotation
    rotation = torch.stack([cos, sin]).reshape((2, batch, 1, 1, head_dim) if per_row else (2, 1, head_dim))
    scale = head_dim**-0.5
    expected = x
    for _, weights, bias, (k_cache, v_cache) in layers:
        expected = _float64_layer(expected.to(kind), weights, bias, k_cache, v_cache, slot, mask, rotation, 1e-5, scale)
    norm_weight = (torch.rand(embed_dim, generator=gen) + 0.5).to(kind) if final_norm else None
    if final_norm:
        normed = (expected * torch.rsqrt(expected.pow(2).mean(-1, keepdim=True) + 1e-6)).to(kind).double()
        expected = (norm_weight.double() * normed).to(kind).double()
    k_caches, v_caches = [layer[3][0] for layer in layers], [layer[3][1] for layer in layers]
    copies = torch.arange(batch) % sharing != 0
    for cache in k_caches + v_caches:
        cache[copies, :, :shared] = torch.randn(cache[copies, :, :shared].shape, generator=gen).to(kind)
    before = [cache.clone() for cache in k_caches + v_caches]
    torch.set_num_threads(threads)
    got = torch.ops.attn.decode_layers(
        x, [w for layer in layers for w in layer[1]], [b for layer in layers for b in layer[2]], k_caches, v_caches,
        torch.tensor([slot]), mask, rotation, 1e-5, scale, attn.native.amx_from_rows(), norm_weight, 1e-6, avx2,
        sharing, shared,
    )  # fmt: skip
    assert got.shape == x.shape and got.dtype == kind
    # bf16: a sum of another order can round an intermediate the other way, and that half step
    # flows on through the norms, products and later layers: bounded by a share of the output's
    # magnitude.
    rtol = {"fp32": 1e-4, "bf16": 2**-5}[dtype] * num_layers
    atol = {"fp32": 1e-4, "bf16": 2**-5 * float(expected.abs().max())}[dtype] * num_layers
    torch.testing.assert_close(got.double(), expected, rtol=rtol, atol=atol)
    others = torch.arange(length) != slot
    for cache, old in zip(k_caches + v_caches, before, strict=True):
        assert torch.equal(cache[:, :, others], old[:, :, others])
    for cache, old in zip(k_caches, before, strict=False):
        assert not torch.equal(cache[:, :, slot], old[:, :, slot])  # written (random values never repeat)


def _layer_call(**changes):
    """A valid call of two layers (bf16, 2 rows, heads of 16), with ``changes`` to its arguments
    (the weights, biases and caches as one layer's: the second layer's are separate copies)."""
    x, weights, bias, (k_cache, v_cache) = _layer_inputs(2, 32, 2, 1, 16, 32, 8, torch.bfloat16, (False,) * 4, 0)
    call = dict(
        x=x, weights=weights, biases=bias, k_cache=k_cache, v_cache=v_cache, slots=torch.tensor([3]),
        mask=torch.ones(1, 4, dtype=torch.bool), rotation=torch.ones(2, 1, 16), eps=1e-5, scale=0.25,
        amx_from_rows=attn.native.amx_from_rows(),
    )  # fmt: skip
    for name, change in changes.items():
        call[name] = change(call)
    first = _layer_inputs(call["x"].shape[0], 32, 2, 1, 16, 32, 8, torch.bfloat16, (False,) * 4, 1)
    if len(call["weights"]) == 11:  # q and k norms: the first layer has them too
        first[1].extend(torch.ones(16, dtype=torch.bfloat16) for _ in "qk")
    weights, biases = first[1] + list(call.pop("weights")), first[2] + list(call.pop("biases"))
    k_cache, v_cache = call.pop("k_cache"), call.pop("v_cache")
    return call | dict(weights=weights, biases=biases, k_caches=[first[3][0], k_cache], v_caches=[first[3][1], v_cache])


@needs_bf16_matvec
@pytest.mark.parametrize("avx2", [False, True])
def test_decode_layers_read_no_slot_the_mask_hides(avx2):
    """NaN keys and values in every slot a row's mask hides and past the mask's span change
    nothing: the output is the one with those slots zero, bit for bit, in both builds."""
    call = _layer_call()  # two layers, 2 rows, slot 3 of 8, heads of 16
    call["mask"] = torch.tensor([[[True, False, True, True]], [[False, True, False, True]]])  # (b, 1, n)
    hidden = torch.ones(2, 1, 8, 1, dtype=torch.bool)  # (b, h_kv, L, 1)
    hidden[:, :, :4] = ~call["mask"].view(2, 1, 4, 1)
    outputs = []
    for fill in (float("nan"), 0.0):
        caches = {side: [cache.masked_fill(hidden, fill) for cache in call[side]] for side in ("k_caches", "v_caches")}
        outputs.append(torch.ops.attn.decode_layers(**(call | caches), avx2=avx2))
    assert not outputs[0].isnan().any()
    assert torch.equal(outputs[0], outputs[1])


@needs_bf16_matvec
@pytest.mark.parametrize("avx2", [False, True])
def test_decode_layers_read_shared_slots_from_each_groups_first_row(avx2):
    """4 rows in groups of 2 whose first 3 slots copy the group's first row: with group 2 and
    shared 3 the layers' output and cache writes are, bit for bit, those of the call that
    reads every row's own slots, and stay so with other values in the copies; that call, on
    those values, gives the copies other outputs. Both builds."""
    call = _layer_call(
        x=lambda c: torch.randn(4, 1, 32, generator=torch.Generator().manual_seed(3)).bfloat16(),
        k_cache=lambda c: torch.randn(4, 1, 8, 16, generator=torch.Generator().manual_seed(4)).bfloat16(),
        v_cache=lambda c: torch.randn(4, 1, 8, 16, generator=torch.Generator().manual_seed(5)).bfloat16(),
    )
    for cache in call["k_caches"] + call["v_caches"]:
        cache[:, :, :3] = cache[::2, :, :3].repeat_interleave(2, 0)
    clean = [cache.clone() for cache in call["k_caches"] + call["v_caches"]]
    expected = torch.ops.attn.decode_layers(**call, avx2=avx2)
    written = [cache.clone() for cache in call["k_caches"] + call["v_caches"]]

    def poisoned():
        for cache, old in zip(call["k_caches"] + call["v_caches"], clean, strict=True):
            cache.copy_(old)
            cache[1::2, :, :3] = torch.randn(cache[1::2, :, :3].shape, generator=torch.Generator().manual_seed(6))
        return call

    got = torch.ops.attn.decode_layers(**poisoned(), avx2=avx2, group=2, shared=3)
    assert torch.equal(got, expected)
    for cache, old in zip(call["k_caches"] + call["v_caches"], written, strict=True):
        assert torch.equal(cache[:, :, 3:], old[:, :, 3:])  # slot 3 written as before, the rest kept
    misread = torch.ops.attn.decode_layers(**poisoned(), avx2=avx2)
    assert torch.equal(misread[::2], expected[::2])
    assert not torch.isclose(misread[1::2], expected[1::2]).all(-1).any()


def _swap(items, index, value):
    items = list(items)
    items[index] = value
    return items


@needs_bf16_matvec
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"x": lambda c: c["x"].float()}, "layer 0's caches must be CPU tensors of x's dtype Float, got BFloat16"),
        (
            {"x": lambda c: c["x"].expand(2, 2, 32)},
            r"x must be \(b, 1, e\) on the CPU, one token a row, got \[2, 2, 32\] on cpu",
        ),
        (
            {"weights": lambda c: c["weights"][:8]},
            r"takes 9 weights a layer .* or 11 \(and q_norm, k_norm\), got 17 for 2 layer\(s\)",
        ),
        ({"biases": lambda c: c["biases"][:3]}, r"takes 4 biases a layer .*, got 7 for 2 layer\(s\)"),
        (
            {
                "weights": lambda c: (
                    c["weights"] + [torch.ones(16, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)]
                )
            },
            r"layer 1's weight shapes do not fit .* q_norm and k_norm \[16\] and \[8\]",
        ),
        (
            {"weights": lambda c: _swap(c["weights"], 6, torch.zeros(48, 32, dtype=torch.bfloat16))},
            r"weight shapes do not fit .* gate \[48, 32\], up \[32, 32\]",
        ),
        (
            {"weights": lambda c: _swap(c["weights"], 2, c["weights"][2].float())},
            "layer 1's k_proj must be a contiguous CPU tensor of x's dtype BFloat16, got Float",
        ),
        (
            {"weights": lambda c: _swap(c["weights"], 4, c["weights"][4].T.contiguous().T)},
            "o_proj must be a contiguous CPU tensor",
        ),
        (
            {"biases": lambda c: _swap(c["biases"], 3, torch.zeros(5, dtype=torch.bfloat16))},
            r"layer 1's o_proj bias must be None or a \(32,\) CPU tensor",
        ),
        ({"slots": lambda c: torch.tensor([8])}, "slot 8 is outside the cache's 8 slots"),
        ({"slots": lambda c: torch.tensor([3, 4])}, "slots must be the one cache slot this token writes"),
        ({"mask": lambda c: torch.ones(1, 3, dtype=torch.bool)}, "the mask covers 3 slots; it must cover slot 3"),
        ({"mask": lambda c: torch.ones(1, 9, dtype=torch.bool)}, "at most the cache's 8"),
        ({"mask": lambda c: torch.ones(3, 1, 4, dtype=torch.bool)}, r"\(1, n\) or \(b, 1, n\), got Bool \[3, 1, 4\]"),
        ({"mask": lambda c: torch.ones(1, 4)}, "the mask must be bool"),
        ({"rotation": lambda c: torch.ones(2, 1, 8)}, r"rotation must be contiguous fp32 .* \(2, 1, 16\)"),
        ({"k_cache": lambda c: c["k_cache"][:1]}, r"layer 1's caches must be \(b, h_kv, L, d\) with x's 2 rows"),
        (
            {"k_cache": lambda c: torch.zeros(2, 1, 9, 16, dtype=torch.bfloat16), "v_cache": lambda c: c["k_cache"]},
            r"caches must be one shape, got \[2, 1, 8, 16\] for the first and \[2, 1, 9, 16\] for layer 1",
        ),
        (
            {
                "x": lambda c: torch.zeros(17, 1, 32, dtype=torch.bfloat16),
                "k_cache": lambda c: torch.zeros(17, 1, 8, 16, dtype=torch.bfloat16),
                "v_cache": lambda c: torch.zeros(17, 1, 8, 16, dtype=torch.bfloat16),
                "amx_from_rows": lambda c: 0,
            },
            r"17 rows are more than its BFloat16 products of 32 features take \(16\)",
        ),
        (
            {"final_norm": lambda c: torch.ones(16, dtype=torch.bfloat16)},
            r"final_norm must be None or a contiguous \(32,\) CPU tensor of x's dtype BFloat16, got \[16\] BFloat16",
        ),
        (
            {"final_norm": lambda c: torch.ones(32)},
            r"final_norm must be None or a contiguous \(32,\) CPU tensor of x's dtype BFloat16, got \[32\] Float",
        ),
        ({"group": lambda c: 3}, "group must divide the 2 rows .* got group 3 and shared 0"),
        ({"group": lambda c: 2, "shared": lambda c: -1}, "got group 2 and shared -1"),
        (
            {"group": lambda c: 2, "shared": lambda c: 4},
            r"writes slot 3, one of the 4 slots its rows share \(group 2\)",
        ),
    ],
)
def test_decode_layers_bad_input_names_the_values_and_writes_no_layer(changes, message):
    """Each bad input is the second layer's (or shared): the error names it, and neither the
    second layer's cache nor the first's, which the call reaches first, is written."""
    call = _layer_call(**changes)
    before = [cache.clone() for cache in call["k_caches"] + call["v_caches"]]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.attn.decode_layers(**call)
    for cache, old in zip(call["k_caches"] + call["v_caches"], before, strict=True):
        assert torch.equal(cache, old)


def _opcheck_cases():
    """One valid call of each operator the CPU runs here, for ``torch.library.opcheck``."""
    gen = torch.Generator().manual_seed(0)
    bf16 = lambda *shape: torch.randn(shape, generator=gen).bfloat16()  # noqa: E731
    cases = [
        pytest.param(
            "decode_attention",
            lambda: (
                bf16(2, 4, 1, 16),
                bf16(2, 2, 8, 16),
                bf16(2, 2, 8, 16),
                torch.ones(2, 1, 1, 8, dtype=torch.bool),
                0.25,
            ),
            marks=needs_avx512,
        ),
        pytest.param(
            "decode_attention",
            lambda: (
                bf16(4, 4, 1, 16),
                bf16(4, 2, 8, 16),
                bf16(4, 2, 8, 16),
                torch.ones(4, 1, 1, 8, dtype=torch.bool),
                0.25,
                False,
                2,
                5,  # rows in pairs sharing 5 slots
            ),
            marks=needs_avx512,
        ),
        pytest.param("bf16_matvec", lambda: (bf16(3, 32), bf16(16, 32), bf16(16)), marks=needs_bf16_matvec),
        pytest.param("fp32_linear", lambda: (bf16(3, 32).float(), bf16(16, 32).float(), None), marks=needs_bf16_matvec),
        pytest.param("invariant_linear", lambda: (bf16(37, 40), bf16(50, 40)), marks=needs_avx2),
        pytest.param("invariant_linear", lambda: (bf16(2, 9, 40).float(), bf16(5, 40).float()), marks=needs_avx2),
        pytest.param("amx_linear", lambda: (bf16(5, 32), bf16(16, 32), None), marks=needs_amx),
        pytest.param("avx2_linear", lambda: (bf16(3, 40), bf16(16, 40), bf16(16)), marks=needs_avx2),
        pytest.param("avx2_linear", lambda: (bf16(17, 40).float()[:5], bf16(9, 40).float(), None), marks=needs_avx2),
    ]

    def layers(avx2=False):
        call = _layer_call()
        names = ("x", "weights", "biases", "k_caches", "v_caches", "slots", "mask", "rotation", "eps", "scale")
        return (*(call[name] for name in names), call["amx_from_rows"], None, 0.0, avx2, 2, 3)  # rows share 3 slots

    return [
        *cases,
        pytest.param("decode_layers", layers, marks=needs_bf16_matvec),
        pytest.param("decode_layers", lambda: layers(avx2=True), marks=needs_avx2),
    ]


@pytest.mark.parametrize(("name", "arguments"), _opcheck_cases())
def test_operators_pass_torchs_opcheck(name, arguments):
    """``torch.library.opcheck``: each schema says what its kernel mutates (decode_layers: the
    caches, and nothing else), each fake kernel gives the real output's shape, dtype and strides,
    and the operator runs under AOT dispatch with dynamic shapes (how torch.compile would call it)."""
    results = torch.library.opcheck(getattr(torch.ops.attn, name).default, arguments())
    assert set(results.values()) == {"SUCCESS"}, results
