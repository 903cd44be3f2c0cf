"""attn/attention.py against the naive head-by-head reference in tests/reference.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn import MultiHeadAttention
from attn.policy import CachePolicy

from .reference import reference_attention, window_band


@st.composite
def attention_setups(draw: st.DrawFn) -> tuple[MultiHeadAttention, int, int]:
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    group = draw(st.sampled_from([1, 2, 3]))  # MHA when 1, MQA when num_kv_heads is 1
    head_dim = draw(st.sampled_from([2, 4, 8]))
    embed_dim = draw(st.sampled_from([8, 16]))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    layer = MultiHeadAttention(
        embed_dim=embed_dim,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_seq_len=32,
        rope_base=draw(st.sampled_from([10_000.0, 100.0])),
    )
    return layer, draw(st.integers(1, 3)), draw(st.integers(1, 10))


@given(attention_setups())
def test_uncached_matches_reference(setup: tuple[MultiHeadAttention, int, int]) -> None:
    layer, b, s = setup
    x = torch.randn(b, s, layer.embed_dim)
    causal = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
    expected = reference_attention(x, layer, torch.arange(s).expand(b, s), causal)
    torch.testing.assert_close(layer(x), expected.float(), rtol=1e-4, atol=1e-5)


@given(attention_setups(), st.data())
def test_explicit_mask_and_positions_match_reference(
    setup: tuple[MultiHeadAttention, int, int], data: st.DataObject
) -> None:
    layer, b, s = setup
    x = torch.randn(b, s, layer.embed_dim)
    positions = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, 20), min_size=s, max_size=s), min_size=b, max_size=b))
    )
    allowed = torch.tensor(
        data.draw(
            st.lists(
                st.lists(st.lists(st.booleans(), min_size=s, max_size=s), min_size=s, max_size=s),
                min_size=b,
                max_size=b,
            )
        )
    )
    allowed |= torch.eye(s, dtype=torch.bool)  # keep every query attending to something
    expected = reference_attention(x, layer, positions, allowed)
    torch.testing.assert_close(layer(x, input_pos=positions, mask=allowed), expected.float(), rtol=1e-4, atol=1e-5)


@given(attention_setups(), st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_cached_chunks_match_reference(setup: tuple[MultiHeadAttention, int, int], chunks: list[int]) -> None:
    layer, b, _ = setup
    total = sum(chunks)
    x = torch.randn(b, total, layer.embed_dim)
    layer.setup_cache(b, total + 2, dtype=torch.float32, device="cpu")
    outputs, start = [], 0
    with torch.no_grad():
        for s in chunks:
            outputs.append(layer(x[:, start : start + s], use_cache=True))
            start += s
    assert layer.kv_cache.size == total
    causal = torch.ones(total, total, dtype=torch.bool).tril().expand(b, total, total)
    expected = reference_attention(x, layer, torch.arange(total).expand(b, total), causal)
    torch.testing.assert_close(torch.cat(outputs, 1), expected.float(), rtol=1e-4, atol=1e-5)


@st.composite
def featured_layers(draw: st.DrawFn, max_seq_len: int = 32) -> MultiHeadAttention:
    """Layers with the checkpoint features switched on at random, their biases and norms random."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    layer = MultiHeadAttention(
        embed_dim=16,
        num_heads=4,
        num_kv_heads=draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([4, 8])),
        qkv_bias=draw(st.booleans()),
        out_bias=draw(st.booleans()),
        qk_norm_eps=draw(st.sampled_from([None, 1e-6])),
        sliding_window=draw(st.sampled_from([None, 1, 2, 5, 70])),
        max_seq_len=max_seq_len,
    )
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
    return layer


def _poison_past(layer: MultiHeadAttention, start: int, span: int) -> None:
    """Zeroes the unwritten slots ``start .. span - 1`` and fills the slots from ``span`` with
    NaN: a pass that read them, masked or not, would give NaN (0 x NaN)."""
    cache = layer.kv_cache
    for buffer in (cache.k_cache, cache.v_cache):
        buffer[:, :, start:span] = 0.0
        buffer[:, :, span:] = float("nan")


