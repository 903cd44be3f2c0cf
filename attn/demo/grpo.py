"""The demo's GRPO pattern: on-policy RL in one process, in bf16 parity mode.

Shapes: B = prompts, G = samples per prompt, R = B x G rows, N = new tokens.

A bf16 copy of the trained demo model gets LoRA adapters (or keeps LoRA-PPO's) and parity mode
(``attn.set_parity_mode``). Each round samples G completions of B prompts with
``attn.generate(num_samples=G)`` (each prompt prefilled once), rewards exact matches,
normalises the rewards within each group, computes the reference log-probs with the
adapters off (``attn.completion_logprobs`` under ``no_grad``: each prompt run once), then
takes a few clipped policy steps whose training forward is ``attn.completion_logprobs``
with grad. The first inner step's importance ratio ``exp(new - old)`` is exactly 1.0 for
every token: generation and training computed the same bits. The same rollout with the
default kernels shows the mismatch parity mode removes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from attn.checks import is_int, is_number
from attn.demo.lora import adapters_enabled, add_lora, lora_parameters
from attn.demo.task import AdditionTask, Problem
from attn.demo.watch import JsonResult, base_model
from attn.generation import GenerationOutput, generate
from attn.logprobs import completion_logprobs
from attn.parity import set_parity_mode

__all__ = ["GRPOConfig", "GRPOResult", "grpo_pattern"]


@dataclass(frozen=True)
class GRPOConfig:
    """The hyperparameters of ``grpo_pattern``; checked when made."""

    group_size: int = 8
    """G: samples per prompt."""
    rounds: int = 8
    """Rollouts, each followed by ``inner_steps`` policy steps on it."""
    inner_steps: int = 2
    lr: float = 5e-3
    clip: float = 0.2
    """The importance ratio's clip range: [1 - clip, 1 + clip]."""
    kl_coef: float = 0.05
    """The weight of the k3 KL estimate against the reference (the adapters off)."""

    def __post_init__(self) -> None:
        counts = (self.rounds, self.inner_steps, self.group_size)
        if not all(is_int(n) for n in counts) or self.rounds < 1 or self.inner_steps < 1 or self.group_size < 2:
            raise ValueError(
                "GRPO needs ints rounds >= 1, inner_steps >= 1, group_size >= 2; "
                f"got {self.rounds!r}, {self.inner_steps!r}, {self.group_size!r}"
            )
        rates = {"lr": self.lr, "clip": self.clip, "kl_coef": self.kl_coef}
        bad = {name: value for name, value in rates.items() if not is_number(value) or not 0 <= value < math.inf}
        if bad or self.lr == 0 or self.clip == 0:
            raise ValueError(f"GRPO needs lr > 0, clip > 0 and kl_coef >= 0, each finite; got {rates}")


@dataclass
class GRPOResult(JsonResult):
    """Rounds of GRPO in parity mode, and the default mode's mismatch on the first rollout."""

    json_derived = ("exact",)

    rounds: int
    inner_steps: int
    group_size: int
    reward_before: float
    """Mean reward of G samples per prompt before the first step."""
    reward_after: float
    """The same, from the same seed, after the last step."""
    first_ratio_min: float
    first_ratio_max: float
    """Extremes of the first inner step's ``exp(new - old)`` over every counted token."""
    first_ratio_tokens: int
    default_max_abs_diff: float
    """Default kernels: largest |generate's log-prob - the training forward's|, first rollout."""
    default_outside_1pct: float
    """Default kernels: share of tokens whose ratio leaves [0.99, 1.01]."""
    parity_max_abs_diff: float

    @property
    def exact(self) -> bool:
        return self.first_ratio_min == 1.0 == self.first_ratio_max and self.parity_max_abs_diff == 0.0


