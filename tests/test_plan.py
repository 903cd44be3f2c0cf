"""attn/plan.py: one plan per forward, checked against a naive restatement; layers only compute."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn.kv_cache import CacheState, KVCache
from attn.plan import plan_pass
from attn.rope import RotaryEmbedding
from tests.conftest import GEMMA_OPTIONS, tiny_model


def _state(batch: int, capacity: int, filled: int) -> CacheState:
    cache = KVCache(batch, 1, capacity, 2)
    if filled:
        cache.update(torch.ones(batch, 1, filled, 2), torch.ones(batch, 1, filled, 2))
    return cache.state


def _naive_mask(query_slots: list[int], n: int, window: int | None) -> torch.Tensor:
    """(s, n): query slot q sees key slot j iff j <= q (and j > q - window)."""
    rows = [[j <= q and (window is None or j > q - window) for j in range(n)] for q in query_slots]
    return torch.tensor(rows, dtype=torch.bool)


@given(
    batch=st.integers(1, 3),
    capacity=st.integers(1, 40),
    data=st.data(),
    window=st.none() | st.integers(1, 12),
    per_row_positions=st.booleans(),
)
def test_a_cached_plan_is_the_naive_one(
    batch: int, capacity: int, data: st.DataObject, window: int | None, per_row_positions: bool
) -> None:
    filled = data.draw(st.integers(0, capacity - 1), label="filled")
    s = data.draw(st.integers(1, capacity - filled), label="s")
    state = _state(batch, capacity, filled)
    rope = RotaryEmbedding(4, capacity)
    positions = None
    if per_row_positions:
        positions = torch.tensor([[data.draw(st.integers(0, capacity - 1)) for _ in range(s)] for _ in range(batch)])
    plan = plan_pass(state, True, batch, s, rope, input_pos=positions, mask=None, window=window)
    query_slots = list(range(filled, filled + s))
    span = plan.mask.shape[-1]
    assert span == attn.attended_slots(filled + s, capacity)  # eager: the filled slots rounded up
    assert torch.equal(plan.mask, _naive_mask(query_slots, span, window))
    assert plan.slots.tolist() == query_slots
    table = rope.cos_sin  # (2, L, d)
    if positions is None:
        assert torch.equal(plan.rotation, table[:, query_slots])
    else:
        assert torch.equal(plan.rotation, table[:, positions].unsqueeze(2))  # (2, b, 1, s, d)


@given(s=st.integers(1, 20), window=st.none() | st.integers(1, 12))
def test_an_uncached_plan_is_causal_with_the_window_only_where_it_bites(s: int, window: int | None) -> None:
    state = _state(1, 32, 5)
    plan = plan_pass(state, False, 1, s, RotaryEmbedding(4, 32), input_pos=None, mask=None, window=window)
    assert plan.slots is None
    if window is None or s <= window:
        assert plan.mask is None  # SDPA's causal kernel
    else:
        assert torch.equal(plan.mask, _naive_mask(list(range(s)), s, window))
    assert torch.equal(plan.rotation, RotaryEmbedding(4, 32).cos_sin[:, :s])


def test_a_plan_over_the_capacity_is_refused_before_any_write() -> None:
    state = _state(1, 8, 6)
    before = (state.fill.clone(), state.caches[0].k_cache.clone())
    with pytest.raises(RuntimeError, match=r"holds 6 tokens, 3 more do not fit in its capacity of 8"):
        plan_pass(state, True, 1, 3, RotaryEmbedding(4, 8), input_pos=None, mask=None, window=None)
    assert torch.equal(state.fill, before[0]) and torch.equal(state.caches[0].k_cache, before[1])


@pytest.mark.parametrize("cached", [False, True])
def test_a_forward_plans_once_and_every_layer_computes_that_plan(monkeypatch: pytest.MonkeyPatch, cached: bool) -> None:
    model = tiny_model(4, num_layers=5)
    model.setup_caches(2, 16)
    rotations, plans = [], []
    original_rotation, original_compute = RotaryEmbedding.rotation, attn.MultiHeadAttention.compute

    def count_rotation(self: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
        rotations.append(positions)
        return original_rotation(self, positions)

    def record_plan(self: attn.MultiHeadAttention, x: torch.Tensor, plan: object) -> torch.Tensor:
        plans.append(plan)
        return original_compute(self, x, plan)

    monkeypatch.setattr(RotaryEmbedding, "rotation", count_rotation)
    monkeypatch.setattr(attn.MultiHeadAttention, "compute", record_plan)
    with torch.inference_mode() if cached else torch.no_grad():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert len(rotations) == 1  # one RoPE gather per forward, not one or two per layer
    assert len(plans) == 5 and all(plan is plans[0] for plan in plans)
    assert (plans[0].slots is not None) == cached
    assert model.cache_state.size == (3 if cached else 0)


@given(
    cached=st.booleans(),
    filled=st.integers(0, 10),
    s=st.integers(1, 12),
    window=st.integers(1, 12),
    own_rope=st.booleans(),
)
def test_a_plan_for_some_windowed_layers_gives_them_their_own_part(
    cached: bool, filled: int, s: int, window: int, own_rope: bool
) -> None:
    """Gemma: the plan proper is unwindowed; its ``local`` part has the same slots, the window
    ANDed into its mask, and the rotation of the windowed layers' RoPE."""
    state = _state(1, 24, filled if cached else 0)
    rope, local_rope = RotaryEmbedding(4, 24), RotaryEmbedding(4, 24, base=100.0)
    local_rope = local_rope if own_rope else rope
    plan = plan_pass(state, cached, 1, s, rope, input_pos=None, mask=None, window=None, local=(window, local_rope))
    first = filled if cached else 0
    query_slots = list(range(first, first + s))
    n = plan.mask.shape[-1] if cached else s
    assert plan.mask is None if not cached else torch.equal(plan.mask, _naive_mask(query_slots, n, None))
    local = plan.local
    assert local.local is None and local.slots is plan.slots
    if not cached and s <= window:
        assert local.mask is None  # the whole pass fits the window: the causal kernel
    else:
        assert torch.equal(local.mask, _naive_mask(query_slots, n, window))
    assert torch.equal(plan.rotation, rope.cos_sin[:, query_slots])
    assert torch.equal(local.rotation, local_rope.cos_sin[:, query_slots])


