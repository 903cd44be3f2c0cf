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
  the share of tokens whose ratio ``exp(train - gen)`` leaves [0.99, 1.01] and [0.9, 1.1];
  and transformers on the same weights (``generate(output_logits=True)`` against its
  forward), when it is installed.

Both sides of a comparison use the same weights and threads and alternate repeat by repeat;
figures are medians. Random weights (``init_std``): the gap figures depend on the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attn.bench.contenders import hf_config, hf_state_dict, transformers_available
from attn.bench.measure import Comparison, RandomModelSpec, Stats, alternate, peak_rss_mb, reset_peak_rss, timed
from attn.decoder import DecoderConfig, TransformerDecoder
from attn.dtypes import short_name
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


@dataclass(frozen=True, kw_only=True)
class RLSpec(RandomModelSpec):
    """What ``run_rl`` measures: the model (``RandomModelSpec``: SmolLM2-135M's shape, 2
    threads, 2 repeats by default) and

    Attributes:
        group: (B, G, P, N): B prompts x G completions, prompts of P tokens, completions of N.
        gap: (B, G, P, N) of the parity-gap generation, run in bf16 and fp32.
    """

    config: DecoderConfig = SMOLLM2_135M
    threads: int = 2
    repeats: int = 2
    group: tuple[int, int, int, int] = (2, 8, 512, 128)
    gap: tuple[int, int, int, int] = (2, 4, 48, 48)


@dataclass(frozen=True)
class Gap:
    """Generation's log-probs against the training forward's, in one mode."""

    mode: str
    dtype: str
    max_abs: float
    outside_1pct: float
    outside_10pct: float
    tokens: int


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
        detail = (
            f"log-probs {'agree' if agree else 'DIFFER'} (largest difference {float((ours - theirs).abs().max()):.2e})"
        )
        nograd = alternate(shared, full, spec.repeats, warmup=False)
    step = alternate(
        lambda: (shared() * advantages).sum().backward(),
        lambda: (full() * advantages).sum().backward(),
        spec.repeats,
        warmup=False,
    )
    peaks = [_peak_mb(lambda fn=fn: (fn() * advantages).sum().backward()) for fn in (shared, full)]
    model.zero_grad(set_to_none=True)
    names = ("attn.completion_logprobs (prompt once)", "full forward over B x G rows")
    return [
        Comparison("logprobs", *names, *nograd, detail=detail),
        Comparison(
            "policy step",
            *names,
            *step,
            detail="forward + backward of sum(logprobs * advantages)",
            ours_peak_mb=peaks[0],
            theirs_peak_mb=peaks[1],
        ),
    ]


def _parity_cost(model: TransformerDecoder, spec: RLSpec, generator: torch.Generator) -> list[Comparison]:
    B, G, P, _ = spec.group
    prompts, groups = _batch(spec, generator)
    prompt_tokens = torch.tensor(prompts)  # (B, P)
    step_tokens = torch.randint(1, spec.config.vocab_size, (B * G, 1), generator=generator)

    def prefill() -> float:
        model.setup_caches(B, P)
        with torch.inference_mode():
            seconds = timed(lambda: model(prompt_tokens, last_only=True))
        model.teardown_caches()
        return seconds

    def decode() -> float:  # 8 steps of B x G rows on a cache that holds the prompts (not timed)
        model.setup_caches(B * G, P + 8)
        with torch.inference_mode():
            model(prompt_tokens.repeat_interleave(G, 0), last_only=True)
            seconds = timed(lambda: [model(step_tokens) for _ in range(8)]) / 8
        model.teardown_caches()
        return seconds

    def train() -> float:
        return timed(lambda: completion_logprobs(model, prompts, groups).logprobs.sum().backward())

    results = []
    phases = ((f"prefill ({B} x {P})", prefill), (f"decode step ({B * G} rows)", decode), ("policy step", train))
    for name, fn in phases:
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(spec.repeats):
            for parity in (False, True):
                set_parity_mode(model, parity)
                times[parity].append(fn())
        set_parity_mode(model, False)
        results.append(Comparison(name, "parity mode", "default", Stats.of(times[1]), Stats.of(times[0])))
    model.zero_grad(set_to_none=True)
    return results