def _rollout(
    policy: nn.Module, task: AdditionTask, problems: list[Problem], group_size: int, seed: int
) -> tuple[GenerationOutput, torch.Tensor]:
    """G samples per problem and their rewards, (R,)."""
    tok = task.tokenizer
    out = generate(
        policy,
        [task.prompt_ids(p) for p in problems],
        max_new_tokens=task.max_answer_len,
        temperature=1.0,
        stop_tokens=[tok.eos_id],
        pad_id=tok.pad_id,
        generator=torch.Generator().manual_seed(seed),
        num_samples=group_size,
    )
    texts = [tok.decode(row) for row in out.generated.tolist()]
    rewards = torch.tensor([float(task.is_correct(problems[i // group_size], t)) for i, t in enumerate(texts)])
    return out, rewards


def _mismatch(policy: nn.Module, out: GenerationOutput, group_size: int) -> tuple[float, float]:
    """Largest |generate's log-prob - the training forward's|, and the share of ratios outside [0.99, 1.01]."""
    new = completion_logprobs(policy, *out.groups(group_size), width=out.generated.shape[1])
    diff = (new.logprobs.detach() - out.logprobs)[new.mask]
    ratio = diff.exp()
    return float(diff.abs().max()), float(((ratio < 0.99) | (ratio > 1.01)).float().mean())


def grpo_pattern(
    model: nn.Module, task: AdditionTask, problems: list[Problem], config: GRPOConfig | None = None, seed: int = 0
) -> GRPOResult:
    """GRPO on a bf16 copy of ``model`` with LoRA adapters, in parity mode (the module doc),
    with ``config``'s hyperparameters (``GRPOConfig()`` where None).

    ``model`` (or the model a ``torch.compile`` wraps) is copied without its caches, and is
    left as it was.
    """
    config = GRPOConfig() if config is None else config
    rounds, inner_steps, clip, kl_coef = config.rounds, config.inner_steps, config.clip, config.kl_coef
    policy = copy.deepcopy(base_model(model))
    if policy.caches_are_setup():
        policy.teardown_caches()
    policy = policy.to(torch.bfloat16)
    if not lora_parameters(policy):  # LoRA-PPO's adapters, where it ran first, train on
        add_lora(policy, rank=4, seed=seed)
    B, G = len(problems), config.group_size

    set_parity_mode(policy, False)  # the same first rollout with the default kernels
    default_diff, default_outside = _mismatch(policy, _rollout(policy, task, problems, G, seed)[0], G)
    set_parity_mode(policy)
    parity_diff = _mismatch(policy, _rollout(policy, task, problems, G, seed)[0], G)[0]

    optimizer = torch.optim.AdamW(lora_parameters(policy), lr=config.lr, weight_decay=0.0)
    reward_before = float(_rollout(policy, task, problems, G, seed + 1)[1].mean())
    first_ratio: torch.Tensor | None = None
    for round_ in range(rounds):
        out, rewards = _rollout(policy, task, problems, G, seed + 100 + round_)
        grouped = rewards.view(B, G)
        advantages = (
            (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
        ).flatten()  # (R,)
        prompts, groups = out.groups(G)
        width = out.generated.shape[1]
        with torch.no_grad(), adapters_enabled(policy, False):
            reference = completion_logprobs(policy, prompts, groups, width=width).logprobs  # (R, N)
        for _ in range(inner_steps):
            new = completion_logprobs(policy, prompts, groups, width=width)  # the training forward, with grad
            counted = new.mask.float()
            ratio = (new.logprobs - out.logprobs).exp()  # (R, N)
            if first_ratio is None:
                first_ratio = ratio.detach()[new.mask]
            surrogate = torch.minimum(
                ratio * advantages[:, None], ratio.clamp(1 - clip, 1 + clip) * advantages[:, None]
            )
            log_ref_ratio = reference - new.logprobs
            kl = log_ref_ratio.exp() - log_ref_ratio - 1  # (R, N): the k3 estimate of KL(policy || reference)
            loss = -((surrogate - kl_coef * kl) * counted).sum() / counted.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    reward_after = float(_rollout(policy, task, problems, G, seed + 1)[1].mean())
    first_ratio = torch.ones(0) if first_ratio is None else first_ratio  # set by the first inner step
    return GRPOResult(
        rounds=rounds,
        inner_steps=inner_steps,
        group_size=G,
        reward_before=reward_before,
        reward_after=reward_after,
        first_ratio_min=float(first_ratio.min()),
        first_ratio_max=float(first_ratio.max()),
        first_ratio_tokens=int(first_ratio.numel()),
        default_max_abs_diff=default_diff,
        default_outside_1pct=default_outside,
        parity_max_abs_diff=parity_diff,
    )
