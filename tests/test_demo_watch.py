"""Reading cache use from the caches themselves (attn/demo/watch.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import attn
from attn.demo.watch import PassRecord, fill_positions, watch
from attn.policy import CachePolicy

from .conftest import tiny_model


def cached_model() -> attn.TransformerDecoder:
    model = tiny_model(0)
    model.setup_caches(2, 32)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 5)))  # not empty: a pass that writes would show
    return model


def test_a_pass_that_writes_the_cache_is_seen(policy: CachePolicy) -> None:
    model = cached_model()
    records: list[PassRecord] = []
    with watch(model, records, pattern="t", kind="decode", expect_cache=True), attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 3)))
    (record,) = records
    assert record.fill_before == (5, 5) and record.fill_after == (8, 8)
    assert record.used_cache and record.buffers_changed and record.ok and record.problem() is None


def test_a_pass_that_leaves_the_cache_alone_is_seen(policy: CachePolicy) -> None:
    model = cached_model()
    records: list[PassRecord] = []
    with watch(model, records, pattern="t", kind="score", expect_cache=False), torch.no_grad():
        model(torch.randint(0, 61, (2, 3)))
    (record,) = records
    assert not record.used_cache and record.ok and fill_positions(model) == [5, 5]


def test_negative_control_plain_inference_mode_writes_the_cache_under_the_inference_policy(
    restore_policy: None,
) -> None:
    """What ``disable_kv_cache`` prevents: the watch must flag it, by the numbers."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)  # forcing INFERENCE on torch 2.13 warns
        attn.policy.set_cache_policy("inference")
    model = cached_model()
    records: list[PassRecord] = []
    attn.policy._reset_warnings()
    trap = pytest.warns(attn.CompatWarning, match="already holds 5 tokens of an earlier sequence")
    with trap, watch(model, records, pattern="eval", kind="scoring", expect_cache=False), torch.inference_mode():
        model(torch.randint(0, 61, (2, 3)))  # a log-likelihood pass without disable_kv_cache
    (record,) = records
    assert record.used_cache and not record.ok
    assert "should have left the cache untouched" in record.problem()
    assert "[5, 5] -> [8, 8]" in record.problem()


def test_a_cache_that_stays_empty_where_it_should_fill_is_a_violation(policy: CachePolicy) -> None:
    model = cached_model()
    model.reset_caches()
    records: list[PassRecord] = []
    with watch(model, records, pattern="eval", kind="generation", expect_cache=True), torch.no_grad():
        model(torch.randint(0, 61, (2, 3)))
    assert not records[0].ok and "should have used the cache" in records[0].problem()


def test_no_caches_is_a_violation() -> None:
    model = tiny_model(0)
    records: list[PassRecord] = []
    with watch(model, records, pattern="t", kind="k", expect_cache=False):
        model(torch.randint(0, 61, (1, 3)))
    assert not records[0].ok and "no caches set up" in records[0].problem()


def test_replacing_the_caches_inside_the_block_raises() -> None:
    model = cached_model()
    with (
        pytest.raises(RuntimeError, match="caches were replaced"),
        watch(model, [], pattern="t", kind="k", expect_cache=False),
    ):
        model.setup_caches(2, 32)


def test_watch_sees_through_torch_compile() -> None:
    model = cached_model()
    compiled = torch.compile(model, backend="eager")
    assert fill_positions(compiled) == [5, 5]
