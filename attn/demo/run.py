"""The whole demo, in order: set up, train, eval, speed, PPO, LoRA-PPO, GRPO; then the checks.

``run_demo`` builds the task and the model, sets up the caches once, runs every pattern on
the same model (compiled or not), prints a line per step as it goes, and returns a
``DemoResult`` whose ``violations()`` lists every invariant that did not hold: a pass that
used the cache where it should not have (or did not where it should), log-likelihoods that
differ from a copy of the model that never had a cache, and the like.
"""

from __future__ import annotations

import platform
import time
import warnings
from collections.abc import Callable
from typing import TextIO

import torch
from tqdm import tqdm

import attn
from attn.demo import report
from attn.demo.grpo import grpo_pattern
from attn.demo.model import build_model
from attn.demo.patterns import (
    eval_pattern,
    generation_task,
    lora_ppo_pattern,
    ppo_pattern,
    train,
)
from attn.demo.result import DemoOptions, DemoResult
from attn.demo.speed import measure_speed
from attn.demo.task import AdditionTask
from attn.demo.watch import PassRecord, watch
from attn.policy import CompatWarning, cache_policy, set_cache_policy

__all__ = ["DemoOptions", "DemoResult", "run_demo"]  # the first two from attn.demo.result


def _compile_stats() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def run_demo(
    options: DemoOptions,
    *,
    say: Callable[[str], None] = print,
    progress_stream: TextIO | None = None,
) -> DemoResult:
    """Runs the demo and returns what it measured; prints a line per step with ``say``.

    Sets the process's cache policy when ``options.policy`` is given. The training progress
    bar goes to ``progress_stream`` (default: stderr).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompatWarning)
        if options.policy is not None:
            set_cache_policy(options.policy)
        # Each kind of pass is its own graph (grad mode, flag, shapes, adapters on or off):
        # about a dozen, more than dynamo's default limit of 8 recompiles per function.
        with torch._dynamo.config.patch(recompile_limit=64):
            result = _run(options, say, progress_stream)
    result.warnings = [f"{w.category.__name__}: {w.message}" for w in caught]
    return result


def _run(options: DemoOptions, say: Callable[[str], None], progress_stream: TextIO | None) -> DemoResult:
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    decision = cache_policy()
    task = AdditionTask(num_digits=2, num_eval=options.batch_size, seed=options.seed)
    model = build_model(task, seed=options.seed)
    model.setup_caches(options.batch_size, model.config.max_seq_len)
    if options.compile:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        runner = torch.compile(model, backend=options.backend)
    else:
        runner = model
    environment = {
        "attn": attn.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
    }
    say(report.header(options, decision, model, task))

    before: list[PassRecord] = []
    model.reset_caches()
    with watch(runner, before, pattern="train", kind="generation before training: attn.generate", expect_cache=True):
        untrained, _ = generation_task(runner, task, task.eval_problems)
    with tqdm(total=options.steps, desc="   training", file=progress_stream, mininterval=0.1, leave=True) as bar:

        def on_step(step: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update(step - bar.n)

        trained = train(runner, task, steps=options.steps, seed=options.seed, on_step=on_step)
    seconds["train"] = time.perf_counter() - start
    say(report.train_line(untrained, trained))

    mark = time.perf_counter()
    evaluated = eval_pattern(runner, task, task.eval_problems)
    seconds["eval"] = time.perf_counter() - mark
    say(report.eval_lines(evaluated, task))

    mark = time.perf_counter()
    speed = measure_speed(runner, task, task.eval_problems, new_tokens=options.speed_tokens)
    seconds["speed"] = time.perf_counter() - mark

    generator = torch.Generator().manual_seed(options.seed)
    rows = torch.randperm(len(task.train_problems), generator=generator)[: options.batch_size].tolist()
    rollout_problems = [task.train_problems[i] for i in rows]
    mark = time.perf_counter()
    ppo = ppo_pattern(runner, task, rollout_problems, seed=options.seed)
    seconds["ppo"] = time.perf_counter() - mark
    say(report.ppo_lines(ppo))

    mark = time.perf_counter()
    lora_ppo = lora_ppo_pattern(runner, task, rollout_problems, seed=options.seed)
    seconds["lora_ppo"] = time.perf_counter() - mark
    say(report.lora_ppo_lines(lora_ppo))

    mark = time.perf_counter()
    grpo = grpo_pattern(runner, task, rollout_problems[:16], seed=options.seed)
    seconds["grpo"] = time.perf_counter() - mark
    say(report.grpo_lines(grpo))
    seconds["total"] = time.perf_counter() - start

    return DemoResult(
        options=options,
        environment=environment,
        policy={"policy": decision.policy.value, "source": decision.source, "reason": decision.reason},
        untrained_accuracy=untrained,
        train=trained,
        eval=evaluated,
        speed=speed,
        ppo=ppo,
        lora_ppo=lora_ppo,
        grpo=grpo,
        seconds=seconds,
        caches_still_setup=model.caches_are_setup(),
        compile_stats=_compile_stats() if options.compile else None,
        before_training=before,
    )
