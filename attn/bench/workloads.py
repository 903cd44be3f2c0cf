"""``python -m attn bench --workloads``: the two RL/eval workloads a cache can save work in,
each timed against the way recipes run them today, side by side in one process.

- ``grpo``: B prompts x G samples. ``generate(num_samples=G)`` prefills each prompt once and
  forks its cache rows, against ``generate`` on the prompts repeated G times (the B x G
  expansion GRPO recipes use). Sampled at temperature 1 from one seed per run.
- ``scoring``: a multiple-choice log-likelihood task, N questions of K continuations each.
  ``score_continuations`` prefills each context once, against scoring the K
  ``context + continuation`` rows in one right-padded uncached pass per question (what an
  evaluation harness does).

Both sides use the same weights, eager, the same threads; each repeat runs both, alternating,
and the figures are medians. Outputs are checked against each other: greedy tokens equal
(grpo, with a greedy run); scores within fp32 tolerance of each other in fp32, and in a lower
precision each side's no further from an fp32 copy's scores than twice the other's (two bf16
kernels differ by a tenth of a nat on 4-token continuations: neither is the exact one), with the
same choice on every question (scoring).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from attn.bench.measure import Comparison, RandomModelSpec, alternate
from attn.decoder import TransformerDecoder
from attn.fast_decode import compile_for_decode
from attn.generation import generate
from attn.scoring import score_continuations

__all__ = ["WorkloadSpec", "format_workloads", "run_workloads"]


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec(RandomModelSpec):
    """What ``run_workloads`` measures: the model (``RandomModelSpec``) and

    Attributes:
        grpo: (B, G, P, N): B prompts x G samples, prompts of P tokens, N new tokens each.
        scoring: (Q, K, C, m): Q questions of K continuations, contexts of C tokens,
            continuations of m.
        compile: both grpo sides decode with ``attn.compile_for_decode`` (one compiled step,
            compiled in the warm-up run, not in the timed ones).
    """

    grpo: tuple[int, int, int, int] = (2, 8, 256, 64)
    scoring: tuple[int, int, int, int] = (8, 4, 256, 4)
    compile: bool = False


def _grpo(model: nn.Module, spec: WorkloadSpec, generator: torch.Generator) -> Comparison:
    B, G, P, N = spec.grpo
    prompts = torch.randint(1, spec.config.vocab_size, (B, P), generator=generator)
    expanded = prompts.repeat_interleave(G, 0)  # (B * G, P)

    def sample(batch: torch.Tensor, num_samples: int) -> Callable[[], object]:
        return lambda: generate(
            model,
            batch,
            max_new_tokens=N,
            temperature=1.0,
            num_samples=num_samples,
            generator=torch.Generator().manual_seed(spec.seed),
        )

    ours, theirs = alternate(sample(prompts, G), sample(expanded, 1), spec.repeats)
    forked = generate(model, prompts, max_new_tokens=N, num_samples=G)
    plain = generate(model, expanded, max_new_tokens=N)
    mismatched = int((forked.generated != plain.generated).any(-1).sum())
    return Comparison(
        name="grpo",
        shape=f"B={B} x G={G}, prompt {P}, {N} new"
        + (", decode compiled (compile_for_decode)" if spec.compile else ", eager"),
        ours="generate(num_samples=G): prefill B, fork",
        theirs="generate on B x G repeated prompts",
        ours_s=ours,
        theirs_s=theirs,
        agree=mismatched == 0,
        detail=f"greedy tokens: {B * G - mismatched}/{B * G} rows equal",
    )


def _per_question_full_passes(
    model: TransformerDecoder, context: list[int], continuations: list[list[int]]
) -> list[float]:
    """The baseline: K rows ``context + continuation``, right-padded, one uncached pass."""
    width = len(context) + max(map(len, continuations))
    rows = torch.zeros((len(continuations), width), dtype=torch.long)  # (K, C + m)
    for i, continuation in enumerate(continuations):
        rows[i, : len(context) + len(continuation)] = torch.tensor(context + continuation)
    with torch.no_grad():
        logprobs = model(rows)[:, len(context) - 1 : -1].float().log_softmax(-1)  # (K, m, v)
    return [
        float(logprobs[i, : len(c)].gather(-1, torch.tensor(c)[:, None]).sum()) for i, c in enumerate(continuations)
    ]


def _scoring(model: TransformerDecoder, spec: WorkloadSpec, generator: torch.Generator) -> Comparison:
    vocab = spec.config.vocab_size
    Q, K, C, m = spec.scoring
    questions = [
        (
            torch.randint(1, vocab, (C,), generator=generator).tolist(),
            torch.randint(1, vocab, (K, m), generator=generator).tolist(),
        )
        for _ in range(Q)
    ]

    def shared() -> list[list[float]]:
        return [[s.logprob for s in score_continuations(model, c, k)] for c, k in questions]

    def full() -> list[list[float]]:
        return [_per_question_full_passes(model, c, k) for c, k in questions]

    ours, theirs = alternate(shared, full, spec.repeats)
    got, expected = torch.tensor(shared()), torch.tensor(full())
    error = float((got - expected).abs().max())
    same_choice = bool((got.argmax(-1) == expected.argmax(-1)).all())
    detail = f"largest score difference {error:.2e}; same choice on every question: {same_choice}"
    if next(model.parameters()).dtype == torch.float32:
        close = torch.allclose(got, expected, rtol=1e-4, atol=1e-4)
    else:  # both against the fp32 model: neither side's kernels are the exact ones
        wide = copy.deepcopy(model).float()
        exact = torch.tensor([_per_question_full_passes(wide, c, k) for c, k in questions])
        ours_error, theirs_error = (float((side - exact).abs().max()) for side in (got, expected))
        close = ours_error <= 2 * theirs_error + 1e-4 and theirs_error <= 2 * ours_error + 1e-4
        detail += f"; from an fp32 copy's scores: ours {ours_error:.2e}, theirs {theirs_error:.2e}"
    return Comparison(
        name="scoring",
        shape=f"{Q} questions x {K} choices, context {C}, continuation {m}",
        ours="score_continuations: context once",
        theirs="K context+continuation rows, one pass",
        ours_s=ours,
        theirs_s=theirs,
        agree=close and same_choice,
        detail=detail,
    )


def run_workloads(spec: WorkloadSpec) -> list[Comparison]:
    """Measures both workloads on one model with random weights."""
    with spec.threads_set():
        (B, G, P, N), (_, _, C, m) = spec.grpo, spec.scoring
        model = spec.model(max(P + N, C + m))
        generator = torch.Generator().manual_seed(spec.seed)
        rows = B * G  # the B x G rows both grpo sides decode: all rewritten
        decoder = compile_for_decode(model, max_rows=rows) if spec.compile else model
        return [_grpo(decoder, spec, generator), _scoring(model, spec, generator)]


def format_workloads(results: list[Comparison], machine: str) -> str:
    """A plain-text table: one line per side, the speedup, and the agreement check."""
    lines = [f"Workloads ({machine}); seconds per workload run, median (min-max)"]
    for r in results:
        lines.append(f"\n{r.name}: {r.shape}")
        for label, stats in ((r.ours, r.ours_s), (r.theirs, r.theirs_s)):
            lines.append(f"  {label:<44} {stats.median:8.3f} s ({stats.min:.3f}-{stats.max:.3f})")
        lines.append(f"  speedup {r.speedup:.2f}x; outputs {'agree' if r.agree else 'DIFFER'}: {r.detail}")
    return "\n".join(lines)
