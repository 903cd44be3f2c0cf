"""The demo's patterns (attn/demo/patterns.py, attn/demo/speed.py), each under both cache policies.

Every pattern runs on a model with its caches set up and filled, and must use the cache exactly
where it should: checked here from the fill positions and buffers directly (conftest's
``cache_state``), independently of the records the patterns return. Log-likelihoods must equal
those of a deep copy of the model that never had caches set up.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

import attn
from attn.bench.baseline import greedy_without_cache
from attn.demo.lora import LoRALinear, lora_parameters
from attn.demo.model import build_model
from attn.demo.patterns import (
    candidate_scores,
    eval_pattern,
    generation_task,
    loglikelihood_task,
    lora_ppo_pattern,
    ppo_pattern,
    train,
)
from attn.demo.speed import measure_speed
from attn.demo.task import AdditionTask
from attn.policy import CachePolicy

from .conftest import assert_cache_unchanged, cache_state

BATCH = 16


@pytest.fixture(scope="module")
def task() -> AdditionTask:
    """One-digit operands: the patterns do not care, and a model learns them in a few seconds."""
    return AdditionTask(num_digits=1, num_eval=BATCH, seed=1)


@pytest.fixture(scope="module")
def trained(task: AdditionTask) -> dict[str, torch.Tensor]:
    """Weights after a short training run: far from random, not yet perfect (PPO has signal)."""
    model = build_model(task, seed=1)
    train(model, task, steps=120, batch_size=32, seed=1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def fresh(
    task: AdditionTask, state: dict[str, torch.Tensor]
) -> tuple[attn.TransformerDecoder, attn.TransformerDecoder]:
    """The model with caches set up and filled by a generation, and a deep copy that never had caches."""
    model = build_model(task, seed=1)
    model.load_state_dict(state)
    never_cached = copy.deepcopy(model)  # taken before setup_caches: it never had a cache
    model.setup_caches(BATCH, 64)
    generation_task(model, task, task.eval_problems)  # the caches now hold a generation
    assert not never_cached.caches_are_setup()
    assert min(fills(model)) > len(task.prompt_ids(task.eval_problems[0]))
    return model, never_cached


def fills(model: attn.TransformerDecoder) -> list[int]:
    return [c.size for c in model.kv_caches()]


def test_training_never_touches_the_cache(task: AdditionTask, trained: dict, policy: CachePolicy) -> None:
    model, _ = fresh(task, trained)
    before, filled = cache_state(model), fills(model)
    weights = model.output.weight.clone()
    result = train(model, task, steps=4, batch_size=8)
    assert_cache_unchanged(model, before)
    assert not torch.equal(weights, model.output.weight), "training did not train"
    (record,) = result.records
    assert record.ok and not record.used_cache and record.count == 4 and list(record.fill_before) == filled


def test_eval_pattern_uses_the_cache_only_to_generate(task: AdditionTask, trained: dict, policy: CachePolicy) -> None:
    model, never_cached = fresh(task, trained)
    attn.policy._reset_warnings()
    if policy is CachePolicy.FLAG:  # the hand-written inference-mode loop leaves the cache alone, and says so
        with pytest.warns(attn.CompatWarning, match="did not use or change the cache"):
            result = eval_pattern(model, task, task.eval_problems)
    else:
        result = eval_pattern(model, task, task.eval_problems)
    # generate, no_grad scoring, generate again, a plain torch.inference_mode() decode loop
    by_default = policy is CachePolicy.INFERENCE
    assert [r.expect_cache for r in result.records] == [True, False, True, by_default]
    assert [r.used_cache for r in result.records] == [True, False, True, by_default]
    assert all(r.ok for r in result.records)
    assert result.loop_matches_generate
    assert result.records[1].fill_before == result.records[1].fill_after == result.records[0].fill_after
    assert result.same_completions and result.generation_accuracy == result.generation_again_accuracy
    # the scores the pattern compared equal a deep copy that never had caches, bit for bit
    assert result.scores_bit_identical and result.scores_max_abs_diff == 0.0
    _, scores = loglikelihood_task(model, task, task.eval_problems)
    with torch.no_grad():
        expected, right = candidate_scores(never_cached, task, task.eval_problems)
    assert torch.equal(scores, expected)
    assert result.loglikelihood_accuracy == (expected.argmax(-1) == right).float().mean().item()


def test_loglikelihood_task_leaves_a_full_cache_untouched(
    task: AdditionTask, trained: dict, policy: CachePolicy
) -> None:
    model, _ = fresh(task, trained)
    before, filled = cache_state(model), fills(model)
    loglikelihood_task(model, task, task.eval_problems)
    assert_cache_unchanged(model, before)
    assert fills(model) == filled


def test_ppo_pattern(task: AdditionTask, trained: dict, policy: CachePolicy) -> None:
    model, _ = fresh(task, trained)
    weights = model.output.weight.clone()
    result = ppo_pattern(model, task, task.eval_problems, seed=2)
    rollout, step = result.records
    prompt_length = len(task.prompt_ids(task.eval_problems[0]))
    assert rollout.ok and rollout.used_cache and rollout.fill_before == (0, 0)
    assert rollout.fill_after[0] >= prompt_length
    assert step.ok and not step.used_cache and step.fill_before == rollout.fill_after
    assert not result.tokens_are_inference
    assert result.logprobs_match, result.logprob_max_abs_diff
    assert 0.0 < result.mean_rewards[0] < 1.0, "no signal: the fixture's training changed"
    assert not torch.equal(weights, model.output.weight), "the policy step did not step"


def test_generated_tokens_feed_a_grad_pass_without_clone(
    task: AdditionTask, trained: dict, policy: CachePolicy
) -> None:
    model, _ = fresh(task, trained)
    out = attn.generate(model, [task.prompt_ids(p) for p in task.eval_problems], max_new_tokens=4)
    before = cache_state(model)
    logits = model(out.tokens, input_pos=out.positions, mask=attn.padded_causal_mask(out.padding_mask))
    logits.logsumexp(-1).mean().backward()
    assert model.output.weight.grad is not None
    assert_cache_unchanged(model, before)


def test_lora_ppo_pattern(task: AdditionTask, trained: dict, policy: CachePolicy) -> None:
    model, never_cached = fresh(task, trained)
    base_weights = {k: v.clone() for k, v in model.state_dict().items()}
    result = lora_ppo_pattern(model, task, task.eval_problems, steps=2, seed=2)
    kinds = [r.kind for r in result.records]
    assert (
        kinds
        == [
            "rollout: attn.generate (sampled)",
            "reference logits: no_grad, adapters off",
            "policy step (grad) on generated tokens",
        ]
        * 2
    )
    assert all(r.ok for r in result.records)
    assert [r.used_cache for r in result.records] == [True, False, False] * 2
    assert result.kl[0] == 0.0 and result.kl[1] > 0.0  # fresh adapters change nothing; then they do
    assert result.logprobs_match and not result.tokens_are_inference
    # only the adapters trained: with them off the model is the one before LoRA-PPO
    adapters = {id(m.base) for m in model.modules() if isinstance(m, LoRALinear)}
    assert len(adapters) == 14 and result.trainable_parameters == sum(p.numel() for p in lora_parameters(model))
    for name, value in model.state_dict().items():
        original = name.replace(".base.", ".")
        if original in base_weights and ".down." not in name and ".up." not in name:
            assert torch.equal(value, base_weights[original]), name
    from attn.demo.lora import adapters_enabled

    tokens = torch.tensor([task.prompt_ids(p) for p in task.eval_problems])
    with torch.no_grad(), adapters_enabled(model, False):
        torch.testing.assert_close(model(tokens), never_cached(tokens), rtol=0, atol=0)


def test_speed_compares_the_same_tokens(task: AdditionTask, trained: dict, policy: CachePolicy) -> None:
    model, _ = fresh(task, trained)
    result = measure_speed(model, task, task.eval_problems, new_tokens=12, repeats=2)
    assert [r.expect_cache for r in result.records] == [True, False, True, False]
    with_cache, without_cache = result.records[2:]
    prompt_length = len(task.prompt_ids(task.eval_problems[0]))
    assert with_cache.ok and with_cache.used_cache and with_cache.fill_after == (prompt_length + 12 - 1,) * 2
    assert without_cache.ok and not without_cache.used_cache
    assert result.same_tokens and result.cached_tokens_per_s > 0 and result.uncached_tokens_per_s > 0


def test_greedy_without_cache_matches_generate_on_ragged_prompts(task: AdditionTask, trained: dict) -> None:
    model, never_cached = fresh(task, trained)
    prompts = [[1, 4, 5], [1, 6, 13, 8, 14], [1, 3]]
    expected = attn.generate(never_cached, prompts, max_new_tokens=6).tokens
    assert torch.equal(greedy_without_cache(model, prompts, max_new_tokens=6, pad_id=0), expected)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Compiles from scratch, and leaves no compiled code or dynamic-shape marks to later tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("forced", ["flag", "inference"])
def test_patterns_compiled(
    task: AdditionTask, trained: dict, forced: str, restore_policy: None, fresh_dynamo: None
) -> None:
    """Eager and compiled must agree about which passes used the cache (dynamo only, to stay fast)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)  # forcing INFERENCE on torch 2.13 warns
        attn.policy.set_cache_policy(forced)
    model, _ = fresh(task, trained)
    compiled = torch.compile(model, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=64):
        evaluated = eval_pattern(compiled, task, task.eval_problems)
        ppo = lora_ppo_pattern(compiled, task, task.eval_problems, steps=1, seed=2)
    records = evaluated.records + ppo.records
    assert [r.used_cache for r in records] == [True, False, True, forced == "inference", True, False, False]
    assert evaluated.loop_matches_generate
    assert all(r.ok for r in records), [r.problem() for r in records]
    assert evaluated.scores_match and ppo.logprobs_match
