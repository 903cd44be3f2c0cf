"""attn/kv_cache.py: static buffers, fill position, overflow checked before writing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attn import KVCache, attended_slots
from attn.kv_cache import SLOT_STEP


def _kv(b: int, h_kv: int, s: int, d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h_kv, s, d, generator=g), torch.randn(b, h_kv, s, d, generator=g)


@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=6), batch=st.integers(1, 3))
def test_updates_concatenate_at_fill_position(chunks: list[int], batch: int) -> None:
    cache = KVCache(batch, 2, sum(chunks) + 3, 4)
    ks, vs = [], []
    for i, s in enumerate(chunks):
        k, v = _kv(batch, 2, s, 4, seed=i)
        k_all, _ = cache.update(k, v)
        ks.append(k)
        vs.append(v)
        assert k_all.shape == (batch, 2, sum(chunks) + 3, 4)
    n = sum(chunks)
    assert cache.size == n
    torch.testing.assert_close(cache.k_cache[:, :, :n], torch.cat(ks, 2), rtol=0, atol=0)
    torch.testing.assert_close(cache.v_cache[:, :, :n], torch.cat(vs, 2), rtol=0, atol=0)
    assert not cache.k_cache[:, :, n:].any()


def test_overflow_is_checked_before_writing() -> None:
    cache = KVCache(1, 2, 6, 4)
    cache.update(*_kv(1, 2, 4, 4))
    before = (cache.k_cache.clone(), cache.v_cache.clone())
    with pytest.raises(RuntimeError, match=r"holds 4 tokens, 3 more do not fit in its capacity of 6"):
        cache.update(*_kv(1, 2, 3, 4, seed=1))
    assert cache.size == 4
    assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1])


@given(needed=st.integers(1, 5000), capacity=st.integers(1, 5000))
def test_attended_slots_is_the_least_step_multiple_that_holds_the_tokens(needed: int, capacity: int) -> None:
    span = attended_slots(needed, capacity)
    if needed <= capacity:
        assert needed <= span <= capacity
    assert span <= capacity
    assert span == capacity or (span % SLOT_STEP == 0 and span - SLOT_STEP < needed <= span)  # no step too many


@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_update_with_a_span_returns_views_of_the_first_slots(chunks: list[int], data: st.DataObject) -> None:
    capacity = sum(chunks) + 7
    cache = KVCache(2, 2, capacity, 4)
    for i, s in enumerate(chunks):
        span = data.draw(st.integers(cache.size + s, capacity), label="span")
        k_all, v_all = cache.update(*_kv(2, 2, s, 4, seed=i), span=span)
        assert k_all.shape == v_all.shape == (2, 2, span, 4)
        assert k_all.data_ptr() == cache.k_cache.data_ptr() and v_all.data_ptr() == cache.v_cache.data_ptr()
        assert torch.equal(k_all, cache.k_cache[:, :, :span]) and torch.equal(v_all, cache.v_cache[:, :, :span])


def test_a_span_short_of_the_new_tokens_is_refused_before_writing() -> None:
    cache = KVCache(1, 2, 16, 4)
    cache.update(*_kv(1, 2, 4, 4))
    before = _state(cache)
    with pytest.raises(ValueError, match=r"covers the first 5 cache slots, .* 2 tokens after the 4 .* at least 6"):
        cache.update(*_kv(1, 2, 2, 4, seed=1), span=5)
    for a, b in zip(_state(cache), before, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("span", [0, 17, 2.0, True])
def test_a_span_outside_the_cache_is_refused_before_writing(span: object) -> None:
    cache = KVCache(1, 2, 16, 4)
    before = _state(cache)
    with pytest.raises(ValueError, match=rf"span must be an int in \[1, 16\] .* got {span!r}"):
        cache.update(*_kv(1, 2, 1, 4), span=span)  # type: ignore[arg-type]
    for a, b in zip(_state(cache), before, strict=True):
        assert torch.equal(a, b)


def test_batch_mismatch_is_an_error_not_a_broadcast() -> None:
    cache = KVCache(2, 2, 8, 4)
    with pytest.raises(ValueError, match=r"batch size 1 does not match the KV-cache batch size 2"):
        cache.update(*_kv(1, 2, 1, 4))
    assert cache.size == 0


def test_wrong_head_shape_is_an_error() -> None:
    cache = KVCache(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"expects k and v of shape \(b, 2, s, 4\)"):
        cache.update(*_kv(1, 3, 1, 4))


@pytest.mark.parametrize("field", ["batch_size", "num_kv_heads", "max_seq_len", "head_dim"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_bad_sizes(field: str, value: object) -> None:
    sizes = dict(batch_size=1, num_kv_heads=1, max_seq_len=4, head_dim=2)
    sizes[field] = value
    with pytest.raises(ValueError, match=f"KVCache {field} must be a positive int"):
        KVCache(**sizes)


def test_buffers_are_never_in_state_dict() -> None:
    cache = KVCache(1, 2, 8, 4)
    assert cache.state_dict() == {}
    assert {name for name, _ in cache.named_buffers()} == {
        "k_cache",
        "v_cache",
        "state.fill",
        "state.slot_ids",
        "state.row_ids",
    }


def test_created_in_inference_mode_is_normal_and_resettable_anywhere() -> None:
    with torch.inference_mode():
        cache = KVCache(1, 2, 8, 4)
        cache.update(*_kv(1, 2, 3, 4))
    assert not cache.k_cache.is_inference() and not cache.cache_pos.is_inference()
    cache.reset()  # outside inference mode
    assert cache.size == 0 and not cache.k_cache.any()
    cache.update(*_kv(1, 2, 2, 4))
    with torch.inference_mode():
        cache.reset()  # inside inference mode
    assert cache.size == 0 and not cache.v_cache.any()


def test_torn_down_cache_refuses_updates() -> None:
    cache = KVCache(1, 2, 8, 4)
    cache.torn_down = True
    with pytest.raises(RuntimeError, match="torn down"):
        cache.update(*_kv(1, 2, 1, 4))


def test_dtype_and_casting() -> None:
    cache = KVCache(1, 1, 4, 2, dtype=torch.bfloat16)
    k, v = _kv(1, 1, 1, 2)
    k_all, _ = cache.update(k, v)
    assert k_all.dtype == torch.bfloat16
    torch.testing.assert_close(k_all[:, :, :1].float(), k, rtol=1e-2, atol=1e-2)


def _filled(batch: int, chunks: list[int], capacity: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    cache = KVCache(batch, 2, capacity, 4)
    ks, vs = zip(*(_kv(batch, 2, s, 4, seed=i) for i, s in enumerate(chunks)), strict=True)
    for k, v in zip(ks, vs, strict=True):
        cache.update(k, v)
    return cache, torch.cat(ks, 2), torch.cat(vs, 2)


def _state(cache: KVCache) -> tuple[torch.Tensor, ...]:
    return (cache.k_cache.clone(), cache.v_cache.clone(), cache.cache_pos.clone())


@given(
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    data=st.data(),
    as_tensor=st.booleans(),
    more=st.integers(1, 3),
)
def test_rewind_then_continue_equals_never_going_past(
    chunks: list[int], data: st.DataObject, as_tensor: bool, more: int
) -> None:
    n = sum(chunks)
    capacity = n + more
    cache, k, v = _filled(2, chunks, capacity)
    to = data.draw(st.integers(0, n), label="to")
    cache.rewind(torch.tensor(to) if as_tensor else to)
    fresh = KVCache(2, 2, capacity, 4)
    if to:
        fresh.update(k[:, :, :to], v[:, :, :to])
    for a, b in zip(_state(cache), _state(fresh), strict=True):
        assert torch.equal(a, b)
    extra = _kv(2, 2, more, 4, seed=99)
    cache.update(*extra)
    fresh.update(*extra)
    for a, b in zip(_state(cache), _state(fresh), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("fill", "message"),
    [
        (4, r"cannot rewind to 4: the cache holds 3 tokens, so a rewind goes to 0..3"),
        (-1, r"cannot rewind to -1"),
        (1.5, r"rewind takes an int or a 0-dim integer tensor, got 1.5"),
        (torch.tensor([1]), r"rewind takes an int or a 0-dim integer tensor, got torch.int64 of shape \(1,\)"),
    ],
)
def test_bad_rewind_changes_nothing(fill: object, message: str) -> None:
    cache, _, _ = _filled(1, [3], 6)
    before = _state(cache)
    with pytest.raises(ValueError, match=message):
        cache.rewind(fill)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(_state(cache), before, strict=True))


@given(rows=st.lists(st.integers(0, 2), min_size=1, max_size=7), as_tensor=st.booleans())
def test_select_keeps_the_rows_asked_for(rows: list[int], as_tensor: bool) -> None:
    cache, k, v = _filled(3, [2, 1], 5)
    cache.select(torch.tensor(rows) if as_tensor else rows)
    assert cache.batch_size == len(rows) and cache.size == 3
    assert torch.equal(cache.k_cache[:, :, :3], k[rows]) and torch.equal(cache.v_cache[:, :, :3], v[rows])
    assert not cache.k_cache[:, :, 3:].any()
    cache.update(*_kv(len(rows), 2, 1, 4))  # the new batch size is the one updates must have
    assert cache.size == 4


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([0, 3], r"rows must be in \[0, 3\) \(the cache's batch size\), got min 0 and max 3"),
        ([-1], r"got min -1 and max -1"),
        ([], r"rows must be a non-empty 1-D sequence of row indices, got \[\]"),
        ([[0, 1]], r"non-empty 1-D sequence"),
        ([0.0], r"non-empty 1-D sequence"),
    ],
)
def test_bad_select_changes_nothing(rows: object, message: str) -> None:
    cache, _, _ = _filled(3, [2], 4)
    before = _state(cache)
    with pytest.raises(ValueError, match=message):
        cache.select(rows)  # type: ignore[arg-type]
    assert cache.batch_size == 3
    assert all(torch.equal(a, b) for a, b in zip(_state(cache), before, strict=True))


def test_select_under_inference_mode_keeps_normal_buffers() -> None:
    cache, _, _ = _filled(2, [2], 4)
    with torch.inference_mode():
        cache.select([1, 1, 0])
    assert not cache.k_cache.is_inference() and not cache.v_cache.is_inference()
    cache.reset()  # outside inference mode: possible only on normal tensors


@given(filled=st.integers(0, 7), extra=st.integers(1, 4))
def test_an_unchecked_overflowing_write_changes_no_slot(filled: int, extra: int) -> None:
    """Compiled code cannot run the capacity check, so the write itself must be all or
    nothing: the slots that would fit are not written before the out-of-range one fails."""
    capacity = 8
    cache = KVCache(1, 2, capacity, 4)
    if filled:
        cache.update(*_kv(1, 2, filled, 4))
    before = _state(cache)
    k, v = _kv(1, 2, capacity - filled + extra, 4, seed=5)  # one slot too many at least
    slots = cache.state.write_slots(cache.state.query_slots(k.shape[2]))  # the plan's slots, unchecked
    with pytest.raises((IndexError, RuntimeError)):
        cache.write(slots, k, v, span=capacity)
    for a, b in zip(_state(cache), before, strict=True):
        assert torch.equal(a, b)
