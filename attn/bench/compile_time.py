"""``python -m attn bench --compile-time``: how long ``attn.compile_for_decode`` keeps a user
waiting before the first token, cold and warm, where it compiles its step (``native_layers=False``;
where the CPU and the model take ``attn::decode_layers`` it compiles nothing by default).

Per cell, fresh processes share one new inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``):
the first compiles from nothing (cold), the second finds inductor's on-disk cache (warm), as a
user's second run of the same script would. Each builds the cell's model, compiles it for
decode and times its first ``attn.generate`` (an eager prefill, then the compiled step for one
more token): the wall time, and the share spent in inductor.

Before that, each process times inductor's own setup, apart: the first inductor compile in a
cache folder probes which vector instruction sets the C++ compiler can build (a test program
each) and the first on a machine builds a precompiled header, whatever the model. On a 2-core
Intel Xeon that measured 16.5-18 s, paid once per machine and torch release, and it would
otherwise land in the cold figure or not depending on what ran on the machine before. Every
process also pays about 3-4 s of it again (inductor runs each probe program once a process).

A third process, warm, times no setup apart ("warm as run"): from ``compile_for_decode`` to
the tokens, as a user's second run waits, the per-process probes included (the first compiled
step starts them in a thread of their own, beside dynamo's trace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

import attn
from attn.bench.contenders import Cell, CellContext
from attn.bench.run import BenchSpec, cell_from_dict, cell_to_dict
from attn.fast_decode import compile_for_decode

__all__ = ["CompileTime", "compile_probe", "format_compile_times", "inductor_setup", "measure_compile_times"]


@dataclass(frozen=True)
class CompileTime:
    """One cell's first generation through ``compile_for_decode``, cold and warm.

    Attributes:
        setup_s: (cold, warm) seconds of inductor's own setup before the model
            (``inductor_setup``).
        first_generate_s: (cold, warm) wall seconds of the first ``attn.generate``.
        inductor_s: (cold, warm) seconds of it in inductor (``DecodeCompileStats.compile_seconds``).
        warm_as_run_s: a third process, warm, with no setup timed apart: what a user's second
            run waits from ``compile_for_decode`` to its tokens, the per-process part of
            inductor's setup included (``compile_for_decode`` starts it beside dynamo's trace).
        regions: 1 where one decoder layer was compiled for every layer, else 0.
        problem: why the cell was not measured, or ``None``.
    """

    cell: str
    layers: int
    setup_s: tuple[float, float] | None = None
    first_generate_s: tuple[float, float] | None = None
    inductor_s: tuple[float, float] | None = None
    warm_as_run_s: float | None = None
    regions: int = 0
    problem: str | None = None


def inductor_setup() -> float:
    """Seconds of inductor's work that no model causes: a trivial compile, in a fresh process,
    runs its vector ISA probes and builds its precompiled header where they are not cached."""
    start = time.perf_counter()
    torch.compile(lambda x: x * 2.0 + 1.0, backend="inductor", fullgraph=True)(torch.ones(64))
    return time.perf_counter() - start


def compile_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: inductor's setup (unless ``spec["setup_apart"]`` is false),
    then ``compile_for_decode`` and the first generation through it."""
    warnings.simplefilter("ignore")
    cell = cell_from_dict(spec["cell"])
    torch.set_num_threads(cell.threads)
    setup = inductor_setup() if spec.get("setup_apart", True) else None
    ctx = CellContext(cell, seed=spec["seed"], init_std=spec["init_std"], checkpoint=spec.get("checkpoint"))
    start = time.perf_counter()
    # The compiled step, also where the model's layers would run natively (then nothing compiles).
    fast = compile_for_decode(ctx.model, max_rows=cell.batch_size, native_layers=False)
    attn.generate(fast, ctx.prompts, max_new_tokens=2)
    seconds = time.perf_counter() - start
    return {
        "setup_s": setup,
        "first_generate_s": seconds,
        "inductor_s": fast.stats.compile_seconds,
        "regions": fast.stats.regions,
    }


def _probe(cell: Cell, spec: BenchSpec, cache_dir: str, timeout: float, *, setup_apart: bool) -> dict[str, Any]:
    payload = {
        "cell": cell_to_dict(cell),
        "seed": spec.seed,
        "init_std": spec.init_std,
        "checkpoint": spec.checkpoint,
        "setup_apart": setup_apart,
    }
    command = [sys.executable, "-m", "attn.bench", "--compile-probe", json.dumps(payload)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"compile probe failed (exit {done.returncode}): {tail}")
    return json.loads(lines[-1])


def measure_compile_times(spec: BenchSpec, timeout: float = 1800.0) -> list[CompileTime]:
    """Cold, warm, then warm as a user's script runs, for every cell of ``spec``, each in a
    fresh process."""
    results = []
    for cell in spec.cells:
        layers = cell.config.num_layers
        with tempfile.TemporaryDirectory(prefix="attn-inductor-") as cache_dir:
            try:
                cold, warm, as_run = (
                    _probe(cell, spec, cache_dir, timeout, setup_apart=apart) for apart in (True, True, False)
                )
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                results.append(CompileTime(cell.label, layers, problem=str(error)))
                continue
        results.append(
            CompileTime(
                cell.label,
                layers,
                setup_s=(cold["setup_s"], warm["setup_s"]),
                first_generate_s=(cold["first_generate_s"], warm["first_generate_s"]),
                inductor_s=(cold["inductor_s"], warm["inductor_s"]),
                warm_as_run_s=as_run["first_generate_s"],
                regions=warm["regions"],
            )
        )
    return results


def format_compile_times(results: list[CompileTime], machine: str) -> str:
    """A plain-text table: one line per cell, cold and warm."""
    lines = [
        f"compile_for_decode before the first token ({machine}); seconds, first generate (in inductor), "
        "after inductor's own setup (once per machine and torch release: ISA probes, precompiled header)",
        f"  {'cell':<28} {'layers':>6}  {'setup cold/warm':>15}  {'cold':>16}  {'warm':>16}  {'warm as run':>11}"
        "  layers compiled",
    ]
    for r in results:
        if r.first_generate_s is None or r.inductor_s is None or r.setup_s is None or r.warm_as_run_s is None:
            lines.append(f"  {r.cell:<28} {r.layers:>6}  not measured: {r.problem}")
            continue
        setup = f"{r.setup_s[0]:.1f} / {r.setup_s[1]:.1f}"
        pairs = zip(r.first_generate_s, r.inductor_s, strict=True)
        cold, warm = (f"{total:6.1f} ({inductor:5.1f})" for total, inductor in pairs)
        compiled = "one, for every layer" if r.regions else "every layer"
        as_run = f"{r.warm_as_run_s:.1f}"
        lines.append(f"  {r.cell:<28} {r.layers:>6}  {setup:>15}  {cold:>16}  {warm:>16}  {as_run:>11}  {compiled}")
    return "\n".join(lines)
