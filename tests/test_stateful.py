"""Sequences of calls on one model: set up, reset, tear down, cached prefill and decode,
rewinds and row reorders, scoring, training steps, flag toggles and nested context managers,
parity mode on and off, under both policies.

A shadow model of the cache (the tokens it should hold) is checked after every step: fill
positions, buffers left bit-for-bit alone by passes that must not touch them, and cached
logits equal to an uncached forward over the whole shadow sequence.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import attn
from attn.policy import CachePolicy

from .conftest import assert_cache_unchanged, cache_state, examples, tiny_model

BATCH = 2
VOCAB = 61

FLAG_MANAGERS = ["kv_cache_mode(True)", "kv_cache_mode(False)", "disable_kv_cache", "cached_inference"]
PASS_KINDS = ["inference_mode", "no_grad", "grad"]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_model(21, num_layers=2, embed_dim=16, num_heads=2, num_kv_heads=1, hidden_dim=24)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.capacity = 0
        self.cached: torch.Tensor | None = None  # (BATCH, n) tokens the cache should hold
        self.stale = False  # weights (or parity mode) changed since the cache was filled
        self.saved_decision = attn.policy.cache_policy()
        self.saved_slot_step = attn.kv_cache.SLOT_STEP

    @initialize(policy=st.sampled_from(list(CachePolicy)), slot_step=st.sampled_from([64, 4, 1]))
    def choose_policy(self, policy: CachePolicy, slot_step: int) -> None:
        """``slot_step``: attended spans round to it; below the capacities drawn, passes attend
        over fewer slots than the cache holds, and their span grows as it fills."""
        self.policy = policy
        attn.kv_cache.SLOT_STEP = slot_step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", attn.CompatWarning)
            attn.policy.set_cache_policy(policy)

    def teardown(self) -> None:
        attn.policy._decision = self.saved_decision
        attn.kv_cache.SLOT_STEP = self.saved_slot_step

    # -- helpers -------------------------------------------------------------------------

    def _tokens(self, n: int, seed: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (BATCH, n), generator=torch.Generator().manual_seed(seed))

    def _expect_cached_pass(self, new: torch.Tensor, logits: torch.Tensor) -> None:
        full = new if self.cached is None else torch.cat((self.cached, new), 1)
        if not self.stale:
            with torch.no_grad():
                reference = self.model(full)[:, full.shape[1] - new.shape[1] :]
            if self.model.parity:  # parity mode: the cached pass's logits are the full forward's bits
                assert torch.equal(logits, reference)
            else:
                torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        self.cached = full

    def _fill(self) -> int:
        return 0 if self.cached is None else self.cached.shape[1]

    # -- rules ---------------------------------------------------------------------------

    @rule(on=st.booleans())
    def parity_mode(self, on: bool) -> None:
        """Kernels change, the cache does not. Tokens cached by the other kernels differ from a
        recomputation in these in the last bits: stale, as after a training step."""
        before = cache_state(self.model)
        self.stale = self.stale or (self.cached is not None and on != self.model.parity)
        attn.set_parity_mode(self.model, on)
        assert_cache_unchanged(self.model, before)

    @rule(capacity=st.integers(4, 14))
    def setup(self, capacity: int) -> None:
        self.model.setup_caches(BATCH, capacity)
        self.capacity, self.cached, self.stale = capacity, None, False

    @precondition(lambda self: self.model.caches_are_setup())
    @rule()
    def reset(self) -> None:
        self.model.reset_caches()
        self.cached, self.stale = None, False

    @rule()
    def teardown_caches(self) -> None:
        self.model.teardown_caches()
        self.capacity, self.cached, self.stale = 0, None, False

    @precondition(lambda self: self.model.caches_are_setup())
    @rule(n=st.integers(1, 5), seed=st.integers(0, 999))
    def cached_forward(self, n: int, seed: int) -> None:
        """Prefill (n > 1) or decode (n == 1) under cached_inference."""
        new = self._tokens(n, seed)
        if self._fill() + n > self.capacity:
            before = cache_state(self.model)
            try:
                with attn.cached_inference(self.model):
                    self.model(new)
            except RuntimeError as error:
                assert "do not fit in its capacity" in str(error)
            else:
                raise AssertionError("overflow was not refused")
            assert_cache_unchanged(self.model, before)
            return
        with attn.cached_inference(self.model):
            logits = self.model(new)
        self._expect_cached_pass(new, logits)

    @precondition(lambda self: self.model.caches_are_setup())
    @rule(back=st.integers(0, 6), past_the_fill=st.booleans())
    def rewind(self, back: int, past_the_fill: bool) -> None:
        """Rewind ``back`` tokens (a rewind past the fill is refused and changes nothing)."""
        if past_the_fill:
            before = cache_state(self.model)
            try:
                self.model.rewind_caches(self._fill() + 1 + back)
            except ValueError as error:
                assert "cannot rewind to" in str(error)
            else:
                raise AssertionError("a rewind past the fill position was not refused")
            assert_cache_unchanged(self.model, before)
            return
        to = max(self._fill() - back, 0)
        self.model.rewind_caches(to)
        self.cached = None if to == 0 or self.cached is None else self.cached[:, :to]

    @precondition(lambda self: self.model.caches_are_setup())
    @rule(swap=st.booleans())
    def reorder_rows(self, swap: bool) -> None:
        rows = [1, 0] if swap else [0, 1]
        self.model.select_caches(rows)
        if self.cached is not None:
            self.cached = self.cached[rows]

    @rule(n=st.integers(1, 6), seed=st.integers(0, 999), inference_ids=st.booleans())
    def no_grad_scoring(self, n: int, seed: int, inference_ids: bool) -> None:
        if inference_ids:
            with torch.inference_mode():
                new = self._tokens(n, seed)
        else:
            new = self._tokens(n, seed)
        before = cache_state(self.model)
        with torch.no_grad():
            self.model(new)
        assert_cache_unchanged(self.model, before)

    @precondition(lambda self: self.model.caches_are_setup())
    @rule(n=st.integers(1, 3), seed=st.integers(0, 999))
    def plain_inference_mode(self, n: int, seed: int) -> None:
        """torch.inference_mode() alone: caches under INFERENCE, never under FLAG."""
        new = self._tokens(n, seed)
        before = cache_state(self.model)
        fits = self._fill() + n <= self.capacity
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", attn.CompatWarning)
            try:
                with torch.inference_mode():
                    logits = self.model(new)
            except RuntimeError as error:
                assert self.policy is CachePolicy.INFERENCE and not fits, error
                assert_cache_unchanged(self.model, before)
                return
        if self.policy is CachePolicy.INFERENCE:
            assert fits
            self._expect_cached_pass(new, logits)
        else:
            assert_cache_unchanged(self.model, before)

    @rule(seed=st.integers(0, 999))
    def training_step(self, seed: int) -> None:
        tokens = self._tokens(5, seed)
        before = cache_state(self.model)
        self.optimizer.zero_grad()
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        self.optimizer.step()
        assert_cache_unchanged(self.model, before)
        self.stale = self.stale or self.cached is not None

    @rule(
        stack=st.lists(st.sampled_from(FLAG_MANAGERS), min_size=1, max_size=3),
        kind=st.sampled_from(PASS_KINDS),
        seed=st.integers(0, 999),
    )
    def nested_managers(self, stack: list[str], kind: str, seed: int) -> None:
        """A pass inside a stack of managers; the innermost flag and the pass kind decide."""
        if not self.model.caches_are_setup() and any(m in ("kv_cache_mode(True)", "cached_inference") for m in stack):
            return  # entering those without caches is an error, covered in test_context.py
        managers = {
            "kv_cache_mode(True)": lambda: attn.kv_cache_mode(self.model, True),
            "kv_cache_mode(False)": lambda: attn.kv_cache_mode(self.model, False),
            "disable_kv_cache": lambda: attn.disable_kv_cache(self.model),
            "cached_inference": lambda: attn.cached_inference(self.model),
        }
        flag = stack[-1] in ("kv_cache_mode(True)", "cached_inference")
        inference = kind == "inference_mode" or "cached_inference" in stack
        grad = kind == "grad" and not inference
        new = self._tokens(1, seed)
        before = cache_state(self.model)
        kind_manager = {
            "inference_mode": torch.inference_mode,
            "no_grad": torch.no_grad,
            "grad": contextlib.nullcontext,
        }
        with contextlib.ExitStack() as exits, warnings.catch_warnings():
            warnings.simplefilter("ignore", attn.CompatWarning)
            for name in stack:
                exits.enter_context(managers[name]())
            exits.enter_context(kind_manager[kind]())
            if flag and grad:
                try:
                    self.model(new)
                except RuntimeError as error:
                    assert "grad-enabled forward pass" in str(error)
                else:
                    raise AssertionError("a grad-enabled pass with the flag on did not raise")
                uses = False
            else:
                uses = (
                    self.model.caches_are_setup()
                    and not grad
                    and (flag or (self.policy is CachePolicy.INFERENCE and inference))
                    and stack[-1] not in ("kv_cache_mode(False)", "disable_kv_cache")
                )
                if uses and self._fill() + 1 > self.capacity:
                    try:
                        self.model(new)
                    except RuntimeError:
                        uses = False
                    else:
                        raise AssertionError("overflow was not refused")
                else:
                    logits = self.model(new)
        if uses:
            self._expect_cached_pass(new, logits)
        else:
            assert_cache_unchanged(self.model, before)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def fill_positions_match_shadow(self) -> None:
        caches = self.model.kv_caches()
        if not self.model.caches_are_setup():
            assert caches == []
            return
        assert len(caches) == self.model.config.num_layers
        assert all(c.size == self._fill() for c in caches)
        assert all(not c.k_cache.requires_grad and not c.k_cache.is_inference() for c in caches)

    @invariant()
    def flags_and_modes_are_restored(self) -> None:
        assert {layer.attn.cache_state.mode for layer in self.model.layers} == {None}
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


CacheMachine.TestCase.settings = settings(settings.default, max_examples=examples(8), stateful_step_count=25)
TestCacheMachine = CacheMachine.TestCase
