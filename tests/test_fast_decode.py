"""attn/fast_decode.py: the compiled decode step gives eager's answers, keeps the KV-cache
mutable state (never a compiled-in constant), and compiles once for a whole generation.

One inductor compile is shared by the module (tens of seconds on two cores); the other
tests are eager or fail before compiling.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import attn
from attn import compat
from attn.compat import CachePolicy
from attn.fast_decode import DecodeCompiled, compile_for_decode, rowwise_linear

from .conftest import assert_cache_unchanged, cache_state, tiny_model

PROMPTS = [[1, 2, 3, 4], [5, 6]]
OTHER_PROMPTS = [[7, 8], [9, 10, 11, 12]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def fast() -> Iterator[DecodeCompiled]:
    """A tiny model with caches set up once, behind a compiled decode step (compiled here)."""
    before = compat._decision
    compat.set_cache_policy(CachePolicy.FLAG)
    model = tiny_model(11)
    model.setup_caches(2, 32)
    wrapped = compile_for_decode(model)
    attn.generate(wrapped, PROMPTS, max_new_tokens=NEW_TOKENS)  # compiles the decode step
    yield wrapped
    compat._decision = before


def test_rowwise_linear_equals_linear() -> None:
    x, weight = torch.randn(3, 2, 16), torch.randn(24, 16)
    torch.testing.assert_close(rowwise_linear(x, weight), F.linear(x, weight))
    xb, wb = x.bfloat16(), weight.bfloat16()
    got = rowwise_linear(xb, wb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(xb.float(), wb.float()), rtol=2e-2, atol=2e-2)


def test_greedy_tokens_equal_eager_and_one_graph_for_the_generation(fast: DecodeCompiled) -> None:
    model = fast.model
    got = attn.generate(fast, PROMPTS, max_new_tokens=NEW_TOKENS)
    expected = attn.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-4)
    assert fast.stats.graphs == 1, fast.stats  # every position of both generations: one graph
    # q, k, v, o, gate, up, down per layer, and the output head: all rewritten for decode
    assert fast.stats.linears_rewritten == 7 * model.config.num_layers + 1


def test_cache_is_mutable_state_not_a_constant(fast: DecodeCompiled) -> None:
    """A second generation from other prompts must read the cache as it is now."""
    model = fast.model
    got = attn.generate(fast, OTHER_PROMPTS, max_new_tokens=NEW_TOKENS)
    fast_caches = [(c.k_cache.clone(), c.v_cache.clone(), c.cache_pos.clone()) for c in model.kv_caches()]
    expected = attn.generate(model, OTHER_PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.tokens, expected.tokens)
    for (k, v, pos), cache in zip(fast_caches, model.kv_caches(), strict=True):
        assert torch.equal(pos, cache.cache_pos)  # the compiled step advanced the fill position
        torch.testing.assert_close(k, cache.k_cache, rtol=1e-5, atol=1e-5)  # and wrote every slot
        torch.testing.assert_close(v, cache.v_cache, rtol=1e-5, atol=1e-5)
    assert fast.stats.graphs == 1


def test_weights_stay_live_inputs(fast: DecodeCompiled) -> None:
    """No freezing: a weight changed after compiling is used by the next step."""
    model = fast.model
    weight = model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-3.0)
        got = attn.generate(fast, PROMPTS, max_new_tokens=NEW_TOKENS, return_logits=True)
        expected = attn.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, return_logits=True)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
    assert fast.stats.graphs == 1


def test_multi_token_passes_run_eager_and_compile_nothing(fast: DecodeCompiled) -> None:
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), fast.model(tokens))
    assert fast.stats.graphs == 1
    assert fast.config is fast.model.config and fast.kv_caches() == fast.model.kv_caches()


def test_overflow_gets_the_eager_error_and_leaves_the_cache_unchanged(fast: DecodeCompiled) -> None:
    model = fast.model
    capacity = model.kv_caches()[0].max_seq_len
    with attn.cached_inference(model):
        # Made in inference mode, like generate's: a normal tensor would compile a second graph.
        step = dict(input_pos=torch.full((2, 1), capacity - 1), mask=torch.ones(2, 1, capacity, dtype=torch.bool))
        model.reset_caches()
        model(torch.randint(0, 61, (2, capacity - 1)))
        fast(torch.randint(0, 61, (2, 1)), **step)  # the last slot, through the compiled step
        before = cache_state(model)
        with pytest.raises(RuntimeError, match=rf"holds {capacity} tokens, 1 more do not fit in its capacity"):
            fast(torch.randint(0, 61, (2, 1)), **step)
    assert_cache_unchanged(model, before)
    assert fast.stats.graphs == 1  # the step generate compiled, reused


@pytest.mark.requires_no_is_inference_trace
def test_inference_policy_is_refused_where_it_cannot_compile(fast: DecodeCompiled, restore_policy: None) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)
        compat.set_cache_policy(CachePolicy.INFERENCE)
    with pytest.raises(RuntimeError, match="needs the FLAG cache policy"):
        attn.generate(fast, PROMPTS, max_new_tokens=3)
    assert fast.stats.graphs == 1


def test_bad_arguments() -> None:
    model = tiny_model(12)
    with pytest.raises(ValueError, match="max_rows must be a non-negative int"):
        compile_for_decode(model, max_rows=-1)
    with pytest.raises(ValueError, match="vector_bits must be None, 128, 256 or 512"):
        compile_for_decode(model, vector_bits=300)
    with pytest.raises(ValueError, match=r"call model\.eval"):
        compile_for_decode(model.train())
