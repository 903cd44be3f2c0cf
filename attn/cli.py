"""The command line: ``attn demo``, ``attn info``, ``attn generate``, ``attn bench``, ``attn lm-eval``.

``python -m attn demo`` runs the built-in demo (see ``attn.demo``) and exits non-zero if any
pass used the KV-cache where it should not have, or did not where it should. ``attn info``
reports the torch release and the cache policy in force. ``attn generate CHECKPOINT PROMPT``
streams text from a checkpoint directory (its tokenizer.json and chat template, read by
``attn.tokenizer``), with ``attn.generate``. ``attn bench`` forwards its
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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from attn.errors import first_line

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


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (0 is greedy), got {value}")
    return value


def _dtype(text: str) -> Any:
    from attn.dtypes import dtype_from_name

    try:
        return dtype_from_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _device(text: str) -> str:
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; use cpu, cuda or cuda:1") from None
    if device.type == "meta":
        raise argparse.ArgumentTypeError("meta holds shapes, not weights, so it cannot generate; use cpu or cuda")
    return text


def build_parser() -> argparse.ArgumentParser:
    from attn import __version__

    parser = argparse.ArgumentParser(
        prog="attn",
        description="attn: attention whose KV-cache follows the kind of forward pass.",
    )
    parser.add_argument("--version", action="version", version=f"attn {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help="on a failure, show Python's traceback (default: one line saying why)"
    )

    demo = commands.add_parser(
        "demo",
        parents=[common],
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
        parents=[common],
        help="torch release, cache policy, and what compile does with the inference-mode decision here",
        description="Reports the torch release, the KV-cache policy in force and why, Python and platform.",
    )
    info.add_argument(
        "--probe",
        action="store_true",
        help="also compile the is_inference() probe on this torch (a few seconds)",
    )

    generate = commands.add_parser(
        "generate",
        parents=[common],
        help="stream text from a checkpoint directory with its tokenizer (and chat template)",
        description=(
            "Loads a Hugging Face checkpoint directory (attn.load_pretrained) and its tokenizer.json "
            "(attn.tokenizer), generates with attn.generate, and prints the text as it is produced. "
            "Stops at any of the checkpoint's EOS ids; a timing line goes to stderr. "
            "Needs pip install 'attn[tokenizer]'."
        ),
    )
    generate.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="directory: config.json, safetensors, tokenizer.json"
    )
    generate.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="wrap PROMPT as one user message in the checkpoint's chat template, ending with the assistant's turn",
    )
    generate.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        help="tokens to generate at most (default: 256, or fewer to fit the model's max_seq_len)",
    )
    generate.add_argument(
        "--temperature", type=_temperature, default=0.0, help="sampling temperature; 0 is greedy (default: 0)"
    )
    generate.add_argument("--top-k", type=_positive_int, default=None, help="sample from the k likeliest tokens only")
    generate.add_argument("--seed", type=_int, default=None, help="seed for sampling (default: a fresh draw)")
    generate.add_argument(
        "--dtype", type=_dtype, default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)"
    )
    generate.add_argument(
        "--device",
        type=_device,
        default=None,
        help="where to load the model: cpu, cuda, cuda:1 (default: torch's default device, the CPU)",
    )
    generate.add_argument(
        "--compile",
        action="store_true",
        help="decode through attn.compile_for_decode: a compiled step, faster tokens after a compile of tens of "
        "seconds; on a CPU with AVX512-BF16 or AVX2 and a Llama-style model, the native step instead, nothing compiled",
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
        print(
            f"attn demo: torch.compile's backend {options.backend!r} failed: {first_line(error)}\n"
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
    from attn.parity import modes_report
    from attn.policy import policy_report

    print(f"attn:                {__version__}")
    print(compat.compat_report(probe=args.probe))
    print(policy_report())
    print(modes_report())
    print(f"python:              {platform.python_version()} ({platform.python_implementation()})")
    print(f"platform:            {platform.platform()}")
    print(f"threads:             {torch.get_num_threads()}")
    return 0


class _TextStream:
    """Prints the text of one row's generated ids as they come (``generate``'s ``on_tokens``).

    Each step decodes all the ids so far and prints what is new beyond the text already
    printed; a trailing U+FFFD (a character whose bytes have not all come yet) waits for the
    next step. Ids after a stop id are not text.
    """

    def __init__(self, tokenizer: Any, stop_ids: Sequence[int], out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.out = out
        self.ids: list[int] = []
        self.count = 0  # tokens generated, a stop id included
        self.first_token_at: float | None = None
        self._printed = ""
        self._stopped = False

    def __call__(self, tokens: Any) -> None:  # (1,) tokens of one step
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self._stopped:
            return
        token = int(tokens[0])
        self.count += 1
        if token in self.stop_ids:
            self._stopped = True
            return
        self.ids.append(token)
        self._write(self.tokenizer.decode(self.ids).rstrip("\ufffd"))

    def finish(self) -> None:
        """Prints the rest (replacement characters that stayed) and a newline."""
        self._write(self.tokenizer.decode(self.ids))
        self.out.write("\n")
        self.out.flush()

    def _write(self, text: str) -> None:
        if len(text) > len(self._printed):
            self.out.write(text[len(self._printed) :])
            self.out.flush()
            self._printed = text


def _prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """The prompt's ids: as one user message in the chat template, or as plain text."""
    if not chat:
        ids = tokenizer.encode(prompt, add_special_tokens=True)  # BOS where the checkpoint adds one
        if not ids:
            raise ValueError("the prompt is empty and the tokenizer adds no BOS token: give some text")
        return ids
    if tokenizer.chat_template is None:
        raise ValueError(
            f"--chat needs a chat template, and {tokenizer.directory / 'tokenizer_config.json'} has none (nor "
            "is there a chat_template.jinja): run without --chat to use the prompt as plain text"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(text)  # the template writes the special tokens itself


def _new_tokens(asked: int | None, prompt_length: int, max_seq_len: int) -> int:
    """``--max-new-tokens``, checked against the model's length; by default 256, or what fits."""
    room = max_seq_len - prompt_length
    if room < 1:
        raise ValueError(
            f"the prompt has {prompt_length} tokens, and the model's max_seq_len ({max_seq_len}) leaves no room "
            "for a new one: shorten the prompt"
        )
    if asked is not None and asked > room:
        raise ValueError(
            f"the prompt's {prompt_length} tokens and --max-new-tokens {asked} make {prompt_length + asked}, more "
            f"than the model's max_seq_len ({max_seq_len}): ask for at most {room} new tokens, or shorten the prompt"
        )
    return min(256, room) if asked is None else asked


def _run_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.top_k is not None and args.temperature == 0.0:
        parser.error("--top-k only applies with --temperature > 0 (0 is greedy)")
    directory = Path(args.checkpoint)
    if not directory.is_dir():
        parser.error(f"CHECKPOINT {args.checkpoint} is not a directory (config.json, safetensors, tokenizer.json)")
    try:
        from attn.tokenizer import TokenizerFile
    except ModuleNotFoundError as error:
        if error.name not in ("tokenizers", "jinja2"):
            raise
        print(f"attn generate: needs the {error.name} package; pip install 'attn[tokenizer]'", file=sys.stderr)
        return 1
    import torch

    import attn

    try:
        tokenizer = TokenizerFile(directory)
        ids = _prompt_ids(tokenizer, args.prompt, args.chat)  # before the weights: a bad prompt fails fast
        if args.device is not None and torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: this torch build or machine has no CUDA; use --device cpu")
        model = attn.load_pretrained(directory, dtype=args.dtype, device=args.device)
        max_new_tokens = _new_tokens(args.max_new_tokens, len(ids), model.config.max_seq_len)
        device = model.tok_embeddings.weight.device
        # The CPU rewrites read each weight once per step; other devices get stock inductor.
        fast = attn.compile_for_decode(model, rewrite_linears=device.type == "cpu") if args.compile else None
        generator = None if args.seed is None else torch.Generator(device=device).manual_seed(args.seed)
        stream = _TextStream(tokenizer, tokenizer.eos_token_ids, sys.stdout)
        start = time.perf_counter()
        attn.generate(
            fast or model,
            [ids],
            max_new_tokens=max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            stop_tokens=tokenizer.eos_token_ids,
            pad_id=tokenizer.eos_token_id,
            generator=generator,
            on_tokens=stream,
        )
        seconds = time.perf_counter() - start
    except (FileNotFoundError, ValueError) as error:  # attn's own: the message names the file or value and the fix
        if args.debug:
            raise
        print(f"attn generate: {error}", file=sys.stderr)
        return 1
    stream.finish()
    first = (stream.first_token_at or start) - start
    timing = f"{stream.count} tokens in {seconds:.2f} s ({stream.count / seconds:.1f} tok/s)"
    timing += f"; prompt {len(ids)} tokens, first token after {first:.2f} s"
    if fast is not None and fast.stats.native_steps and not fast.stats.graphs:
        timing += "; decode steps run their layers as attn::decode_layers calls (attn.native), nothing compiled"
    elif fast is not None:
        timing += f"; compiled {fast.stats.graphs} decode graph(s) in {fast.stats.compile_seconds:.1f} s"
    print(f"attn generate: {timing}", file=sys.stderr)
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
    if argv and argv[0] == "bench":  # its own parser; --debug is ours
        rest = [arg for arg in argv[1:] if arg != "--debug"]
        try:
            return _run_bench(rest)
        except KeyboardInterrupt:
            print("attn: interrupted", file=sys.stderr)
            return 130
        except Exception as error:
            if "--debug" in argv:
                raise
            print(f"attn bench: {first_line(error)} (--debug shows the traceback)", file=sys.stderr)
            return 1
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
        if args.command == "generate":
            return _run_generate(args, parser)
        return _run_info(args)
    except SystemExit as exit_:  # parser.error in a command
        return int(exit_.code) if isinstance(exit_.code, int) else 2
    except KeyboardInterrupt:
        print("attn: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # what the commands do not foresee: one line, the traceback on request
        if args.debug:
            raise
        print(f"attn {args.command}: {first_line(error)} (--debug shows the traceback)", file=sys.stderr)
        return 1
