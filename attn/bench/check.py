"""Is a contender's answer right? A benchmark of a wrong answer is worthless.

Shapes: b = batch, P = prompt length, N = new tokens, v = vocab.

- fp32: the greedy tokens must equal ``attn`` eager's, exactly.
- bf16 (and fp16): tokens cannot be compared for equality on random weights (exact ties;
  bf16 rounding flips them), so the contender's logits are compared with an fp32 reference
  teacher-forced on the contender's own tokens: at every step, the fp32 model's logits for
  the same prefix must be close, and the token the contender picked must be (nearly) the
  fp32 model's pick too. The tolerances are relative to the spread of the fp32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from attn.context import disable_kv_cache

__all__ = ["LOGIT_MAX_TOL", "LOGIT_MEAN_TOL", "Check", "check_logits", "check_tokens"]

LOGIT_MEAN_TOL = 0.1
"""Mean |logit - fp32 logit|, as a fraction of the fp32 logits' standard deviation."""
LOGIT_MAX_TOL = 0.6
"""Largest |logit - fp32 logit|, as a fraction of the fp32 logits' standard deviation
(measured bf16 error on the benchmark configs: about 0.2-0.3)."""


@dataclass(frozen=True)
class Check:
    """The verdict on one contender's output.

    Attributes:
        ok: the output is right (or, for ``reference``, it is what the others are checked against).
        detail: what was compared and what was found, in words.
    """

    ok: bool
    detail: str


def check_tokens(reference: torch.Tensor, got: torch.Tensor, reference_logits: torch.Tensor | None = None) -> Check:
    """Exact equality of greedy tokens.

    Args:
        reference: (b, N) tokens of the reference (``attn`` eager).
        got: (b, N) tokens of the contender.
        reference_logits: (b, N, v) the reference's logits, to report how close the
            reference's choice was where the two differ.
    """
    if got.shape != reference.shape:
        return Check(False, f"MISMATCH: tokens of shape {tuple(got.shape)}, expected {tuple(reference.shape)}")
    differ = got != reference
    if not differ.any():
        return Check(True, f"identical greedy tokens ({reference.numel()})")
    rows, steps = differ.nonzero(as_tuple=True)
    first = int(steps.argmin())
    row, step = int(rows[first]), int(steps[first])
    detail = (
        f"MISMATCH: {int(differ.sum())} of {reference.numel()} tokens differ; first at row {row}, "
        f"step {step} ({int(got[row, step])} instead of {int(reference[row, step])})"
    )
    if reference_logits is not None:
        logits = reference_logits[row, step].float()
        margin = float(logits[reference[row, step]] - logits[got[row, step]])
        detail += f"; the reference preferred its token by {margin:.3g} logits there"
    return Check(False, detail)


@torch.inference_mode()
def teacher_forced_logits(model: nn.Module, prompts: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
    """(b, N, v) fp32 logits of ``model`` for each generated token's prefix, without a cache."""
    tokens = torch.cat((prompts, generated), dim=1)  # (b, P + N)
    prompt_length = prompts.shape[1]
    with disable_kv_cache(model):
        logits = model(tokens[:, :-1])  # (b, P + N - 1, v)
    return logits[:, prompt_length - 1 :].float()  # (b, N, v)


def check_logits(
    reference_model: nn.Module,
    prompts: torch.Tensor,
    got_tokens: torch.Tensor,
    got_logits: torch.Tensor | None,
    *,
    mean_tol: float = LOGIT_MEAN_TOL,
    max_tol: float = LOGIT_MAX_TOL,
) -> Check:
    """Compares a low-precision contender's logits with an fp32 model on the same prefixes.

    Args:
        reference_model: the fp32 model (an ``attn.TransformerDecoder``).
        prompts: (b, P) prompt tokens (no padding).
        got_tokens: (b, N) the contender's greedy tokens.
        got_logits: (b, N, v) the logits that produced them.
        mean_tol: bound on the mean absolute difference, in fp32-logit standard deviations.
        max_tol: bound on the largest absolute difference, likewise.
    """
    if got_logits is None:
        return Check(False, "MISMATCH: the contender returned no logits to compare")
    expected = teacher_forced_logits(reference_model, prompts, got_tokens)  # (b, N, v)
    if got_logits.shape != expected.shape:
        return Check(False, f"MISMATCH: logits of shape {tuple(got_logits.shape)}, expected {tuple(expected.shape)}")
    scale = float(expected.std())
    error = (got_logits.float() - expected).abs()  # (b, N, v)
    mean_err, max_err = float(error.mean()) / scale, float(error.max()) / scale
    # The pick must be the fp32 model's best, up to the same tolerance: a near-tie may flip.
    picked = expected.gather(-1, got_tokens[..., None]).squeeze(-1)  # (b, N)
    shortfall = float((expected.max(-1).values - picked).max()) / scale
    ok = mean_err <= mean_tol and max_err <= max_tol and shortfall <= max_tol
    detail = (
        f"logits vs fp32 teacher-forced on its tokens: mean |diff| {mean_err:.3f} sd (max {mean_tol}), "
        f"max {max_err:.3f} sd (max {max_tol}); picked tokens within {shortfall:.3f} sd of the fp32 best"
    )
    return Check(ok, detail if ok else "MISMATCH: " + detail)
