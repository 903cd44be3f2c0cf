"""The policy contract: which kinds of pass use the cache, under each policy and flag.

Every cell of (policy x kind of pass x flag) is checked against the cache's own fill
position and buffers, not against what the code meant to do.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import attn
from attn.compat import CachePolicy

from .conftest import assert_cache_unchanged, cache_state, tiny_model

PASSES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext,
}
FLAGS = {
    "no flag": lambda model: contextlib.nullcontext(),
    "flag on": lambda model: attn.kv_cache_mode(model, True),
    "disabled": attn.disable_kv_cache,
}


def expected_outcome(policy: CachePolicy, kind: str, flag: str) -> str:
    """The contract, restated independently of the implementation: 'cache', 'none' or 'error'."""
    if flag == "flag on" and kind == "grad":
        return "error"
    if flag == "disabled":
        return "none"
    if policy is CachePolicy.INFERENCE:
        return "cache" if kind == "inference_mode" else "none"
    return "cache" if flag == "flag on" else "none"


@pytest.mark.parametrize(("kind", "flag"), list(itertools.product(PASSES, FLAGS)))
def test_policy_table(policy: CachePolicy, kind: str, flag: str) -> None:
    model = tiny_model()
    model.setup_caches(2, 16)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 3)))  # something in the cache to corrupt
    before = cache_state(model)
    tokens = torch.randint(0, 61, (2, 4))
    outcome = expected_outcome(policy, kind, flag)
    # Under FLAG, inference mode alone does not cache: the pass says so, once per process.
    ignored = policy is CachePolicy.FLAG and kind == "inference_mode" and flag == "no flag"
    warns = pytest.warns(attn.CompatWarning, match="did not use or change the cache")
    with FLAGS[flag](model), PASSES[kind]():
        assert model.caches_are_enabled() is (outcome == "cache")
        if outcome == "error":
            with pytest.raises(RuntimeError, match="grad-enabled forward pass ran with the KV-cache flag on"):
                model(tokens)
        else:
            with warns if ignored else contextlib.nullcontext():
                model(tokens)
    if outcome == "cache":
        assert all(c.size == 7 for c in model.kv_caches())
    else:
        assert_cache_unchanged(model, before)


def test_inference_tensor_ids_in_a_no_grad_pass_do_not_use_the_cache(policy: CachePolicy) -> None:
    model = tiny_model()
    model.setup_caches(1, 16)
    with torch.inference_mode():
        tokens = torch.randint(0, 61, (1, 4))
    before = cache_state(model)
    with torch.no_grad():
        model(tokens)
    assert_cache_unchanged(model, before)


def test_training_step_never_touches_the_cache(policy: CachePolicy) -> None:
    model = tiny_model()
    model.setup_caches(2, 16)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 5)))
    before = cache_state(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 61, (2, 6))
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    assert_cache_unchanged(model, before)


def test_cached_inference_caches_under_every_policy(policy: CachePolicy) -> None:
    model = tiny_model()
    model.setup_caches(1, 16)
    with attn.cached_inference(model):
        assert model.caches_are_enabled()
        model(torch.randint(0, 61, (1, 4)))
        model(torch.randint(0, 61, (1, 1)))
    assert model.kv_caches()[0].size == 5


def test_no_caches_means_nothing_is_enabled(policy: CachePolicy) -> None:
    model = tiny_model()
    with torch.inference_mode():
        assert not model.caches_are_enabled()
        model(torch.randint(0, 61, (1, 4)))
