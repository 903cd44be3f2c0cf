"""The demo's printed output: a line per step as it runs, then the table of passes.

Formatting only: every number comes from the results in ``attn.demo.patterns``,
``attn.demo.speed`` and ``attn.demo.result``.
"""

from __future__ import annotations

from attn.decoder import TransformerDecoder
from attn.demo.grpo import GRPOResult
from attn.demo.patterns import EvalResult, PPOResult, TrainResult
from attn.demo.result import DemoOptions, DemoResult
from attn.demo.task import AdditionTask
from attn.demo.watch import PassRecord
from attn.policy import PolicyDecision

__all__ = ["eval_lines", "header", "lora_ppo_lines", "ppo_lines", "summary", "table", "train_line"]


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def header(options: DemoOptions, decision: PolicyDecision, model: TransformerDecoder, task: AdditionTask) -> str:
    config = model.config
    cache = model.cache_state
    mode = f"torch.compile(backend={options.backend!r})" if options.compile else "eager"
    parameters = sum(p.numel() for p in model.parameters())
    example = task.text(task.eval_problems[0])
    lines = [
        f"attn demo: torch {decision.torch_version}, cache policy {decision.policy.value} ({decision.source}), "
        f"{mode}, seed {options.seed}",
        f"model: {config.num_layers} layers, {config.num_heads} heads ({config.num_kv_heads} kv), "
        f"embed_dim {config.embed_dim}, {parameters:,} parameters; caches set up once: batch_size "
        f"{cache.batch_size}, max_seq_len {cache.max_seq_len}",
        f"task: addition as characters ({example}); {len(task.train_problems):,} training problems, "
        f"{len(task.eval_problems)} held out",
    ]
    if options.compile:
        lines.append(
            "compiling: each kind of pass is its own graph (about a dozen); a first run with inductor can take "
            "minutes on a small CPU (later runs reuse its cache); --backend aot_eager compiles fastest"
        )
    return "\n".join([*lines, "", "1. train: grad-enabled passes with the caches set up"])


def train_line(untrained: float, result: TrainResult) -> str:
    return (
        f"   {result.steps} steps in {result.seconds:.1f} s, loss {result.first_loss:.2f} -> {result.last_loss:.3f}; "
        f"held-out exact match {_percent(untrained)} before training"
    )


def eval_lines(result: EvalResult, task: AdditionTask) -> str:
    identical = "bit-identical" if result.scores_bit_identical else "within tolerance"
    return "\n".join(
        [
            "2. eval: generation task, log-likelihood task, generation task again; one model, caches set up",
            f"   generation (exact match) {_percent(result.generation_accuracy)} | log-likelihood "
            f"({task.num_candidates} candidates) {_percent(result.loglikelihood_accuracy)} | generation again "
            f"{_percent(result.generation_again_accuracy)}"
            + (", same completions" if result.same_completions else ", DIFFERENT completions"),
            "   a hand-written greedy loop under plain torch.inference_mode() used the cache: tokens "
            + ("== attn.generate's" if result.loop_matches_generate else "DIFFERENT from attn.generate's"),
            f"   log-likelihood scores (torch.no_grad()) vs a copy of the model that never had a cache: max |diff| "
            f"{result.scores_max_abs_diff:.3g} ({identical if result.scores_match else 'DIFFERENT'})",
            f"   e.g. {', '.join(result.examples)}",
        ]
    )


def ppo_lines(result: PPOResult) -> str:
    return "\n".join(
        [
            "3. PPO: sampled rollouts with attn.generate, reward = exact match, one clipped policy step",
            f"   mean reward {result.mean_rewards[0]:.2f}, loss {result.losses[0]:.4f}; the rollout's tokens fed the "
            f"grad pass as returned (inference tensors: {'YES' if result.tokens_are_inference else 'no'}, no .clone())",
            "   log-probs from generate (cached) vs the grad pass (uncached): max |diff| "
            f"{result.logprob_max_abs_diff:.2g}",
        ]
    )


