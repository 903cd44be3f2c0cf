"""``python -m attn bench``: decode speed of ``attn`` side by side with ``transformers`` and llama.cpp, on CPU.

In one process it measures, for each cell (model size, dtype, batch, threads), every
contender's decode tokens/s (median, min, max over alternating repeats), time to first
token, compile time and compiled graphs, checks that each produced the same greedy tokens
as ``attn`` eager (logits against fp32 for bf16), and relates the speed to the memory-bound
limit measured on the spot. Peak memory is measured in a fresh process per contender.

llama.cpp (contender ``llama.cpp``, batch 1) runs when ``llama-cpp-python`` is installed, on
the same weights written to a GGUF file, and says why it is skipped otherwise. It builds from
source (``attn.bench.contenders.LLAMA_CPP_INSTALL``: about 5 minutes on 2 cores, for this
machine's CPU)::

    CMAKE_ARGS='-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF' pip install 'attn[llama-cpp]'

Example::

    python -m attn bench                                # the four default cells (small fp32 b1, b8; small bf16; base)
    python -m attn bench --config base --dtype fp32,bf16 --batch 1,8 --threads 1,2
    python -m attn bench --config tiny --repeats 1 --prompt-len 8 --new-tokens 8 --no-memory
    python -m attn bench --json bench.json --plot bench.png
    python -m attn bench --workloads                    # GRPO fork and shared-context scoring
    python -m attn bench --rl                           # GRPO log-prob passes, parity mode's cost and gap
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from attn.bench.check import Check, check_logits, check_tokens
from attn.bench.contenders import (
    CONTENDERS,
    DEFAULT_CONTENDERS,
    LLAMA_CPP_INSTALL,
    Cell,
    CellContext,
    Contender,
    Generated,
)
from attn.bench.report import compiled_summary, format_table, write_json, write_plot
from attn.bench.run import BenchResult, BenchSpec, Row, machine_info, run_benchmark
from attn.bench.targets import Targets
from attn.decoder import DecoderConfig
from attn.dtypes import DTYPES, short_name

__all__ = [
    "CONFIGS",
    "CONTENDERS",
    "DEFAULT_CELLS",
    "BenchResult",
    "BenchSpec",
    "Cell",
    "CellContext",
    "Check",
    "Contender",
    "Generated",
    "Row",
    "Targets",
    "check_logits",
    "check_tokens",
    "compiled_summary",
    "format_table",
    "main",
    "run_benchmark",
]

CONFIGS: dict[str, dict[str, object]] = {
    # Llama-style, 56.4M parameters, untied output.
    "small": dict(vocab_size=32000, embed_dim=512, num_layers=8, num_heads=8, num_kv_heads=4, hidden_dim=1408),
    # 109.5M parameters, tied embeddings.
    "base": dict(vocab_size=32000, embed_dim=768, num_layers=12, num_heads=12, hidden_dim=2048, tie_embeddings=True),
    # For smoke runs and tests.
    "tiny": dict(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=128),
}
"""Built-in model sizes (``DecoderConfig`` fields; ``max_seq_len`` is set to fit the run)."""

DEFAULT_CELLS = (
    ("small", "fp32", 1, 1),
    ("small", "fp32", 8, 1),
    ("small", "bf16", 1, 2),
    ("base", "fp32", 1, 1),
)
"""(config, dtype, batch, threads) of the cells run by default."""

_DTYPES = {short_name(dtype): dtype for dtype in DTYPES}  # fp32, bf16, fp16


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m attn bench",
        description=(
            "Decode speed of attn (eager, compiled, no cache) against transformers (static and "
            "dynamic cache) and llama.cpp (batch 1, when llama-cpp-python is installed: "
            f"{LLAMA_CPP_INSTALL}, a source build) with the same "
            "weights, with a correctness check of every contender."
        ),
        epilog=(
            "Without --config/--dtype/--batch/--threads it runs four cells: "
            + "; ".join(f"{c} {d} b{b} t{t}" for c, d, b, t in DEFAULT_CELLS)
            + ". With any of them, it runs every combination (defaults: small, fp32, 1, 1)."
        ),
    )
    parser.add_argument(
        "--config",
        action="append",
        help=(
            f"model: a name ({', '.join(CONFIGS)}), DecoderConfig fields as JSON "
            "('{\"vocab_size\": 1000, ...}'), a JSON file of them, or a Hugging Face checkpoint "
            "directory (real weights); repeat or comma-separate names for several"
        ),
    )
    parser.add_argument(
        "--cells",
        help="explicit cells instead of a grid: comma-separated CONFIG:DTYPE:BATCH:THREADS, e.g. small:bf16:1:2",
    )
    parser.add_argument("--dtype", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--batch", type=_int_list, help="comma-separated batch sizes")
    parser.add_argument("--threads", type=_int_list, help="comma-separated torch thread counts")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per row (default 128)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens to generate per row (default 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed generations per contender (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up generations per contender (default 1)")
    parser.add_argument(
        "--contenders",
        default=",".join(DEFAULT_CONTENDERS),
        help=f"comma-separated, from: {', '.join(CONTENDERS)} (default: {','.join(DEFAULT_CONTENDERS)})",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes (one process each)")
    parser.add_argument("--max-rows", type=int, default=8, help="compile_for_decode max_rows (default 8)")
    parser.add_argument(
        "--nocache-max-batch", type=int, default=1, help="largest batch for attn-nocache (default 1; it is slow)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=0.05, help="std of random weights (default 0.05)")
    parser.add_argument(
        "--targets",
        type=Path,
        help="a JSON file of targets for attn-compiled (share_of_limit by dtype, faster_than, peak_rss_at_most; "
        "see attn/bench/targets.py): the report says which are met",
    )
    parser.add_argument("--json", type=Path, help="write every measurement as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG of latency per token against position here")
    parser.add_argument(
        "--workloads",
        action="store_true",
        help=(
            "instead of decode speed: GRPO sampling with a forked prefill against the B x G expansion, and "
            "shared-context scoring against full passes (first --config/--dtype/--threads; default small fp32 1)"
        ),
    )
    parser.add_argument(
        "--rl",
        action="store_true",
        help=(
            "instead of decode speed: a GRPO step's log-prob passes with each prompt run once against the "
            "B x G full forward, parity mode's cost per phase and its log-prob gap (default: the SmolLM2-135M "
            "shape, fp32, 2 threads; --config/--dtype/--threads/--repeats apply)"
        ),
    )
    parser.add_argument(
        "--rl-shape",
        type=_int_list,
        default=[2, 8, 512, 128],
        help="with --rl: B,G,P,N (prompts, completions per prompt, prompt and completion tokens; default 2,8,512,128)",
    )
    parser.add_argument(
        "--workloads-compile",
        action="store_true",
        help="with --workloads: both GRPO sides decode with attn.compile_for_decode",
    )
    parser.add_argument(
        "--compile-time",
        action="store_true",
        help=(
            "instead of decode speed: seconds before the first token through attn.compile_for_decode, cold "
            "(a new inductor cache), warm (inductor's on-disk cache) and warm as a script runs (no setup "
            "timed apart), each in a fresh process, per cell"
        ),
    )
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)  # internal: one probe, in a fresh process
    parser.add_argument("--compile-probe", help=argparse.SUPPRESS)  # internal: one compile, in a fresh process
    return parser


def _resolve_config(text: str, min_len: int) -> tuple[str, DecoderConfig, str | None]:
    """``(name, config, checkpoint directory or None)`` for one ``--config`` value."""
    fields: dict[str, object]
    path = Path(text)
    if text in CONFIGS:
        name, fields = text, dict(CONFIGS[text])
    elif text.lstrip().startswith("{"):
        name, fields = "custom", json.loads(text)
    elif path.is_dir():
        try:
            from attn.checkpoint import load_pretrained
        except ImportError as error:
            raise ValueError(f"--config {text!r} is a directory, but checkpoints cannot be loaded: {error}") from None
        config = load_pretrained(path, dtype=torch.float32).config
        if config.max_seq_len < min_len:
            raise ValueError(
                f"checkpoint {path} covers {config.max_seq_len} positions, fewer than prompt + new tokens ({min_len})"
            )
        return path.name, config, str(path)
    elif path.is_file():
        name, fields = path.stem, json.loads(path.read_text())
    else:
        raise ValueError(f"--config {text!r} is not one of {', '.join(CONFIGS)}, a JSON object, a file or a directory")
    fields.setdefault("max_seq_len", max(2048, min_len))
    return name, DecoderConfig(**fields), None  # type: ignore[arg-type]


def _spec(args: argparse.Namespace) -> BenchSpec:
    total = args.prompt_len + args.new_tokens
    if args.prompt_len <= 0 or args.new_tokens < 2:
        raise ValueError(
            f"--prompt-len must be positive and --new-tokens at least 2, got {args.prompt_len}, {args.new_tokens}"
        )
    grid = args.config or args.dtype or args.batch or args.threads
    checkpoint = None
    cells = []
    if args.cells:
        if grid:
            raise ValueError("--cells replaces --config/--dtype/--batch/--threads; give one or the other")
        for text in args.cells.split(","):
            parts = text.strip().split(":")
            if len(parts) != 4 or parts[1] not in _DTYPES or not (parts[2].isdigit() and parts[3].isdigit()):
                raise ValueError(f"--cells entry {text!r} is not CONFIG:DTYPE:BATCH:THREADS (e.g. small:fp32:1:1)")
            name, config, _ = _resolve_config(parts[0], total)
            batch, threads = int(parts[2]), int(parts[3])
            if batch <= 0 or threads <= 0:
                raise ValueError(f"--cells entry {text!r}: batch and threads must be positive")
            cells.append(Cell(name, config, _DTYPES[parts[1]], batch, threads, args.prompt_len, args.new_tokens))
    elif grid:
        names = [n.strip() for value in (args.config or ["small"]) for n in _split_config(value)]
        dtypes = [d.strip() for d in (args.dtype or "fp32").split(",") if d.strip()]
        unknown = [d for d in dtypes if d not in _DTYPES]
        if unknown:
            raise ValueError(f"unknown --dtype {unknown}; choose from {', '.join(_DTYPES)}")
        for text in names:
            name, config, path = _resolve_config(text, total)
            checkpoint = path or checkpoint
            for dtype in dtypes:
                for batch in args.batch or [1]:
                    for threads in args.threads or [1]:
                        cells.append(
                            Cell(name, config, _DTYPES[dtype], batch, threads, args.prompt_len, args.new_tokens)
                        )
    else:
        for name, dtype, batch, threads in DEFAULT_CELLS:
            _, config, _ = _resolve_config(name, total)
            cells.append(Cell(name, config, _DTYPES[dtype], batch, threads, args.prompt_len, args.new_tokens))
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown --contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    return BenchSpec(
        cells=cells,
        contenders=contenders,
        repeats=args.repeats,
        warmup=args.warmup,
        memory=not args.no_memory,
        seed=args.seed,
        init_std=args.init_std,
        checkpoint=checkpoint,
        max_rows=args.max_rows,
        nocache_max_batch=args.nocache_max_batch,
    )


def _split_config(value: str) -> list[str]:
    """Comma-separated names, but a JSON object or a path stays whole."""
    if value.lstrip().startswith("{") or "/" in value:
        return [value]
    return value.split(",")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark from command-line arguments; returns the exit status.

    Exit status: 0 when every contender's output passed the correctness check, 1 when
    one failed, 2 for bad arguments.
    """
    parser = _parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.memory_probe:
        from attn.bench.run import memory_probe

        print(json.dumps(memory_probe(json.loads(args.memory_probe))))
        return 0
    if args.compile_probe:
        from attn.bench.compile_time import compile_probe

        print(json.dumps(compile_probe(json.loads(args.compile_probe))))
        return 0
    if args.workloads:
        return _run_workloads(args, parser)
    if args.rl:
        return _run_rl(args, parser)
    try:
        spec = _spec(args)
        targets = None if args.targets is None else Targets.from_file(args.targets)
    except ValueError as error:
        parser.error(str(error))
    if args.compile_time:
        return _run_compile_time(spec)
    result = run_benchmark(spec)
    if args.plot:
        problem = write_plot(result, args.plot)
        result.notes.append(f"plot: {problem}" if problem else f"plot written to {args.plot}")
    print(format_table(result, targets))
    if args.json:
        write_json(result, args.json)
        print(f"JSON written to {args.json}")
    return 1 if any(row.check_ok is False for row in result.rows) else 0


