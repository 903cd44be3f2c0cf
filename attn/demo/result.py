"""What the demo was asked to do (``DemoOptions``) and what it measured (``DemoResult``).

``DemoResult.violations()`` lists every invariant that did not hold: a pass that used the
cache where it should not have (or did not where it should), log-likelihoods that differ
from a copy of the model that never had a cache, and the like.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from attn.checks import check_positive_int
from attn.demo.grpo import GRPOResult
from attn.demo.patterns import EvalResult, PPOResult, TrainResult
from attn.demo.speed import SpeedResult
from attn.demo.watch import PassRecord

__all__ = ["DemoOptions", "DemoResult"]


@dataclass(frozen=True)
class DemoOptions:
    """What ``python -m attn demo`` runs.

    Attributes:
        steps: training steps.
        seed: seeds the held-out problems, the weights, the batches and the rollouts.
        policy: ``"inference"`` or ``"flag"`` forces the cache policy for the process;
            ``None`` keeps the one in force (environment variable or release default).
        compile: run every pass through ``torch.compile(model, backend=backend)``.
        backend: the ``torch.compile`` backend.
        batch_size: rows of every generation, the caches' batch size, and problems held out.
        speed_tokens: new tokens per row when timing generation with and without the cache.
    """

    steps: int = 1000
    seed: int = 0
    policy: str | None = None
    compile: bool = False
    backend: str = "inductor"
    batch_size: int = 64
    speed_tokens: int = 48

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "speed_tokens"):
            check_positive_int(getattr(self, name), f"DemoOptions.{name}")
        if self.policy not in (None, "inference", "flag"):
            raise ValueError(f"DemoOptions.policy must be None, 'inference' or 'flag', got {self.policy!r}")


@dataclass
class DemoResult:
    """Everything the demo measured; ``violations()`` says what went wrong, if anything."""

    options: DemoOptions
    environment: dict[str, object]
    policy: dict[str, str]
    untrained_accuracy: float
    train: TrainResult
    eval: EvalResult
    speed: SpeedResult
    ppo: PPOResult
    lora_ppo: PPOResult
    grpo: GRPOResult
    seconds: dict[str, float]
    caches_still_setup: bool
    compile_stats: dict[str, int] | None = None
    warnings: list[str] = field(default_factory=list)
    before_training: list[PassRecord] = field(default_factory=list)

    @property
    def records(self) -> list[PassRecord]:
        """Every watched block, in the order it ran."""
        return [
            *self.before_training,
            *self.train.records,
            *self.eval.records,
            *self.speed.records,
            *self.ppo.records,
            *self.lora_ppo.records,
        ]

    def violations(self) -> list[str]:
        """Every invariant that did not hold, in a sentence each; empty when all held."""
        problems = [r.problem() for r in self.records if not r.ok]
        if not self.caches_still_setup:
            problems.append("the model's caches were not set up at the end of the demo")
        if not self.eval.scores_match:
            problems.append(
                f"eval: log-likelihood scores differ from a copy of the model that never had a cache "
                f"(max |diff| {self.eval.scores_max_abs_diff:.3g})"
            )
        if not self.eval.same_completions:
            problems.append(
                "eval: the generation task gave different completions before and after the log-likelihood task"
            )
        if not self.eval.loop_matches_generate:
            problems.append("eval: a torch.inference_mode() decode loop gave other tokens than attn.generate")
        for result in (self.ppo, self.lora_ppo):
            if not result.logprobs_match:
                problems.append(
                    f"{result.pattern}: log-probs from attn.generate differ from the grad pass over the same tokens "
                    f"(max |diff| {result.logprob_max_abs_diff:.3g})"
                )
            if result.tokens_are_inference:
                problems.append(f"{result.pattern}: attn.generate returned inference tensors")
        if not self.grpo.exact:
            problems.append(
                f"grpo: in parity mode the first step's ratio spans [{self.grpo.first_ratio_min!r}, "
                f"{self.grpo.first_ratio_max!r}] and generate's log-probs differ from the training forward's by up to "
                f"{self.grpo.parity_max_abs_diff:.3g}; both must be exact"
            )
        if not self.speed.same_tokens:
            problems.append("speed: generation with and without the cache produced different tokens")
        return problems

    @property
    def ok(self) -> bool:
        return not self.violations()

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "violations": self.violations(),
            "options": asdict(self.options),
            "environment": self.environment,
            "policy": self.policy,
            "passes": [r.to_dict() for r in self.records],
            "untrained_generation_accuracy": self.untrained_accuracy,
            "train": self.train.to_dict(),
            "eval": self.eval.to_dict(),
            "speed": self.speed.to_dict(),
            "ppo": self.ppo.to_dict(),
            "lora_ppo": self.lora_ppo.to_dict(),
            "grpo": self.grpo.to_dict(),
            "caches_still_setup": self.caches_still_setup,
            "compile_stats": self.compile_stats,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "warnings": self.warnings,
        }
