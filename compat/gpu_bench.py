"""GPU decode figures for the README: a random-weight Llama-3.2-1B shape in bf16.

1. Batch 1 with the explicit flag and ``torch.compile(mode="reduce-overhead", fullgraph=True)``
   (CUDA graphs): decode tokens/s, and the share of the device's measured read bandwidth that
   the bytes a step must read (weights and cache, ``attn.bench.run.bytes_per_step``) take at
   that speed. The goal is 80%.
2. Batch 64: ``attn.generate`` (eager, and a ``torch.compile`` of the model) against
   transformers' ``generate`` with its static cache, on the same weights and prompts; greedy
   tokens compared.

Run on a machine with a CUDA GPU, from the repository root::

    python compat/gpu_bench.py [--device cuda] [--json PATH]
    python compat/gpu_bench.py --smoke    # a tiny shape on the CPU: what the slow tests run

Exit status 0 when every part ran (the figures are reported, not judged: the goal's verdict
is printed beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn
from attn.bench.contenders import hf_config, hf_state_dict, transformers_available
from attn.bench.measure import read_bandwidth
from attn.bench.run import bytes_per_step
from attn.rope import RopeScaling

LLAMA_32_1B = attn.DecoderConfig(
    vocab_size=128256, embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8, hidden_dim=8192,
    max_seq_len=4096, rope_base=500_000.0, tie_embeddings=True,
    rope_scaling=RopeScaling("llama3", 32.0, original_max_seq_len=8192, low_freq_factor=1.0, high_freq_factor=4.0),
)  # fmt: skip
"""Llama-3.2-1B's shape (random weights here; max_seq_len cut to what the runs need)."""

TINY = attn.DecoderConfig(
    vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=128, max_seq_len=256
)  # fmt: skip

BANDWIDTH_GOAL = 0.80


@dataclass(frozen=True)
class Plan:
    """Sizes of one run: the full one on a GPU, or the smoke test's on the CPU."""

    config: attn.DecoderConfig
    prompt_len: int
    new_tokens: int
    big_batch: int
    compile_mode: str | None  # torch.compile's mode for the batch-1 step
    backend: str


FULL = Plan(
    LLAMA_32_1B, prompt_len=512, new_tokens=256, big_batch=64, compile_mode="reduce-overhead", backend="inductor"
)
SMOKE = Plan(TINY, prompt_len=16, new_tokens=8, big_batch=4, compile_mode=None, backend="aot_eager")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_read_bandwidth(device: torch.device, megabytes: int = 2048, repeats: int = 21) -> float:
    """GB/s of ``sum()`` over a buffer far larger than any cache (2 GiB; 256 MiB on the CPU,
    ``attn.bench.measure.read_bandwidth``), median of ``repeats`` passes."""
    if device.type != "cuda":
        return read_bandwidth(torch.get_num_threads())[0]
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    buffer.sum()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buffer.sum()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return buffer.numel() * 4 / statistics.median(times) / 1e9


def random_model(config: attn.DecoderConfig, device: torch.device, dtype: torch.dtype) -> attn.TransformerDecoder:
    """``config`` with N(0, 0.02) matrices, built on ``device`` (no CPU copy of a 1B model)."""
    with torch.device("meta"):
        model = attn.TransformerDecoder(config)
    model = model.to(dtype=dtype).to_empty(device=device).eval()
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.02, generator=generator)
            else:
                parameter.fill_(1.0)
    return model


def timed(device: torch.device, run: Callable[[], Any]) -> tuple[float, Any]:
    synchronize(device)
    start = time.perf_counter()
    out = run()
    synchronize(device)
    return time.perf_counter() - start, out


def batch_one(model: attn.TransformerDecoder, plan: Plan, device: torch.device) -> dict[str, Any]:
    """Decode at batch 1 through a CUDA-graphed fullgraph compile, under the explicit flag."""
    prompt = torch.randint(0, plan.config.vocab_size, (1, plan.prompt_len), device=device)
    model.setup_caches(1, plan.prompt_len + plan.new_tokens)
    step = torch.compile(model, mode=plan.compile_mode, fullgraph=True, backend=plan.backend)

    def decode(steps: int) -> tuple[float, list[int]]:
        """Prefill (eager), then ``steps`` compiled steps; returns the steps' seconds and the tokens."""
        model.reset_caches()
        tokens = [model(prompt, last_only=True)[:, -1:].argmax(-1)]  # (1, 1)
        seconds, _ = timed(device, lambda: [tokens.append(step(tokens[-1])[:, -1:].argmax(-1)) for _ in range(steps)])
        return seconds, torch.cat(tokens, 1)[0].tolist()

    with attn.cached_inference(model):
        start = time.perf_counter()
        decode(3)  # compiles, records the graphs
        warmup = time.perf_counter() - start
        seconds, compiled_tokens = decode(plan.new_tokens - 1)
    model.teardown_caches()
    eager_tokens = attn.generate(model, prompt, max_new_tokens=plan.new_tokens).generated[0].tolist()
    step_s = seconds / (plan.new_tokens - 1)
    weights, kv = bytes_per_step(plan.config, next(model.parameters()).dtype, 1, plan.prompt_len + plan.new_tokens / 2)
    agree = next((i for i, (a, b) in enumerate(zip(compiled_tokens, eager_tokens, strict=True)) if a != b), None)
    return {
        "tokens_per_s": 1 / step_s,
        "step_ms": step_s * 1e3,
        "bytes_per_step": weights + kv,
        "compile_and_warmup_s": warmup,
        "greedy_tokens_equal_to_eager": plan.new_tokens if agree is None else agree,
    }