@given(featured_layers(max_seq_len=160), st.integers(1, 2), st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_default_mask_reads_only_the_filled_slots_rounded_up(
    layer: MultiHeadAttention, b: int, chunks: list[int]
) -> None:
    """A pass that decides for itself attends over ``attended_slots(fill + s)`` slots, not the
    cache's 160: poisoned slots past them change nothing, and every output matches the reference."""
    total = sum(chunks)
    x = torch.randn(b, total, layer.embed_dim)
    allowed = window_band(total, layer.sliding_window).expand(b, total, total)
    expected = reference_attention(x, layer, torch.arange(total).expand(b, total), allowed).float()
    layer.setup_cache(b, 160, dtype=torch.float32, device="cpu")
    outputs, start = [], 0
    with attn.cached_inference(layer):  # continues the sequence on purpose: no warning
        for s in chunks:
            _poison_past(layer, start, attn.attended_slots(start + s, 160))
            outputs.append(layer(x[:, start : start + s]))
            start += s
    torch.testing.assert_close(torch.cat(outputs, 1), expected, rtol=1e-4, atol=1e-5)


@given(featured_layers(), st.integers(1, 2), st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_a_mask_over_the_first_n_slots_attends_over_those_alone(
    layer: MultiHeadAttention, b: int, chunks: list[int], data: st.DataObject
) -> None:
    """A caller's mask may cover any span of slots from the first that holds the pass's tokens;
    the slots past it are not read (poisoned here) and the outputs match the reference."""
    total = sum(chunks)
    capacity = total + 6
    x = torch.randn(b, total, layer.embed_dim)
    allowed = window_band(total, layer.sliding_window).expand(b, total, total)
    expected = reference_attention(x, layer, torch.arange(total).expand(b, total), allowed).float()
    layer.setup_cache(b, capacity, dtype=torch.float32, device="cpu")
    outputs, start = [], 0
    with torch.no_grad():
        for s in chunks:
            n = data.draw(st.integers(start + s, capacity), label="n")
            _poison_past(layer, start, n)
            causal = torch.arange(n)[None, :] <= torch.arange(start, start + s)[:, None]  # (s, n)
            outputs.append(layer(x[:, start : start + s], mask=causal, use_cache=True))
            start += s
    torch.testing.assert_close(torch.cat(outputs, 1), expected, rtol=1e-4, atol=1e-5)


@given(featured_layers(), st.integers(1, 2), st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_features_match_reference_uncached_and_cached(layer: MultiHeadAttention, b: int, chunks: list[int]) -> None:
    total = sum(chunks)
    x = torch.randn(b, total, layer.embed_dim)
    allowed = window_band(total, layer.sliding_window).expand(b, total, total)
    expected = reference_attention(x, layer, torch.arange(total).expand(b, total), allowed).float()
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-5)
    layer.setup_cache(b, total + 3, dtype=torch.float32, device="cpu")
    outputs, start = [], 0
    with torch.no_grad():
        for s in chunks:
            outputs.append(layer(x[:, start : start + s], use_cache=True))
            start += s
    torch.testing.assert_close(torch.cat(outputs, 1), expected, rtol=1e-4, atol=1e-5)


def test_decides_by_input_under_inference_policy(policy: CachePolicy) -> None:
    layer = MultiHeadAttention(embed_dim=8, num_heads=2, max_seq_len=16)
    layer.setup_cache(1, 16, dtype=torch.float32, device="cpu")
    x = torch.randn(1, 3, 8)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)  # asserted in test_compat.py
        asked = layer.uses_cache(x)
        layer(x)
    used = layer.kv_cache.size == 3
    assert used is asked is (policy is CachePolicy.INFERENCE)
    with torch.no_grad():
        assert not layer.uses_cache(x) and not layer.uses_cache()
    layer.kv_cache.reset()
    with attn.cached_inference(layer):
        layer(torch.randn(1, 3, 8))
    assert layer.kv_cache.size == 3  # the portable spelling caches under both policies


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(embed_dim=8, num_heads=3, num_kv_heads=2),
            r"num_heads \(3\) must be a positive multiple of num_kv_heads \(2\)",
        ),
        (dict(embed_dim=10, num_heads=4), r"embed_dim \(10\) is not divisible by num_heads \(4\); pass head_dim"),
        (dict(embed_dim=8, num_heads=2, head_dim=3), r"RoPE needs an even head_dim, got 3"),
        (dict(embed_dim=8, num_heads=2, sliding_window=0), r"sliding_window must be a positive int or None, got 0"),
    ],
)
def test_bad_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(max_seq_len=8, **kwargs)


