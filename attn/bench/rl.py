"""``python -m attn bench --rl``: the GRPO step's passes, and what parity mode costs and buys.

- ``logprobs``: per-token log-probs of B x G completions (the reference / old-policy pass,
  no grad): ``attn.completion_logprobs`` (each prompt once) against one full forward over
  the B x G prompt + completion rows. Target: at least 3x (fp32, P=512, G=8, N=128, B=2).
- ``policy step``: the same with grad, forward + backward of a GRPO-style loss, and the
  peak RSS of each side. Target: at least 1.5x, and a lower peak.
- ``parity cost``: prefill, one decode step, and the policy step, default kernels against
  parity mode (``attn.set_parity_mode``), on the same model.
- ``parity gap``: ``attn.generate(..., num_samples=G, return_logits=True)`` log-probs of the
  sampled tokens against the training forward's, in each mode: the largest difference and
  the share of tokens whose ratio ``exp(train - gen)`` leaves [0.99, 1.01] and [0.9, 1.1].

Both sides of a comparison use the same weights and threads and alternate repeat by repeat;
figures are medians. Random weights (``init_std``): the gap figures depend on the weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from attn.bench.contenders import init_weights
from attn.bench.measure import Stats, peak_rss_mb, reset_peak_rss
from attn.decoder import DecoderConfig, TransformerDecoder
from attn.generation import generate
from attn.logprobs import completion_logprobs
from attn.masks import padded_causal_mask, padding_positions
from attn.parity import set_parity_mode

__all__ = ["SMOLLM2_135M", "RLSpec", "format_rl", "run_rl"]

SMOLLM2_135M = DecoderConfig(
    vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9, num_kv_heads=3, hidden_dim=1536,
    max_seq_len=2048, rope_base=100_000.0, tie_embeddings=True,
)  # fmt: skip
"""SmolLM2-135M's shape (random weights here)."""

TARGETS = {"logprobs": 3.0, "policy step": 1.5}


@dataclass(frozen=True)
class RLSpec:
    """What ``run_rl`` measures.

    Attributes:
        config: the model (random weights, ``init_std``).
        dtype: parameter dtype of the speed comparisons.
        threads: torch intra-op threads.
        group: (B, G, P, N): B prompts x G completions, prompts of P tokens, completions of N.
        gap: (B, G, P, N) of the parity-gap generation, run in bf16 (the precision that has a gap).
        repeats: timed runs of each side.
    """

    config: DecoderConfig = SMOLLM2_135M
    dtype: torch.dtype = torch.float32
    threads: int = 2
    group: tuple[int, int, int, int] = (2, 8, 512, 128)
    gap: tuple[int, int, int, int] = (2, 4, 48, 48)
    repeats: int = 2
    init_std: float = 0.05
    seed: int = 0


@dataclass(frozen=True)
class Comparison:
    """Seconds of two ways to compute one thing, and their peak RSS (MB) where measured."""

    name: str
    ours: str
    theirs: str
    ours_s: Stats
    theirs_s: Stats
    ours_peak_mb: float | None = None
    theirs_peak_mb: float | None = None
    detail: str = ""

    @property
    def speedup(self) -> float:
        return self.theirs_s.median / self.ours_s.median


@dataclass(frozen=True)
class Gap:
    """Generation's log-probs against the training forward's, in one mode."""

    mode: str
    max_abs: float
    outside_1pct: float
    outside_10pct: float
    tokens: int


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _alternate(ours: Callable[[], object], theirs: Callable[[], object], repeats: int) -> tuple[Stats, Stats]:
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        times[0].append(_timed(ours))
        times[1].append(_timed(theirs))
    return Stats.of(times[0]), Stats.of(times[1])


def _peak_mb(fn: Callable[[], object]) -> float | None:
    if not reset_peak_rss():
        return None
    fn()
    return peak_rss_mb()


def _batch(spec: RLSpec, generator: torch.Generator) -> tuple[list[list[int]], list[list[list[int]]]]:
    B, G, P, N = spec.group
    vocab = spec.config.vocab_size
    prompts = torch.randint(1, vocab, (B, P), generator=generator).tolist()
    completions = torch.randint(1, vocab, (B, G, N), generator=generator).tolist()
    return prompts, completions


