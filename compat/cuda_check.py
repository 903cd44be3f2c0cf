"""The cache contract on a CUDA device: eager, torch.compile, and CUDA graphs.

Run on a machine with a CUDA GPU, from the repository root (attn importable)::

    python compat/cuda_check.py [--json out.json]

What it checks, each against an eager reference on the same weights:

1. a hand-written decode loop under plain ``torch.inference_mode()`` (the default policy)
   gives the tokens of a no-cache greedy loop, eager and ``torch.compile``d without fullgraph
   (one graph break per forward, counted);
2. ``attn.cached_inference`` with ``torch.compile(mode="reduce-overhead", fullgraph=True)``
   (inductor's CUDA graphs) gives the same tokens and the same cache, compiles the decode step
   once, and runs it as a CUDA graph (inductor's "cudagraph_skips" counter stays 0);
3. a no_grad pass and a grad pass leave the cache bit-for-bit alone;
4. decode step time for each way (median of timed steps, CUDA-synchronised).

Exit status 0 when every check held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
from torch._dynamo.utils import counters

import attn

PROMPT_LEN = 16
NEW_TOKENS = 32


def build(device: str) -> attn.TransformerDecoder:
    torch.manual_seed(0)
    config = attn.DecoderConfig(
        vocab_size=512, embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=2, hidden_dim=704, max_seq_len=128
    )
    return attn.TransformerDecoder(config).to(device).eval()


def no_cache_greedy(model: torch.nn.Module, prompt: torch.Tensor) -> list[int]:
    tokens = prompt
    with torch.no_grad(), attn.disable_kv_cache(model):
        for _ in range(NEW_TOKENS):
            tokens = torch.cat((tokens, model(tokens)[:, -1:].argmax(-1)), 1)
    return tokens[0, PROMPT_LEN:].tolist()


def decode(call, model, prompt: torch.Tensor, manager) -> tuple[list[int], list[float]]:
    """Greedy decode; returns the tokens and per-step times (ms) after 4 warm-up steps."""
    model.reset_caches()
    times = []
    tokens = []
    with manager():
        logits = call(prompt)
        for step in range(NEW_TOKENS):
            token = logits[:, -1:].argmax(-1).clone()  # (1, 1)
            tokens.append(token)
            torch.cuda.synchronize()
            start = time.perf_counter()
            logits = call(token)
            torch.cuda.synchronize()
            if step >= 4:
                times.append(1e3 * (time.perf_counter() - start))
    return [int(t) for t in torch.cat(tokens, 1)[0].tolist()], times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    warnings.simplefilter("ignore", attn.CompatWarning)
    device = "cuda"
    model = build(device)
    prompt = torch.randint(0, 512, (1, PROMPT_LEN), device=device, generator=torch.Generator(device).manual_seed(1))
    reference = no_cache_greedy(model, prompt)
    model.setup_caches(1, PROMPT_LEN + NEW_TOKENS + 1)
    results: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "problems": []}
    problems = results["problems"]

    def record(name: str, tokens: list[int], times: list[float], **extra: object) -> None:
        same = tokens == reference
        results[name] = {"tokens_match_no_cache": same, "step_ms_median": statistics.median(times), **extra}
        print(f"{name:<44} tokens == no-cache loop: {same}  step {statistics.median(times):.3f} ms  {extra}")
        if not same:
            problems.append(f"{name}: tokens differ from the no-cache loop")

    tokens, times = decode(model, model, prompt, torch.inference_mode)
    record("eager, plain inference_mode", tokens, times)
    eager_cache = [c.k_cache.clone() for c in model.kv_caches()]

    tokens, times = decode(model, model, prompt, lambda: attn.cached_inference(model))
    record("eager, cached_inference", tokens, times)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    tokens, times = decode(compiled, model, prompt, torch.inference_mode)
    breaks = sum(counters["graph_break"].values())
    record("compiled (inductor), plain inference_mode", tokens, times, graph_breaks=breaks)

    torch._dynamo.reset()
    counters.clear()
    graphs = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    tokens, times = decode(graphs, model, prompt, lambda: attn.cached_inference(model))
    skips = counters["inductor"]["cudagraph_skips"]
    frames = counters["stats"]["unique_graphs"]
    record(
        "CUDA graphs (reduce-overhead, fullgraph), cached_inference",
        tokens,
        times,
        cudagraph_skips=skips,
        compiled_graphs=frames,
    )
    same_cache = all(
        torch.allclose(a, c.k_cache, rtol=1e-4, atol=1e-4) for a, c in zip(eager_cache, model.kv_caches(), strict=True)
    )
    results["cuda_graph_cache_matches_eager"] = same_cache
    if not same_cache:
        problems.append("CUDA graphs: the cache differs from eager's")
    if skips:
        problems.append(f"CUDA graphs: inductor skipped cudagraphs {skips} time(s)")
    if frames != 2:
        problems.append(f"CUDA graphs: {frames} graphs compiled, expected 2 (prefill, decode)")

    before = [t.clone() for c in model.kv_caches() for t in (c.k_cache, c.v_cache, c.cache_pos)]
    batch = torch.randint(0, 512, (1, 12), device=device)
    with torch.no_grad():
        compiled(batch)
    model(batch).float().logsumexp(-1).mean().backward()
    after = [t for c in model.kv_caches() for t in (c.k_cache, c.v_cache, c.cache_pos)]
    untouched = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    results["no_grad_and_grad_leave_cache_untouched"] = untouched
    print(f"no_grad (compiled) and grad passes leave the cache bit-for-bit: {untouched}")
    if not untouched:
        problems.append("a no_grad or grad pass changed the cache")

    print("problems:", problems or "none")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
