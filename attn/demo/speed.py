"""Tokens per second generating with the KV-cache and without it, on the same model.

Shapes: b = batch, P = prompt width, N = new tokens, v = vocab.

With the cache: ``attn.generate`` (prefill once, then one token per step). Without it: the
loop every generation without a cache runs, recomputing the whole sequence for each new
token, under ``torch.inference_mode()`` and ``attn.disable_kv_cache``. Both are greedy with
no stop token, so both produce exactly b * N tokens, and the same ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from attn.bench.baseline import greedy_without_cache
from attn.demo.task import AdditionTask, Problem
from attn.demo.watch import JsonResult, PassRecord, base_model, watch
from attn.generation import generate

__all__ = ["SpeedResult", "measure_speed"]


@dataclass
class SpeedResult(JsonResult):
    """Generation throughput with and without the cache: the fastest of ``repeats`` timed runs."""

    json_derived = ("cached_tokens_per_s", "uncached_tokens_per_s", "speedup")

    batch_size: int
    new_tokens: int
    cached_seconds: float
    uncached_seconds: float
    same_tokens: bool
    repeats: int = 1
    records: list[PassRecord] = field(default_factory=list)

    @property
    def cached_tokens_per_s(self) -> float:
        return self.batch_size * self.new_tokens / self.cached_seconds

    @property
    def uncached_tokens_per_s(self) -> float:
        return self.batch_size * self.new_tokens / self.uncached_seconds

    @property
    def speedup(self) -> float:
        return self.uncached_seconds / self.cached_seconds


def measure_speed(
    model: nn.Module, task: AdditionTask, problems: list[Problem], *, new_tokens: int, repeats: int = 3
) -> SpeedResult:
    """Times both ways of generating ``new_tokens`` after each problem's prompt.

    Each runs a few tokens untimed first (compiles, allocator warm-up); then the two take
    turns, ``repeats`` times each, and each keeps its fastest time (on a shared machine the
    fastest run is the one least disturbed). The prompts must number the caches' batch size,
    and prompt plus ``new_tokens`` must fit the caches.
    """
    if not isinstance(repeats, int) or repeats <= 0:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    tok = task.tokenizer
    prompts = [task.prompt_ids(p) for p in problems]
    base = base_model(model)

    def cached(num_tokens: int) -> torch.Tensor:
        return generate(model, prompts, max_new_tokens=num_tokens, pad_id=tok.pad_id).tokens

    def uncached(num_tokens: int) -> torch.Tensor:
        return greedy_without_cache(model, prompts, max_new_tokens=num_tokens, pad_id=tok.pad_id)

    # Warm-up, twice in turn: a decode step has one shape at every position, and a few steps
    # of the full recompute make torch.compile treat its length as dynamic; where passes
    # graph-break (the INFERENCE policy under compile), the second round compiles what
    # alternating between the two needs. The timed runs then compile nothing.
    for _ in range(2):
        cached(min(new_tokens, 4))
        uncached(min(new_tokens, 4))
    records: list[PassRecord] = []
    cached_seconds, uncached_seconds = [], []
    for _ in range(repeats):
        base.reset_caches()
        with watch(model, records, pattern="speed", kind="generation with the cache: attn.generate", expect_cache=True):
            start = time.perf_counter()
            with_cache = cached(new_tokens)
            cached_seconds.append(time.perf_counter() - start)
        with watch(
            model, records, pattern="speed", kind="generation without the cache: full recompute", expect_cache=False
        ):
            start = time.perf_counter()
            without_cache = uncached(new_tokens)
            uncached_seconds.append(time.perf_counter() - start)
    return SpeedResult(
        batch_size=len(prompts),
        new_tokens=new_tokens,
        cached_seconds=min(cached_seconds),
        uncached_seconds=min(uncached_seconds),
        same_tokens=bool(torch.equal(with_cache, without_cache)),
        repeats=repeats,
        records=records,
    )