def full_forward_logprobs(
    model: TransformerDecoder, prompts: list[list[int]], groups: list[list[list[int]]]
) -> torch.Tensor:
    """What recipes run today: one forward over every prompt + completion row, (R, N) log-probs."""
    rows = [[*p, *c] for p, group in zip(prompts, groups, strict=True) for c in group]
    P = len(prompts[0])
    tokens = torch.tensor(rows)  # (R, P + N): equal lengths here, no padding
    logits = model(tokens)[:, P - 1 : -1]  # (R, N, v)
    return logits.float().log_softmax(-1).gather(-1, tokens[:, P:, None]).squeeze(-1)


def _compare_logprobs(model: TransformerDecoder, spec: RLSpec, generator: torch.Generator) -> list[Comparison]:
    prompts, groups = _batch(spec, generator)
    advantages = torch.randn(len(prompts) * len(groups[0]), spec.group[3], generator=generator)

    def shared() -> torch.Tensor:
        return completion_logprobs(model, prompts, groups).logprobs

    def full() -> torch.Tensor:
        return full_forward_logprobs(model, prompts, groups)

    with torch.no_grad():
        ours, theirs = shared(), full()
        agree = torch.allclose(ours, theirs, atol=1e-3, rtol=1e-3)
        detail = f"log-probs {'agree' if agree else 'DIFFER'} (largest difference {float((ours - theirs).abs().max()):.2e})"
        nograd = _alternate(shared, full, spec.repeats)
    step = _alternate(lambda: (shared() * advantages).sum().backward(), lambda: (full() * advantages).sum().backward(), spec.repeats)
    peaks = [_peak_mb(lambda: (fn() * advantages).sum().backward()) for fn in (shared, full)]
    model.zero_grad(set_to_none=True)
    names = ("attn.completion_logprobs (prompt once)", "full forward over B x G rows")
    return [
        Comparison("logprobs", *names, *nograd, detail=detail),
        Comparison("policy step", *names, *step, *peaks, detail="forward + backward of sum(logprobs * advantages)"),
    ]


def _parity_cost(model: TransformerDecoder, spec: RLSpec, generator: torch.Generator) -> list[Comparison]:
    B, G, P, N = spec.group
    prompts, groups = _batch(spec, generator)
    prompt_tokens = torch.tensor(prompts)  # (B, P)
    step_tokens = torch.randint(1, spec.config.vocab_size, (B * G, 1), generator=generator)

    def prefill() -> None:
        model.setup_caches(B, P)
        with torch.inference_mode():
            model(prompt_tokens, last_only=True)
        model.teardown_caches()

    def decode() -> None:  # 8 steps on a cache holding the prompt, per step below
        model.setup_caches(B * G, P + 8)
        with torch.inference_mode():
            model(prompt_tokens.repeat_interleave(G, 0), last_only=True)
            for _ in range(8):
                model(step_tokens)
        model.teardown_caches()

    def train() -> None:
        completion_logprobs(model, prompts, groups).logprobs.sum().backward()

    results = []
    for name, fn in (("prefill", prefill), ("decode (8 steps on a prefill)", decode), ("policy step", train)):
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(spec.repeats):
            for parity in (False, True):
                set_parity_mode(model, parity)
                times[parity].append(_timed(fn))
        set_parity_mode(model, False)
        results.append(Comparison(name, "parity mode", "default", Stats.of(times[1]), Stats.of(times[0])))
    model.zero_grad(set_to_none=True)
    return results