@pytest.mark.parametrize("cached", [False, True])
def test_gemma_layers_take_their_part_of_one_plan(monkeypatch: pytest.MonkeyPatch, cached: bool) -> None:
    model = tiny_model(4, num_layers=4, **(GEMMA_OPTIONS["gemma3"] | {"window_layers": (0, 2)}))
    model.setup_caches(1, 16)
    plans = []
    original_compute = attn.MultiHeadAttention.compute

    def record_plan(self: attn.MultiHeadAttention, x: torch.Tensor, plan: object) -> torch.Tensor:
        plans.append(plan)
        return original_compute(self, x, plan)

    monkeypatch.setattr(attn.MultiHeadAttention, "compute", record_plan)
    with torch.inference_mode() if cached else torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5]]))
    whole = plans[1]
    assert whole.local is not None and [plan is whole.local for plan in plans] == [True, False, True, False]
    assert all(plan is whole for plan in plans[1::2])


@pytest.mark.parametrize(
    ("options", "parity", "kernel"),
    [({}, False, "sdpa"), ({}, True, "exact"), (GEMMA_OPTIONS["gemma2"], False, "softcap")],
)
def test_the_plan_chooses_the_attention_kernel(
    monkeypatch: pytest.MonkeyPatch, options: dict, parity: bool, kernel: str
) -> None:
    model = tiny_model(4, **options)
    attn.set_parity_mode(model, parity)
    chosen = []
    original_attend = attn.MultiHeadAttention.attend

    def record(self: attn.MultiHeadAttention, *args: object) -> torch.Tensor:
        chosen.append(args[5])  # kernel
        return original_attend(self, *args)

    monkeypatch.setattr(attn.MultiHeadAttention, "attend", record)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert chosen == [kernel] * model.config.num_layers