def test_bad_mask_and_positions() -> None:
    layer = MultiHeadAttention(embed_dim=8, num_heads=2, max_seq_len=16)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 3, 3\) or \(3, 3\)"):
        layer(x, mask=torch.ones(2, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        layer(x, mask=torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"input_pos must have shape \(3,\) or \(2, 3\)"):
        layer(x, input_pos=torch.arange(4))
    layer.setup_cache(2, 16, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"\(2, 3, n\) or \(3, n\) .* 1 <= n <= 16 .* got \(3, 17\)"):
        layer(x, mask=torch.ones(3, 17, dtype=torch.bool), use_cache=True)
    with (
        pytest.raises(ValueError, match=r"the mask covers the first 2 cache slots, .* at least 3 slots"),
        torch.inference_mode(),
    ):
        layer(x, mask=torch.ones(3, 2, dtype=torch.bool))  # the pass writes slots 0..2
    assert layer.kv_cache.size == 0


def test_cache_longer_than_rope_table_is_refused() -> None:
    layer = MultiHeadAttention(embed_dim=8, num_heads=2, max_seq_len=16)
    with pytest.raises(ValueError, match=r"cache max_seq_len \(17\) exceeds the 16 positions"):
        layer.setup_cache(1, 17, dtype=torch.float32, device="cpu")


@given(
    b=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([2, 3]),
    slots=st.integers(1, 70),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    vendor=st.sampled_from(["GenuineIntel", "AuthenticAMD", None]),
    seed=st.integers(0, 2**16),
)
def test_a_decode_step_folds_its_heads_where_faster_and_matches_a_naive_loop(
    monkeypatch: pytest.MonkeyPatch,
    b: int,
    kv_heads: int,
    group: int,
    slots: int,
    dtype: torch.dtype,
    vendor: str | None,
    seed: int,
) -> None:
    """One query per head in bf16/fp16, and in fp32 on an Intel CPU: the heads of a group are
    handed to SDPA as its kv head's queries (one call, no GQA); elsewhere one GQA call. The
    result is the per-head attention's either way."""
    monkeypatch.setattr(attn.attention, "cpu_vendor", lambda: vendor)
    folds = dtype != torch.float32 or vendor == "GenuineIntel"
    torch.manual_seed(seed)
    h, d = kv_heads * group, 8
    layer = MultiHeadAttention(embed_dim=h * d, num_heads=h, num_kv_heads=kv_heads, max_seq_len=128).to(dtype)
    q = torch.randn(b, h, 1, d).to(dtype)
    k, v = torch.randn(b, kv_heads, slots, d).to(dtype), torch.randn(b, kv_heads, slots, d).to(dtype)
    mask = torch.rand(b, 1, slots) < 0.8
    mask[..., -1] = True  # the query's own slot
    shapes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        shapes.append((tuple(query.shape), kwargs.get("enable_gqa", False)))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    out = layer.attend(q, k, v, mask, dtype, "sdpa").double()  # (b, 1, h * d), through o_proj
    assert shapes == ([((b, kv_heads, group, d), False)] if folds else [((b, h, 1, d), True)])
    scores = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) / d**0.5  # (b, h, 1, L)
    weights = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
    expected = (weights @ v.double().repeat_interleave(group, 1)).transpose(1, 2).reshape(b, 1, h * d)
    expected = torch.nn.functional.linear(expected.to(dtype), layer.o_proj.weight).double()
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
