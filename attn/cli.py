"""The command line: ``attn demo``, ``attn info``, ``attn bench`` and ``attn lm-eval``.

``python -m attn demo`` runs the built-in demo (see ``attn.demo``) and exits non-zero if any
pass used the KV-cache where it should not have, or did not where it should. ``attn info``
reports the torch release and the cache policy in force. ``attn bench`` forwards its
arguments to ``attn.bench.main``. ``attn lm-eval`` is lm-evaluation-harness's own command
line with attn's model registered (``--model attn``), which ``lm-eval`` alone cannot do:
it has no plugin hook to import attn.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from collections.abc import Sequence

__all__ = ["main"]

BENCH_MODULE = "attn.bench"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    from attn import __version__

    parser = argparse.ArgumentParser(
        prog="attn",
        description="attn: attention whose KV-cache follows the kind of forward pass.",
    )
    parser.add_argument("--version", action="version", version=f"attn {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    demo = commands.add_parser(
        "demo",
        help="train a tiny model, then run the eval, PPO and LoRA-PPO patterns on it",
        description=(
            "Trains a tiny decoder on two-number addition, then runs the eval, PPO and LoRA-PPO "
            "patterns on the same model with its KV-caches set up, and shows which passes used the "
            "cache (read from the caches' fill positions). Exits 1 if any invariant is violated."
        ),
    )
    demo.add_argument("--steps", type=_positive_int, default=1000, help="training steps (default: 1000)")
    demo.add_argument("--seed", type=_int, default=0, help="seed for data, weights and sampling (default: 0)")
    demo.add_argument(
        "--policy",
        choices=["inference", "flag"],
        help="force the cache policy (default: ATTN_CACHE_POLICY, else inference: inference mode or the flag)",
    )
    demo.add_argument("--compile", action="store_true", help="run every pass through torch.compile")
    demo.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend, with --compile (default: inductor; 'aot_eager' compiles fastest)",
    )
    demo.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch threads (default: 1: the demo model is tiny, more threads only add overhead)",
    )
    demo.add_argument("--json", metavar="PATH", help="also write every measurement as JSON to PATH")

    info = commands.add_parser(
        "info",
        help="torch release, cache policy, and what compile does with the inference-mode decision here",
        description="Reports the torch release, the KV-cache policy in force and why, Python and platform.",
    )
    info.add_argument(
        "--probe",
        action="store_true",
        help="also compile the is_inference() probe on this torch (a few seconds)",
    )

    commands.add_parser(
        "bench",
        help="benchmarks (arguments go to attn.bench; try: attn bench --help)",
        add_help=False,
    )
    commands.add_parser(
        "lm-eval",
        help="lm-evaluation-harness's command line with --model attn registered (try: attn lm-eval run --help)",
        add_help=False,
    )
    return parser


def _run_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.backend is not None and not args.compile:
        parser.error("--backend only applies with --compile")
    if args.json is not None:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            parser.error(f"--json {args.json}: folder {folder} does not exist")
    import torch

    from attn.demo import report
    from attn.demo.run import DemoOptions, run_demo

    torch.set_num_threads(args.threads)
    options = DemoOptions(
        steps=args.steps,
        seed=args.seed,
        policy=args.policy,
        compile=args.compile,
        backend=args.backend or "inductor",
    )
    try:
        result = run_demo(options, say=lambda text: print(text, flush=True))
    except torch._dynamo.exc.BackendCompilerFailed as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(
            f"attn demo: torch.compile's backend {options.backend!r} failed: {first_line}\n"
            "try `--backend aot_eager`, which needs no C++ compiler",
            file=sys.stderr,
        )
        return 1
    print(report.table(result))
    print(report.summary(result), flush=True)
    for text in result.warnings:
        print(f"note: {text}", file=sys.stderr)
    if args.json is not None:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(result.to_dict(), file, indent=2)
            file.write("\n")
    if not result.ok:
        print(f"attn demo: FAILED, {len(result.violations())} invariant(s) violated (see above)", file=sys.stderr)
        return 1
    return 0


def _run_info(args: argparse.Namespace) -> int:
    import torch

    from attn import __version__, compat

    print(f"attn:                {__version__}")
    print(compat.compat_report(probe=args.probe))
    print(f"python:              {platform.python_version()} ({platform.python_implementation()})")
    print(f"platform:            {platform.platform()}")
    print(f"threads:             {torch.get_num_threads()}")
    return 0


def _run_bench(argv: list[str]) -> int:
    try:
        bench = importlib.import_module(BENCH_MODULE)
    except ModuleNotFoundError as error:
        if error.name != BENCH_MODULE:
            raise
        print(
            f"attn bench: the benchmark module {BENCH_MODULE} is not part of this installation of attn; "
            "update attn, or run `attn demo` for the built-in speed comparison",
            file=sys.stderr,
        )
        return 1
    return int(bench.main(list(argv)))


def _run_lm_eval(argv: list[str]) -> int:
    try:
        import lm_eval.__main__ as harness

        import attn.integrations.lm_eval  # noqa: F401  (registers --model attn)
    except ModuleNotFoundError as error:
        if error.name is None or not error.name.startswith("lm_eval"):
            raise
        print(
            "attn lm-eval: lm-evaluation-harness is not installed; pip install 'attn[lm-eval]'",
            file=sys.stderr,
        )
        return 1
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # the harness parses sys.argv itself
    try:
        harness.cli_evaluate()
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 for a usage error).

    Example::

        >>> main(["info"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _run_bench(argv[1:])
    if argv and argv[0] == "lm-eval":
        return _run_lm_eval(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) if isinstance(exit_.code, int) or exit_.code is None else 2
    try:
        if args.command == "demo":
            return _run_demo(args, parser)
        return _run_info(args)
    except SystemExit as exit_:  # parser.error in a command
        return int(exit_.code) if isinstance(exit_.code, int) else 2
    except KeyboardInterrupt:
        print("attn: interrupted", file=sys.stderr)
        return 130