def _run_compile_time(spec: BenchSpec) -> int:
    from attn.bench.compile_time import format_compile_times, measure_compile_times

    results = measure_compile_times(spec)
    print(format_compile_times(results, f"{machine_info()['cpu']}, torch {torch.__version__}"))
    return 1 if any(r.problem for r in results) else 0


def _run_workloads(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from attn.bench.measure import read_bandwidth
    from attn.bench.workloads import WorkloadSpec, format_workloads, run_workloads

    try:
        _, config, _ = _resolve_config(_split_config((args.config or ["small"])[0])[0], 0)
    except ValueError as error:
        parser.error(str(error))
    dtype = _DTYPES.get((args.dtype or "fp32").split(",")[0].strip())
    if dtype is None:
        parser.error(f"unknown --dtype {args.dtype!r}; choose from {', '.join(_DTYPES)}")
    threads = (args.threads or [1])[0]
    bandwidth, _ = read_bandwidth(threads)
    machine = f"{machine_info()['cpu']}, {threads} thread(s), read bandwidth {bandwidth:.1f} GB/s, {short_name(dtype)}"
    results = run_workloads(
        WorkloadSpec(
            config=config,
            dtype=dtype,
            threads=threads,
            repeats=max(args.repeats, 1),
            seed=args.seed,
            compile=args.workloads_compile,
        )
    )
    print(format_workloads(results, machine))
    return 0 if all(r.agree for r in results) else 1


def _run_rl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from attn.bench.measure import read_bandwidth
    from attn.bench.rl import SMOLLM2_135M, RLSpec, format_rl, run_rl

    config = SMOLLM2_135M
    if args.config:
        try:
            _, config, _ = _resolve_config(_split_config(args.config[0])[0], 0)
        except ValueError as error:
            parser.error(str(error))
    dtype = _DTYPES.get((args.dtype or "fp32").split(",")[0].strip())
    if dtype is None:
        parser.error(f"unknown --dtype {args.dtype!r}; choose from {', '.join(_DTYPES)}")
    if len(args.rl_shape) != 4 or min(args.rl_shape) <= 0:
        parser.error(f"--rl-shape takes four positive ints B,G,P,N, got {args.rl_shape}")
    threads = (args.threads or [2])[0]
    bandwidth, _ = read_bandwidth(threads)
    machine = (
        f"{machine_info()['cpu']}, {threads} thread(s), read bandwidth {bandwidth:.1f} GB/s, torch {torch.__version__}"
    )
    spec = RLSpec(
        config=config,
        dtype=dtype,
        threads=threads,
        group=tuple(args.rl_shape),
        repeats=max(args.repeats, 1),
        seed=args.seed,
    )
    comparisons, costs, gaps = run_rl(spec)
    print(format_rl(comparisons, costs, gaps, spec, machine))
    if args.json:
        document = {
            "machine": machine_info(),
            "read_bandwidth_gbs": bandwidth,
            "spec": {"dtype": str(dtype), "threads": threads, "group": list(spec.group), "gap": list(spec.gap)},
            "comparisons": [dataclasses.asdict(c) for c in comparisons],
            "parity_cost": [dataclasses.asdict(c) for c in costs],
            "parity_gap": [dataclasses.asdict(g) for g in gaps],
        }
        args.json.write_text(json.dumps(document, indent=2, default=str))
        print(f"JSON written to {args.json}")
    parity_exact = all(g.max_abs == 0.0 for g in gaps if g.mode == "attn parity")  # bf16 and fp32
    return 0 if parity_exact and all("DIFFER" not in c.detail for c in comparisons) else 1