def lora_ppo_lines(result: PPOResult) -> str:
    rewards = " -> ".join(f"{r:.2f}" for r in result.mean_rewards)
    kl = " -> ".join(f"{k:.2g}" for k in result.kl)
    return "\n".join(
        [
            "4. LoRA-PPO: as PPO, training LoRA adapters only; reference logits with the adapters off under no_grad",
            f"   {result.steps} steps, {result.trainable_parameters:,} adapter parameters; mean reward {rewards}; "
            f"KL to the reference {kl}",
        ]
    )


def grpo_lines(result: GRPOResult) -> str:
    return "\n".join(
        [
            f"5. GRPO in bf16 parity mode: groups of {result.group_size} with attn.generate(num_samples=), "
            "group-normalised advantages, reference log-probs with the adapters off and policy steps, both "
            "from attn.completion_logprobs (each prompt once)",
            f"   {result.rounds} rounds x {result.inner_steps} steps; mean reward {result.reward_before:.2f} -> "
            f"{result.reward_after:.2f}",
            f"   first step's importance ratio over {result.first_ratio_tokens} tokens: "
            f"min {result.first_ratio_min!r}, max {result.first_ratio_max!r} "
            f"({'exactly 1.0' if result.exact else 'NOT exact'})",
            f"   the default kernels on the same rollout: max |log-prob diff| {result.default_max_abs_diff:.3g}, "
            f"{100 * result.default_outside_1pct:.1f}% of ratios outside [0.99, 1.01]",
        ]
    )


def _fill(values: tuple[int, ...]) -> str:
    """One number when every layer agrees (they should), else all of them."""
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def table(result: DemoResult) -> str:
    """The table of passes: expected and measured cache use, fill positions before and after.

    Blocks of the same step and kind (the LoRA-PPO steps) share a row; ``n`` counts passes.
    """
    groups: dict[tuple[str, str], list[PassRecord]] = {}
    for record in result.records:
        groups.setdefault((record.pattern, record.kind), []).append(record)
    rows = [("step: kind of pass", "n", "cache expected", "cache used", "fill before -> after", "check")]
    for (pattern, kind), records in groups.items():
        used = {record.used_cache for record in records}
        fills = dict.fromkeys(f"{_fill(r.fill_before)} -> {_fill(r.fill_after)}" for r in records)
        rows.append(
            (
                f"{pattern}: {kind}",
                str(sum(record.count for record in records)),
                "yes" if records[0].expect_cache else "no",
                ("yes" if used == {True} else "no") if len(used) == 1 else "SOMETIMES",
                ", ".join(fills),
                "ok" if all(record.ok for record in records) else "VIOLATION",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["6. every kind of pass: cache use read from each layer's fill position and buffers, before and after"]
    for i, row in enumerate(rows):
        lines.append("   " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("   " + "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def summary(result: DemoResult) -> str:
    """Speed, torch release, policy and why, timings, and the verdict."""
    speed = result.speed
    policy = result.policy
    lines = [
        f"   generation speed, {speed.batch_size} rows x {speed.new_tokens} new tokens, greedy: with the cache "
        f"{speed.cached_tokens_per_s:,.0f} tokens/s, without (full recompute) {speed.uncached_tokens_per_s:,.0f} "
        f"tokens/s: {speed.speedup:.1f}x" + ("" if speed.same_tokens else " (DIFFERENT tokens)"),
        f"   torch {result.environment['torch']}; cache policy {policy['policy']} ({policy['source']}): "
        f"{policy['reason']}",
    ]
    if result.compile_stats is not None:
        stats = result.compile_stats
        lines.append(f"   torch.compile: {stats['graphs']} graphs, {stats['graph_breaks']} graph breaks")
    seconds = result.seconds
    lines.append(
        f"   time: {seconds['total']:.1f} s (train {seconds['train']:.1f}, eval {seconds['eval']:.1f}, speed "
        f"{seconds['speed']:.1f}, PPO {seconds['ppo']:.1f}, LoRA-PPO {seconds['lora_ppo']:.1f}, "
        f"GRPO {seconds['grpo']:.1f})"
    )
    violations = result.violations()
    if violations:
        lines.append(f"FAILED: {len(violations)} invariant(s) violated:")
        lines += [f"  - {v}" for v in violations]
    else:
        lines.append(
            f"ok: all {len(result.records)} blocks of passes used the cache exactly where they should, and the "
            "log-likelihoods equal a never-cached copy's"
        )
    return "\n".join(lines)
