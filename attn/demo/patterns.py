"""The demo's steps, one function per pattern: train, eval, PPO, LoRA-PPO.

Shapes: b = batch, s = sequence, P = prompt width, N = new tokens, n = problems,
k = candidates per problem, v = vocab.

Every function takes the model to call (a ``TransformerDecoder`` or a ``torch.compile`` of
one) with its caches set up, and wraps each kind of pass in ``watch``: the result records
whether the pass used the cache, read from the caches' fill positions and buffers. The
patterns are written the way the README teaches them:

- generation: ``attn.generate``, or a hand-written loop under plain ``torch.inference_mode()``
  (the cache is used by default);
- scoring without gradients: ``torch.no_grad()`` (the cache is left alone);
- PPO's reference logits: ``torch.no_grad()`` with the adapters off;
- training: plain grad-enabled passes.

Nothing here touches the caches by hand except ``reset_caches()`` before a generation, so
that its fill position starts at zero and its growth is visible.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from attn.decoder import TransformerDecoder
from attn.demo.lora import adapters_enabled, add_lora, lora_parameters
from attn.demo.task import IGNORE_INDEX, AdditionTask, Problem
from attn.demo.watch import JsonResult, PassRecord, base_model, watch
from attn.generation import GenerationOutput, generate
from attn.masks import padded_causal_mask
from attn.policy import CachePolicy, cache_policy

__all__ = [
    "EvalResult",
    "PPOResult",
    "TrainResult",
    "eval_pattern",
    "generation_task",
    "lora_ppo_pattern",
    "loglikelihood_task",
    "ppo_pattern",
    "train",
]

LOGPROB_TOLERANCE = 1e-4
"""Largest difference allowed between log-probs of one model with its caches set up (but not
used) and of a copy that never had a cache: compiled kernels may reorder float sums."""


# -- train --------------------------------------------------------------------------------


@dataclass
class TrainResult(JsonResult):
    """What ``train`` did: losses, time, and the record of its grad-enabled passes."""

    steps: int
    batch_size: int
    first_loss: float
    last_loss: float
    seconds: float
    records: list[PassRecord] = field(default_factory=list)


def train(
    model: nn.Module,
    task: AdditionTask,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Trains ``model`` on the task with AdamW, warm-up then cosine decay.

    The caches stay set up throughout; every pass is grad-enabled, so none may touch them.

    Args:
        model: the model to call (caches set up).
        task: the addition task.
        steps: optimizer steps.
        batch_size: problems per step.
        lr: peak learning rate.
        seed: seeds the batches.
        on_step: called as ``on_step(step, loss)`` after each step (a progress bar).
    """
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    base = base_model(model)
    optimizer = torch.optim.AdamW(base.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(seed)
    records: list[PassRecord] = []
    losses = []
    start = time.perf_counter()
    with watch(model, records, pattern="train", kind="training step (grad)", expect_cache=False, count=steps):
        for step in range(steps):
            tokens, targets = task.training_batch(batch_size, generator)  # each (b, T)
            logits = model(tokens)  # (b, T, v)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.detach())
            if on_step is not None:
                on_step(step + 1, float(losses[-1]))
    return TrainResult(
        steps=steps,
        batch_size=batch_size,
        first_loss=float(losses[0]),
        last_loss=float(losses[-1]),
        seconds=time.perf_counter() - start,
        records=records,
    )


# -- the two eval tasks -------------------------------------------------------------------


def generation_task(model: nn.Module, task: AdditionTask, problems: list[Problem]) -> tuple[float, list[str]]:
    """Greedy completions of the problems' prompts (``attn.generate``), by exact match.

    Returns:
        ``(accuracy, completions)``: the share of exact matches, and each decoded completion.
    """
    tok = task.tokenizer
    out = generate(
        model,
        [task.prompt_ids(p) for p in problems],
        max_new_tokens=task.max_answer_len,
        stop_tokens=[tok.eos_id],
        pad_id=tok.pad_id,
    )
    completions = [tok.decode(row) for row in out.generated.tolist()]
    correct = sum(task.is_correct(p, c) for p, c in zip(problems, completions, strict=True))
    return correct / len(problems), completions


def candidate_scores(
    model: nn.Module, task: AdditionTask, problems: list[Problem]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probability of each candidate answer (digits and ``eos``) after its prompt.

    One forward pass over every (problem, candidate) row, right-padded: causal attention
    means the padding after a row never affects its scores. The caller chooses the mode.

    Returns:
        ``(scores, right)``: scores (n, k) float32, right (n,) the index of the right answer.
    """
    tokens, targets, right = task.candidate_batch(problems)  # (n * k, T), (n * k, T), (n,)
    logits = model(tokens)  # (n * k, T, v)
    logprobs = logits.float().log_softmax(-1)  # (n * k, T, v)
    counted = targets != IGNORE_INDEX  # (n * k, T)
    picked = logprobs.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)  # (n * k, T)
    scores = (picked * counted).sum(-1)  # (n * k,)
    return scores.view(len(problems), task.num_candidates), right  # (n, k)


def loglikelihood_task(model: nn.Module, task: AdditionTask, problems: list[Problem]) -> tuple[float, torch.Tensor]:
    """The log-likelihood task, run as an eval harness should on a model with caches set up.

    Scoring runs under ``torch.no_grad()``: under every policy, no such pass touches the
    cache (under plain ``torch.inference_mode()`` it would append to the generation's keys
    and score against them; ``attn`` warns when that happens).

    Returns:
        ``(accuracy, scores)``: the share of problems whose right answer scored highest, and
        the (n, k) scores.
    """
    with torch.no_grad():
        scores, right = candidate_scores(model, task, problems)
    accuracy = (scores.argmax(-1) == right).float().mean().item()
    return accuracy, scores


# -- eval ---------------------------------------------------------------------------------


@dataclass
class EvalResult(JsonResult):
    """The eval pattern: generation, log-likelihood, generation again, and the no-cache check."""

    json_derived = ("scores_match",)

    generation_accuracy: float
    loglikelihood_accuracy: float
    generation_again_accuracy: float
    same_completions: bool
    loop_matches_generate: bool
    scores_max_abs_diff: float
    scores_bit_identical: bool
    examples: list[str]
    records: list[PassRecord] = field(default_factory=list)

    @property
    def scores_match(self) -> bool:
        return self.scores_max_abs_diff <= LOGPROB_TOLERANCE


def inference_mode_decode(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy tokens from a hand-written loop under plain ``torch.inference_mode()``.

    No flag and no ``attn`` call: the passes use the cache because they run in inference
    mode (the default policy). Prompts are all one length, so no padding or mask is needed.

    Args:
        prompts: (b, P) token ids.

    Returns:
        (b, N) the generated tokens.
    """
    tokens = []
    with torch.inference_mode():
        logits = model(prompts)  # prefill: writes the cache
        for step in range(new_tokens):
            token = logits[:, -1:].argmax(-1)  # (b, 1)
            tokens.append(token)
            if step < new_tokens - 1:
                logits = model(token)  # decode: one token, attends to the cache
    return torch.cat(tokens, 1).clone()  # (b, N)


def never_cached_copy(model: nn.Module) -> TransformerDecoder:
    """A new ``TransformerDecoder`` with ``model``'s weights that never had caches set up.

    Built from the config and the ``state_dict`` (which never carries a cache), not by
    deep-copying: the copy has no cache state to inherit.
    """
    base = base_model(model)
    copy = TransformerDecoder(base.config)
    copy.load_state_dict(base.state_dict())
    if copy.caches_are_setup():
        raise AssertionError("a freshly built TransformerDecoder has caches set up")
    return copy.eval()


def eval_pattern(model: nn.Module, task: AdditionTask, problems: list[Problem]) -> EvalResult:
    """Generation task, log-likelihood task, generation task again, on one model with caches.

    The log-likelihood scores are compared with those of ``never_cached_copy(model)``: a
    scoring pass that touched the cache would attend to the generation's stale keys and
    score differently (the bug this library exists to prevent).
    """
    records: list[PassRecord] = []
    base = base_model(model)
    base.reset_caches()
    with watch(model, records, pattern="eval", kind="generation task: attn.generate", expect_cache=True):
        accuracy, completions = generation_task(model, task, problems)
    with watch(model, records, pattern="eval", kind="log-likelihood task: torch.no_grad()", expect_cache=False):
        loglik_accuracy, scores = loglikelihood_task(model, task, problems)
    reference = never_cached_copy(model)
    with torch.inference_mode():
        expected, _ = candidate_scores(reference, task, problems)
    diff = (scores - expected).abs().max().item()
    base.reset_caches()
    with watch(model, records, pattern="eval", kind="generation task again: attn.generate", expect_cache=True):
        again, completions_again = generation_task(model, task, problems)
    prompts = torch.tensor([task.prompt_ids(p) for p in problems])  # (n, P): one length
    base.reset_caches()
    by_default = cache_policy().policy is CachePolicy.INFERENCE  # not under ATTN_CACHE_POLICY=flag
    with watch(
        model,
        records,
        pattern="eval",
        kind="hand-written decode loop: plain torch.inference_mode()",
        expect_cache=by_default,
    ):
        looped = inference_mode_decode(model, prompts, task.max_answer_len)
    base.reset_caches()
    generated = generate(model, prompts, max_new_tokens=task.max_answer_len).generated
    examples = [f"{task.prompt_text(p)}{c}" for p, c in zip(problems[:4], completions[:4], strict=True)]
    return EvalResult(
        generation_accuracy=accuracy,
        loglikelihood_accuracy=loglik_accuracy,
        generation_again_accuracy=again,
        same_completions=completions == completions_again,
        loop_matches_generate=bool(torch.equal(looped, generated)) or not by_default,
        scores_max_abs_diff=diff,
        scores_bit_identical=bool(torch.equal(scores, expected.clone())),
        examples=examples,
        records=records,
    )


# -- PPO ----------------------------------------------------------------------------------


@dataclass
class PPOResult(JsonResult):
    """One or more PPO steps: rewards, losses, and the records of each kind of pass."""

    json_derived = ("logprobs_match",)

    pattern: str
    """``"ppo"`` or ``"lora-ppo"``."""
    steps: int
    mean_rewards: list[float]
    """Per step, over the batch."""
    losses: list[float]
    kl: list[float]
    """Per step: the policy's KL to the reference (the base model, or the adapters off)."""
    logprob_max_abs_diff: float
    """Largest difference between ``attn.generate``'s log-probs and the grad pass's over the
    same tokens (the behaviour policy is the policy before the step)."""
    tokens_are_inference: bool
    """Did ``attn.generate`` return inference tensors? (It must not: they feed autograd.)"""
    trainable_parameters: int
    records: list[PassRecord] = field(default_factory=list)

    @property
    def logprobs_match(self) -> bool:
        return self.logprob_max_abs_diff <= LOGPROB_TOLERANCE


def _sequence_logprobs(model: nn.Module, out: GenerationOutput) -> torch.Tensor:
    """(b, N, v) log-softmax at the positions that predicted each generated token.

    One uncached pass over prompt and completion, with the positions and padding mask that
    ``generate`` returned; ``out.tokens`` goes in as it is, no ``.clone()``.
    """
    P = out.prompt_length
    logits = model(out.tokens, input_pos=out.positions, mask=padded_causal_mask(out.padding_mask))  # (b, P+N, v)
    return logits[:, P - 1 : -1].float().log_softmax(-1)  # (b, N, v)


def ppo_step(
    model: nn.Module,
    task: AdditionTask,
    problems: list[Problem],
    optimizer: torch.optim.Optimizer,
    records: list[PassRecord],
    *,
    pattern: str,
    generator: torch.Generator,
    temperature: float = 1.0,
    clip: float = 0.2,
    kl_coef: float = 0.0,
    with_reference: bool = False,
) -> dict[str, object]:
    """Generate, reward, (reference logits,) one clipped policy-gradient step.

    Returns:
        Numbers for the result: ``mean_reward``, ``loss``, ``kl``, ``logprob_diff`` (largest
        difference between the log-probs ``generate`` returned and the grad pass's), and
        ``tokens_are_inference``.
    """
    if len(problems) < 2:
        raise ValueError(f"a PPO step needs at least 2 rollouts to compare rewards, got {len(problems)}")
    tok = task.tokenizer
    base = base_model(model)
    base.reset_caches()
    with watch(model, records, pattern=pattern, kind="rollout: attn.generate (sampled)", expect_cache=True):
        out = generate(
            model,
            [task.prompt_ids(p) for p in problems],
            max_new_tokens=task.max_answer_len,
            temperature=temperature,
            stop_tokens=[tok.eos_id],
            pad_id=tok.pad_id,
            generator=generator,
        )
    completions = [tok.decode(row) for row in out.generated.tolist()]
    rewards = torch.tensor([float(task.is_correct(p, c)) for p, c in zip(problems, completions, strict=True)])  # (b,)
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # (b,)
    counted = out.generated_mask.float()  # (b, N)
    reference = None
    if with_reference:
        with (
            watch(model, records, pattern=pattern, kind="reference logits: no_grad, adapters off", expect_cache=False),
            torch.no_grad(),
            adapters_enabled(base, False),
        ):
            reference = _sequence_logprobs(model, out)  # (b, N, v)
    with watch(model, records, pattern=pattern, kind="policy step (grad) on generated tokens", expect_cache=False):
        logprobs_all = _sequence_logprobs(model, out)  # (b, N, v)
        logprobs = logprobs_all.gather(-1, out.generated[..., None]).squeeze(-1)  # (b, N)
        ratio = (logprobs - out.logprobs).exp()  # (b, N); 1 up to float error at the first step
        surrogate = torch.minimum(ratio * advantages[:, None], ratio.clamp(1 - clip, 1 + clip) * advantages[:, None])
        loss = -(surrogate * counted).sum() / counted.sum()
        kl = torch.zeros(())
        if reference is not None:
            per_token = (logprobs_all.exp() * (logprobs_all - reference)).sum(-1)  # (b, N) KL(policy || reference)
            kl = (per_token * counted).sum() / counted.sum()
            loss = loss + kl_coef * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    logprob_diff = ((logprobs.detach() - out.logprobs).abs() * counted).max().item()
    return {
        "mean_reward": rewards.mean().item(),
        "loss": loss.item(),
        "kl": kl.item(),
        "logprob_diff": logprob_diff,
        "tokens_are_inference": out.tokens.is_inference() or out.logprobs.is_inference(),
    }


def _run_ppo(
    model: nn.Module,
    task: AdditionTask,
    problems: list[Problem],
    optimizer: torch.optim.Optimizer,
    *,
    pattern: str,
    steps: int,
    seed: int,
    kl_coef: float,
    with_reference: bool,
    trainable: int,
) -> PPOResult:
    generator = torch.Generator().manual_seed(seed)
    records: list[PassRecord] = []
    numbers = [
        ppo_step(
            model,
            task,
            problems,
            optimizer,
            records,
            pattern=pattern,
            generator=generator,
            kl_coef=kl_coef,
            with_reference=with_reference,
        )
        for _ in range(steps)
    ]
    return PPOResult(
        pattern=pattern,
        steps=steps,
        mean_rewards=[n["mean_reward"] for n in numbers],
        losses=[n["loss"] for n in numbers],
        kl=[n["kl"] for n in numbers],
        logprob_max_abs_diff=max(n["logprob_diff"] for n in numbers),
        tokens_are_inference=any(n["tokens_are_inference"] for n in numbers),
        trainable_parameters=trainable,
        records=records,
    )


def ppo_pattern(
    model: nn.Module, task: AdditionTask, problems: list[Problem], *, steps: int = 1, lr: float = 1e-4, seed: int = 0
) -> PPOResult:
    """PPO: sampled rollouts with the cache, reward = exact match, clipped policy steps.

    ``problems`` must number the caches' batch size. The generated tokens feed the
    grad-enabled pass as ``generate`` returned them.
    """
    base = base_model(model)
    optimizer = torch.optim.AdamW(base.parameters(), lr=lr, weight_decay=0.0)
    trainable = sum(p.numel() for p in base.parameters() if p.requires_grad)
    return _run_ppo(
        model,
        task,
        problems,
        optimizer,
        pattern="ppo",
        steps=steps,
        seed=seed,
        kl_coef=0.0,
        with_reference=False,
        trainable=trainable,
    )


def lora_ppo_pattern(
    model: nn.Module,
    task: AdditionTask,
    problems: list[Problem],
    *,
    steps: int = 2,
    lr: float = 1e-3,
    rank: int = 4,
    kl_coef: float = 0.1,
    seed: int = 0,
) -> PPOResult:
    """LoRA-PPO: as ``ppo_pattern``, training LoRA adapters only, with a KL penalty against
    reference logits computed by the same model with its adapters off, under ``no_grad``.

    Adds adapters to the model in place (once). The first step's KL is exactly zero (fresh
    adapters change nothing); later steps show the adapters moving away from the base.
    """
    base = base_model(model)
    if not lora_parameters(base):
        add_lora(base, rank=rank, seed=seed)
    parameters = lora_parameters(base)
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    return _run_ppo(
        model,
        task,
        problems,
        optimizer,
        pattern="lora-ppo",
        steps=steps,
        seed=seed,
        kl_coef=kl_coef,
        with_reference=True,
        trainable=sum(p.numel() for p in parameters),
    )