def _parity_gap(spec: RLSpec, dtype: torch.dtype) -> list[Gap]:
    B, G, P, N = spec.gap
    model = spec.model(P + N, dtype)
    generator = torch.Generator().manual_seed(spec.seed)
    prompts = torch.randint(1, model.config.vocab_size, (B, P), generator=generator).tolist()
    gaps = []
    for parity in (False, True):
        set_parity_mode(model, parity)
        out = generate(
            model, prompts, max_new_tokens=N, temperature=1.0, num_samples=G,
            generator=torch.Generator().manual_seed(spec.seed), return_logits=True,
        )  # fmt: skip
        sampled = out.logits.log_softmax(-1).gather(-1, out.generated[..., None]).squeeze(-1)
        model.train()
        logits = model(
            out.tokens, input_pos=padding_positions(out.padding_mask), mask=padded_causal_mask(out.padding_mask)
        )
        model.eval()
        trained = logits[:, P - 1 : -1].float().log_softmax(-1).gather(-1, out.generated[..., None]).squeeze(-1)
        diff = (trained - sampled).detach()[out.generated_mask]
        gaps.append(_gap("attn parity" if parity else "attn default", dtype, diff))
    set_parity_mode(model, False)
    if transformers_available():
        gaps.append(_transformers_gap(model, prompts, G, N, spec.seed, dtype))
    return gaps


def _gap(mode: str, dtype: torch.dtype, diff: torch.Tensor) -> Gap:
    ratio = diff.exp()
    outside_1, outside_10 = ((ratio < 0.99) | (ratio > 1.01)), ((ratio < 0.9) | (ratio > 1.1))
    share_1, share_10 = float(outside_1.float().mean()), float(outside_10.float().mean())
    return Gap(mode, short_name(dtype), float(diff.abs().max()), share_1, share_10, diff.numel())


def _transformers_gap(
    model: TransformerDecoder, prompts: list[list[int]], G: int, N: int, seed: int, dtype: torch.dtype
) -> Gap:
    """The same weights in transformers' LlamaForCausalLM: ``generate(output_logits=True)``
    (sampled, temperature 1, no top-k) against its own training forward."""
    import warnings

    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(model.config), dtype=dtype)
    hf.load_state_dict(hf_state_dict(model), strict=False)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    hf.eval()
    torch.manual_seed(seed)
    prompt = torch.tensor(prompts)  # (B, P): equal lengths, no padding
    out = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=N, min_new_tokens=N, num_return_sequences=G, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    P = prompt.shape[1]
    generated = out.sequences[:, P:]  # (B * G, N)
    sampled = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, generated[..., None]).squeeze(-1)
    hf.train()
    logits = hf(out.sequences).logits[:, P - 1 : -1]
    trained = logits.float().log_softmax(-1).gather(-1, generated[..., None]).squeeze(-1)
    return _gap(f"transformers {transformers.__version__}", dtype, (trained - sampled).detach().flatten())


def run_rl(spec: RLSpec) -> tuple[list[Comparison], list[Comparison], list[Gap]]:
    """Measures the comparisons, parity mode's cost and its gap, on random weights."""
    with spec.threads_set():
        _, _, P, N = spec.group
        model = spec.model(P + N).train()
        generator = torch.Generator().manual_seed(spec.seed)
        comparisons = _compare_logprobs(model, spec, generator)
        costs = _parity_cost(model, spec, generator)
        return comparisons, costs, [*_parity_gap(spec, torch.bfloat16), *_parity_gap(spec, torch.float32)]


def format_rl(
    comparisons: list[Comparison], costs: list[Comparison], gaps: list[Gap], spec: RLSpec, machine: str
) -> str:
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
        lines.append(
            f"  {c.name:<32} {c.ours_s.median:8.3f} s against {c.theirs_s.median:8.3f} s: {1 / c.speedup:.2f}x the time"
        )
    gB, gG, gP, gN = spec.gap
    lines.append(
        f"\nparity gap (generate B={gB} x G={gG}, P={gP}, N={gN}, temperature 1, against the training forward):"
    )
    for g in gaps:
        lines.append(
            f"  {g.mode:<20} {g.dtype:<4} max |diff| {g.max_abs:.3g}; ratio outside [0.99, 1.01]: "
            f"{100 * g.outside_1pct:.1f}%, outside [0.9, 1.1]: {100 * g.outside_10pct:.1f}% of {g.tokens} tokens"
        )
    return "\n".join(lines)