def big_batch(model: attn.TransformerDecoder, plan: Plan, device: torch.device) -> dict[str, Any]:
    """Generation throughput at ``plan.big_batch`` rows: attn eager, attn compiled, transformers static."""
    b, n = plan.big_batch, plan.new_tokens
    prompts = torch.randint(0, plan.config.vocab_size, (b, plan.prompt_len), device=device)
    out: dict[str, Any] = {}
    compiled = torch.compile(model, backend=plan.backend, mode=plan.compile_mode)
    for name, runner in (("attn eager", model), ("attn torch.compile", compiled)):
        attn.generate(runner, prompts, max_new_tokens=n)  # warm-up (and compile)
        seconds, result = timed(device, lambda runner=runner: attn.generate(runner, prompts, max_new_tokens=n))
        out[name] = {"tokens_per_s": b * n / seconds, "seconds": seconds}
        out.setdefault("_tokens", result.generated)
    if not transformers_available():
        out["transformers static"] = {"skipped": "transformers is not installed"}
        return out
    import transformers

    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(
            hf_config(plan.config), dtype=model.tok_embeddings.weight.dtype
        )
    hf.load_state_dict(hf_state_dict(model), strict=False)
    hf.tie_weights()
    hf.eval()
    config = transformers.GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, cache_implementation="static"
    )

    def hf_generate() -> torch.Tensor:
        with torch.inference_mode():
            mask = torch.ones_like(prompts)
            return hf.generate(input_ids=prompts, attention_mask=mask, generation_config=config)[:, plan.prompt_len :]

    hf_generate()  # warm-up
    seconds, hf_tokens = timed(device, hf_generate)
    same = (hf_tokens == out["_tokens"]).float().mean().item()
    out["transformers static"] = {"tokens_per_s": b * n / seconds, "seconds": seconds, "same_greedy_tokens": same}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (the slow tests' run)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--smoke runs a tiny shape on the CPU)")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run)"
    dtype = torch.bfloat16
    model = random_model(plan.config, device, dtype)
    bandwidth = device_read_bandwidth(device)
    one = batch_one(model, plan, device)
    share = one["bytes_per_step"] * one["tokens_per_s"] / (bandwidth * 1e9)
    many = big_batch(model, plan, device)
    many.pop("_tokens")
    figures = {
        "device": name,
        "torch": torch.__version__,
        "shape": "Llama-3.2-1B" if plan is FULL else "tiny",
        "prompt_len": plan.prompt_len,
        "new_tokens": plan.new_tokens,
        "read_bandwidth_gb_s": bandwidth,
        "batch_1": {**one, "share_of_read_bandwidth": share},
        f"batch_{plan.big_batch}": many,
    }
    print(f"{name}, torch {torch.__version__}, {figures['shape']} bf16 random weights, prompt {plan.prompt_len}")
    print(f"read bandwidth {bandwidth:.0f} GB/s (sum over a buffer larger than any cache, median)")
    verdict = "met" if share >= BANDWIDTH_GOAL else "NOT MET"
    print(
        f"batch 1, cached_inference + torch.compile(mode={plan.compile_mode!r}, fullgraph=True): "
        f"{one['tokens_per_s']:.1f} tok/s ({one['step_ms']:.2f} ms a step, {one['bytes_per_step'] / 1e9:.2f} GB read): "
        f"{share:.0%} of the read bandwidth (goal {BANDWIDTH_GOAL:.0%}: {verdict}); greedy tokens equal eager's "
        f"for the first {one['greedy_tokens_equal_to_eager']} of {plan.new_tokens}"
    )
    for contender, row in many.items():
        text = row.get("skipped") or f"{row['tokens_per_s']:.0f} tok/s ({row['seconds']:.2f} s)"
        if "same_greedy_tokens" in row:
            text += f", {row['same_greedy_tokens']:.0%} of greedy tokens equal to attn eager's"
        print(f"batch {plan.big_batch} x {plan.new_tokens} new tokens, {contender}: {text}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(figures, file, indent=2)
            file.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
