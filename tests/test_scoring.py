"""attn/scoring.py against scoring each continuation in one uncached pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn import score_continuations

from .conftest import assert_cache_unchanged, cache_state, tiny_model

ids = st.integers(0, 60)


def full_pass_score(model: attn.TransformerDecoder, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """The reference: one no_grad forward over context + continuation, no cache."""
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = model(tokens)[0, len(context) - 1 : -1].log_softmax(-1)  # (m, v)
    target = torch.tensor(continuation)
    chosen = logprobs.gather(-1, target[:, None]).squeeze(-1)
    return float(chosen.sum()), bool((logprobs.argmax(-1) == target).all())


@given(
    context=st.lists(ids, min_size=1, max_size=12),
    continuations=st.lists(st.lists(ids, min_size=1, max_size=5), min_size=1, max_size=6),
    max_rows=st.one_of(st.none(), st.integers(1, 4)),
    seed=st.integers(0, 2**16),
)
def test_shared_context_scores_equal_full_passes(
    context: list[int], continuations: list[list[int]], max_rows: int | None, seed: int
) -> None:
    model = tiny_model(seed % 7)
    scores = score_continuations(model, context, continuations, max_rows=max_rows)
    assert len(scores) == len(continuations)
    for score, continuation in zip(scores, continuations, strict=True):
        logprob, greedy = full_pass_score(model, context, continuation)
        # fp32 defaults: rtol 1.3e-6, atol 1e-5
        torch.testing.assert_close(torch.tensor(score.logprob), torch.tensor(logprob, dtype=torch.float32))
        assert score.greedy == greedy
    assert not model.caches_are_setup()


def test_greedy_continuations_are_flagged() -> None:
    model = tiny_model(3)
    context = [5, 9, 2]
    greedy = attn.generate(model, [context], max_new_tokens=3).generated[0].tolist()
    other = [(greedy[0] + 1) % 61, *greedy[1:]]
    scores = score_continuations(model, context, [greedy, other])
    assert scores[0].greedy and not scores[1].greedy
    assert scores[0].logprob > scores[1].logprob


def test_compiled_model_compiles_a_prefill_and_one_continuation_graph() -> None:
    from torch._dynamo.testing import CompileCounter

    model = tiny_model(4)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    continuations = [[1, 2, 3], [4], [5, 6], [7, 8, 9], [10]]
    got = score_continuations(compiled, [11, 12, 13, 14], continuations, max_rows=2)  # chunks of 2, 2, 1
    assert counter.frame_count == 2, counter.frame_count
    expected = score_continuations(model, [11, 12, 13, 14], continuations)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.logprob, b.logprob, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("context", "continuations", "kwargs", "message"),
    [
        ([], [[1]], {}, r"context must hold at least one token id"),
        ([1], [], {}, r"continuations must be a non-empty list .* empty: the list"),
        ([1], [[2], []], {}, r"empty: \[1\]"),
        ([1], [[2, 61]], {}, r"token ids must be in \[0, 61\), got \[61\]"),
        ([1], [[2], [3.0]], {}, r"continuation 1 holds torch.float32 values, not integer ids"),
        ([True], [[2]], {}, r"context holds torch.bool values, not integer ids"),
        ([1], [torch.tensor([[2, 3]])], {}, r"continuation 0 must be one sequence of ids \(1-d\), got shape \(1, 2\)"),
        ([1], [[2]], dict(max_rows=0), r"max_rows must be a positive int or None, got 0"),
        ([1] * 60, [[2] * 6], {}, r"need 65 positions, more than the model's max_seq_len \(64\)"),
    ],
)
def test_bad_input(context: list[int], continuations: list[list[int]], kwargs: dict, message: str) -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        score_continuations(model, context, continuations, **kwargs)
    assert not model.caches_are_setup()


def test_tensor_and_numpy_ids_score_as_lists_do() -> None:
    model = tiny_model(7)
    expected = score_continuations(model, [11, 12, 13], [[1, 2], [4]])
    as_tensors = score_continuations(model, torch.tensor([11, 12, 13]), [torch.tensor([1, 2]), torch.tensor([4])])
    as_arrays = score_continuations(model, np.array([11, 12, 13]), [np.array([1, 2]), np.array([4], dtype=np.int32)])
    assert as_tensors == expected and as_arrays == expected


def test_the_models_own_caches_are_never_replaced() -> None:
    model = tiny_model(6)
    model.setup_caches(1, 16)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2, 3]]))
    before = cache_state(model)
    with pytest.raises(RuntimeError, match=r"already has caches set up"):
        score_continuations(model, [1, 2], [[3]])
    assert_cache_unchanged(model, before)
