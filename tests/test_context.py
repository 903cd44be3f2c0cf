"""attn/context.py: each context manager restores state on exit, on error, and nests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn

from .conftest import assert_cache_unchanged, cache_state, tiny_model


def modes(model: attn.TransformerDecoder) -> set:
    return {layer.attn.cache_state.mode for layer in model.layers}


def test_kv_cache_mode_sets_and_restores() -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    assert modes(model) == {None}
    with attn.kv_cache_mode(model) as inner:
        assert inner is model and modes(model) == {True}
        with attn.disable_kv_cache(model):
            assert modes(model) == {False}
            with attn.kv_cache_mode(model, True):
                assert modes(model) == {True}  # the innermost wins
            assert modes(model) == {False}
        assert modes(model) == {True}
    assert modes(model) == {None}


@given(st.lists(st.sampled_from(["on", "off", "disable", "cached_inference"]), max_size=5), st.booleans())
def test_any_nesting_restores_on_exit_and_on_error(stack: list[str], fail: bool) -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    managers = {
        "on": lambda: attn.kv_cache_mode(model, True),
        "off": lambda: attn.kv_cache_mode(model, False),
        "disable": lambda: attn.disable_kv_cache(model),
        "cached_inference": lambda: attn.cached_inference(model),
    }
    expected_inside = {"on": True, "off": False, "disable": False, "cached_inference": True}
    grad_before = torch.is_grad_enabled()

    def enter(level: int) -> None:
        if level == len(stack):
            if fail:
                raise KeyError("body failed")
            return
        with managers[stack[level]]():
            assert modes(model) == {expected_inside[stack[level]]}
            enter(level + 1)
            assert modes(model) == {expected_inside[stack[level]]}

    if fail:
        with pytest.raises(KeyError, match="body failed"):
            enter(0)
    else:
        enter(0)
    assert modes(model) == {None}
    assert torch.is_grad_enabled() == grad_before and not torch.is_inference_mode_enabled()


def test_cached_inference_enters_inference_mode() -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    with attn.cached_inference(model):
        assert torch.is_inference_mode_enabled()
    assert not torch.is_inference_mode_enabled()


def test_flag_on_without_caches_is_an_error() -> None:
    model = tiny_model()
    with pytest.raises(RuntimeError, match=r"needs caches: call model.setup_caches"), attn.kv_cache_mode(model):
        pass
    with pytest.raises(RuntimeError, match=r"needs caches"), attn.cached_inference(model):
        pass
    assert modes(model) == {None} and not torch.is_inference_mode_enabled()
    with attn.disable_kv_cache(model):  # disabling needs no caches
        assert modes(model) == {False}


def test_bad_mode_and_module() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"mode must be True or False, got 'yes'"), attn.kv_cache_mode(model, "yes"):
        pass
    with (
        pytest.raises(ValueError, match=r"Linear has no attn.MultiHeadAttention layers"),
        attn.disable_kv_cache(torch.nn.Linear(2, 2)),
    ):
        pass


def test_local_kv_cache_sets_up_and_tears_down() -> None:
    model = tiny_model()
    with attn.local_kv_cache(model, batch_size=2, max_seq_len=12, dtype=torch.float64) as inner:
        assert inner is model
        caches = model.kv_caches()
        assert [(c.batch_size, c.max_seq_len, c.k_cache.dtype) for c in caches[:1]] == [(2, 12, torch.float64)]
    assert not model.caches_are_setup()
    with pytest.raises(ZeroDivisionError), attn.local_kv_cache(model, batch_size=1, max_seq_len=4):
        assert model.caches_are_setup()
        raise ZeroDivisionError
    assert not model.caches_are_setup()


def test_local_kv_cache_refuses_to_drop_existing_caches() -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    old = model.kv_caches()
    with (
        pytest.raises(RuntimeError, match="already has caches set up"),
        attn.local_kv_cache(model, batch_size=1, max_seq_len=4),
    ):
        pass
    assert model.kv_caches() == old


@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=3))
def test_uncached_passes_leave_a_filled_cache_untouched_and_match_a_recompute(lengths: list[int]) -> None:
    """The lm-eval adapter's full passes run inside ``uncached_passes`` after a generation:
    inference mode, but the caches are neither read nor written."""
    model = tiny_model(5)
    attn_cache_rows = 2
    model.setup_caches(attn_cache_rows, 32)
    attn.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4)  # leaves the caches filled
    before = cache_state(model)
    for s in lengths:
        tokens = torch.randint(0, 61, (attn_cache_rows, s))
        with attn.context.uncached_passes(model):
            logits = model(tokens)
        with torch.no_grad(), attn.disable_kv_cache(model):
            expected = model(tokens)  # no cache involved: a full causal pass
        assert torch.equal(logits, expected)
    assert_cache_unchanged(model, before)