def _parity_gap(spec: RLSpec) -> list[Gap]:
    B, G, P, N = spec.gap
    config = replace(spec.config, max_seq_len=max(spec.config.max_seq_len, P + N))
    model = TransformerDecoder(config)
    init_weights(model, spec.init_std, spec.seed)
    model = model.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(spec.seed)
    prompts = torch.randint(1, config.vocab_size, (B, P), generator=generator).tolist()
    gaps = []
    for parity in (False, True):
        set_parity_mode(model, parity)
        out = generate(
            model, prompts, max_new_tokens=N, temperature=1.0, num_samples=G,
            generator=torch.Generator().manual_seed(spec.seed), return_logits=True,
        )  # fmt: skip
        sampled = out.logits.log_softmax(-1).gather(-1, out.generated[..., None]).squeeze(-1)
        model.train()
        logits = model(out.tokens, input_pos=padding_positions(out.padding_mask), mask=padded_causal_mask(out.padding_mask))
        model.eval()
        trained = logits[:, P - 1 : -1].float().log_softmax(-1).gather(-1, out.generated[..., None]).squeeze(-1)
        diff = (trained - sampled).detach()[out.generated_mask]
        ratio = diff.exp()
        gaps.append(
            Gap(
                "parity" if parity else "default",
                float(diff.abs().max()),
                float(((ratio < 0.99) | (ratio > 1.01)).float().mean()),
                float(((ratio < 0.9) | (ratio > 1.1)).float().mean()),
                int(diff.numel()),
            )
        )
    return gaps


def run_rl(spec: RLSpec) -> tuple[list[Comparison], list[Comparison], list[Gap]]:
    """Measures the comparisons, parity mode's cost and its gap, on random weights."""
    before = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        B, G, P, N = spec.group
        config = replace(spec.config, max_seq_len=max(spec.config.max_seq_len, P + N))
        model = TransformerDecoder(config)
        init_weights(model, spec.init_std, spec.seed)
        model = model.to(spec.dtype)
        generator = torch.Generator().manual_seed(spec.seed)
        comparisons = _compare_logprobs(model, spec, generator)
        costs = _parity_cost(model, spec, generator)
        return comparisons, costs, _parity_gap(spec)
    finally:
        torch.set_num_threads(before)


def format_rl(comparisons: list[Comparison], costs: list[Comparison], gaps: list[Gap], spec: RLSpec, machine: str) -> str:
    """A plain-text report: each comparison with its target met or not, the costs, the gaps."""
    B, G, P, N = spec.group
    lines = [f"RL passes ({machine}); B={B} prompts x G={G}, P={P}, N={N}; seconds, median (min-max) of {spec.repeats}"]
    for c in comparisons:
        target = TARGETS.get(c.name)
        verdict = "" if target is None else f"; target >= {target}x: {'met' if c.speedup >= target else 'NOT met'}"
        lines.append(f"\n{c.name}: {c.detail}")
        for label, stats, peak in ((c.ours, c.ours_s, c.ours_peak_mb), (c.theirs, c.theirs_s, c.theirs_peak_mb)):
            memory = "" if peak is None else f", peak RSS {peak:.0f} MB"
            lines.append(f"  {label:<40} {stats.median:8.3f} s ({stats.min:.3f}-{stats.max:.3f}){memory}")
        lines.append(f"  speedup {c.speedup:.2f}x{verdict}")
        if c.ours_peak_mb is not None and c.theirs_peak_mb is not None:
            lower = c.ours_peak_mb < c.theirs_peak_mb
            lines.append(f"  peak lower: {'met' if lower else 'NOT met'}")
    lines.append(f"\nparity mode's cost ({spec.dtype}; parity s against default s):")
    for c in costs:
        lines.append(f"  {c.name:<32} {c.ours_s.median:8.3f} s against {c.theirs_s.median:8.3f} s: {1 / c.speedup:.2f}x the time")
    gB, gG, gP, gN = spec.gap
    lines.append(f"\nparity gap (bf16, generate B={gB} x G={gG}, P={gP}, N={gN}, temperature 1, vs the training forward):")
    for g in gaps:
        lines.append(
            f"  {g.mode:<8} max |diff| {g.max_abs:.3g}; ratio outside [0.99, 1.01]: {100 * g.outside_1pct:.1f}%, "
            f"outside [0.9, 1.1]: {100 * g.outside_10pct:.1f}% of {g.tokens} tokens"
        )
    return "\n".join(lines)
