"""Eager against compiled over random sequences of calls, under the default policy.

Two copies of one model, one eager and one ``torch.compile``d (no fullgraph), take the same
calls: inference-mode passes (prefill and decode, over ids made in or out of inference
mode), no_grad passes (over either kind of ids), grad passes with backward, explicit flags
(``cached_inference``, ``disable_kv_cache``), resets. After every call the two caches must
be equal, and logits close. These are the interleavings where a compiled graph could be
reused for the wrong kind of pass (torch 2.6/2.7 trace ``is_inference()`` with a guard that
cannot tell an inference tensor outside inference mode from a normal one inside it).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch._dynamo
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import attn

from .conftest import assert_cache_unchanged, cache_state, tiny_model

BATCH = 2
VOCAB = 61
CAPACITY = 24
KINDS = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "grad": contextlib.nullcontext,
}
FLAGS = {
    "none": lambda model: contextlib.nullcontext(),
    "cached_inference": attn.cached_inference,
    "disable_kv_cache": attn.disable_kv_cache,
}


class EagerAgainstCompiled(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        torch._dynamo.reset()
        self.saved_decision = attn.policy.cache_policy()
        attn.policy.set_cache_policy(None)  # the default: inference mode decides
        self.eager = tiny_model(31, num_layers=2, embed_dim=16, num_heads=2, num_kv_heads=1, hidden_dim=24)
        self.base = copy.deepcopy(self.eager)
        self.compiled = torch.compile(self.base, backend="eager")
        for model in (self.eager, self.base):
            model.setup_caches(BATCH, CAPACITY)
        self.fill = 0

    def teardown(self) -> None:
        attn.policy._decision = self.saved_decision
        torch._dynamo.reset()

    def _ids(self, n: int, seed: int, inference_ids: bool) -> torch.Tensor:
        with torch.inference_mode(inference_ids):
            return torch.randint(0, VOCAB, (BATCH, n), generator=torch.Generator().manual_seed(seed))

    def _both(self, kind: str, flag: str, ids: torch.Tensor) -> None:
        """Runs one pass on both models; checks logits, and the cache left alone where it must be."""
        uses = flag == "cached_inference" or (flag == "none" and kind == "inference_mode")
        before = cache_state(self.base)
        outputs = []
        for call, model in ((self.eager, self.eager), (self.compiled, self.base)):
            with FLAGS[flag](model), KINDS[kind]():
                logits = call(ids)
            if kind == "grad":
                logits.float().logsumexp(-1).mean().backward()
                model.zero_grad(set_to_none=True)
            outputs.append(logits.detach().clone())
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
        if uses:
            self.fill += ids.shape[1]
        else:
            assert_cache_unchanged(self.base, before)

    @rule(
        kind=st.sampled_from(["inference_mode", "no_grad"]),
        flag=st.sampled_from(["none", "disable_kv_cache"]),
        n=st.integers(1, 4),
        seed=st.integers(0, 999),
        inference_ids=st.booleans(),
    )
    def a_pass(self, kind: str, flag: str, n: int, seed: int, inference_ids: bool) -> None:
        if kind == "inference_mode" and flag == "none" and self.fill + n > CAPACITY:
            self.reset()
        self._both(kind, flag, self._ids(n, seed, inference_ids))

    @rule(n=st.integers(1, 4), seed=st.integers(0, 999))
    def a_cached_inference_pass(self, n: int, seed: int) -> None:
        if self.fill + n > CAPACITY:
            self.reset()
        self._both("inference_mode", "cached_inference", self._ids(n, seed, False))

    @rule(n=st.integers(2, 5), seed=st.integers(0, 999))
    def a_grad_pass(self, n: int, seed: int) -> None:
        self._both("grad", "none", self._ids(n, seed, False))

    @precondition(lambda self: self.fill > 0)
    @rule()
    def reset(self) -> None:
        self.eager.reset_caches()
        self.base.reset_caches()
        self.fill = 0

    @invariant()
    def caches_agree(self) -> None:
        for mine, theirs in zip(self.eager.kv_caches(), self.base.kv_caches(), strict=True):
            assert int(mine.cache_pos) == int(theirs.cache_pos) == self.fill
            torch.testing.assert_close(theirs.k_cache, mine.k_cache, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(theirs.v_cache, mine.v_cache, rtol=1e-5, atol=1e-5)


# Each example compiles afresh: a third of the profile's examples (4 by default, 66 with
# --hypothesis-profile=long), 16 calls each.
EagerAgainstCompiled.TestCase.settings = settings(
    settings.default, max_examples=max(1, settings.default.max_examples // 3), stateful_step_count=16
)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::attn.CompatWarning")
class TestEagerAgainstCompiled(EagerAgainstCompiled.TestCase):
    pass
