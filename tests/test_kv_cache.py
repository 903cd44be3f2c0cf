"""attn/kv_cache.py: static buffers, fill position, overflow checked before writing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attn import KVCache


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
    assert {name for name, _ in cache.named_buffers()} == {"k_cache", "v_cache", "cache_pos", "last_write"}


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
