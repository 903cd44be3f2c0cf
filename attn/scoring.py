"""Shared-context scoring: the log-probabilities of K continuations of one context, with the
context run once.

Shapes: C = context tokens, K = continuations, r = rows a pass (at most K), m = the longest
continuation, v = vocab.

A multiple-choice log-likelihood task scores K continuations of one context; scoring each
in full runs the context K times. Here the context is prefilled once into a one-row cache,
its row is copied r times (``select_caches``), and each chunk of r continuations runs on top
of it, after which the cache is rewound to the context (``rewind_caches``) for the next
chunk. Every chunk has the same shape (a short last chunk is padded with copies), so a
compiled model compiles one graph for the prefill and one for the continuations.

All passes run under ``attn.cached_inference`` (explicit, no inference-mode test; a sharded
model that cannot take inference mode runs under ``torch.no_grad()`` with the flag, as in
``attn.generate``), on caches set up for the call and torn down after: a model's own caches
are never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attn.checks import check_positive_int
from attn.context import cached_passes, local_kv_cache
from attn.masks import id_sequence

__all__ = ["ContinuationScore", "score_continuations"]


@dataclass(frozen=True)
class ContinuationScore:
    """The score of one continuation.

    Attributes:
        logprob: sum of the continuation tokens' log-probabilities given what precedes them.
        greedy: every continuation token was the most likely one (ties: the lowest id).
    """

    logprob: float
    greedy: bool


def score_continuations(
    model: nn.Module,
    context: Sequence[int],
    continuations: Sequence[Sequence[int]],
    *,
    max_rows: int | None = None,
) -> list[ContinuationScore]:
    """Scores each continuation of ``context``, running the context once.

    Args:
        model: a ``TransformerDecoder`` (or a ``torch.compile`` of one) with no caches set up.
        context: the context's token ids (at least one).
        continuations: K lists of token ids (each at least one).
        max_rows: continuations run in one pass at most (memory: a cache of ``max_rows``
            rows of C + m tokens); None: all K at once.

    Returns:
        One ``ContinuationScore`` per continuation, in order. Equal to scoring
        ``context + continuation`` in one uncached pass, up to float rounding (fp32: within
        ``torch.testing.assert_close``'s defaults, tested).

    Raises:
        ValueError: an empty context or continuation, ids out of the vocabulary, a context
            and continuation longer than the model's ``max_seq_len``, or a bad ``max_rows``.
        RuntimeError: the model has caches set up (they would be replaced).

    Example::

        scores = attn.score_continuations(model, tok.encode("Q: 2+2? A:"), [tok.encode(" 4"), tok.encode(" 5")])
        best = max(range(len(scores)), key=lambda i: scores[i].logprob)
    """
    config = model.config
    context = id_sequence(context, "context").tolist()
    continuations = [id_sequence(c, f"continuation {i}").tolist() for i, c in enumerate(continuations)]
    _check(config.vocab_size, config.max_seq_len, context, continuations, max_rows)
    rows = min(len(continuations), max_rows or len(continuations))
    longest = max(map(len, continuations))
    device = model.tok_embeddings.weight.device
    scores: list[ContinuationScore] = []
    with (
        local_kv_cache(model, batch_size=1, max_seq_len=len(context) + longest - 1),
        cached_passes(model),
        model.cache_state.checked_up_front(),  # ids and lengths checked above: no host reads a pass
    ):
        prompt = torch.tensor([context], device=device)  # (1, C)
        first = model(prompt, last_only=True)[0, -1].float().log_softmax(-1)  # (v,)
        model.select_caches([0] * rows)  # the context, r times
        for start in range(0, len(continuations), rows):
            chunk = continuations[start : start + rows]
            scores += _score_chunk(model, first, chunk + chunk[:1] * (rows - len(chunk)), longest)[: len(chunk)]
            model.rewind_caches(len(context))
    return scores


def _score_chunk(
    model: nn.Module, first: torch.Tensor, chunk: list[list[int]], longest: int
) -> list[ContinuationScore]:
    """Scores r continuations on top of a cache that holds the context in each of r rows."""
    r = len(chunk)
    targets = torch.zeros((r, longest), dtype=torch.long)  # (r, m); right-padded with 0
    valid = torch.zeros((r, longest), dtype=torch.bool)  # (r, m)
    for i, continuation in enumerate(chunk):
        targets[i, : len(continuation)] = torch.tensor(continuation)
        valid[i, : len(continuation)] = True
    targets, valid = targets.to(first.device), valid.to(first.device)
    logprobs = first.expand(r, 1, -1)  # (r, 1, v): the context's last position predicts token 0
    if longest > 1:
        # Continuation tokens 0..m-2 predict tokens 1..m-1; right padding comes after every
        # real token, so causal attention keeps it out of the real positions.
        rest = model(targets[:, :-1]).float().log_softmax(-1)  # (r, m - 1, v)
        logprobs = torch.cat((logprobs, rest), dim=1)  # (r, m, v)
    chosen = logprobs.gather(-1, targets[..., None]).squeeze(-1)  # (r, m)
    totals = torch.where(valid, chosen, 0.0).sum(-1)  # (r,)
    greedy = ((logprobs.argmax(-1) == targets) | ~valid).all(-1)  # (r,)
    return [ContinuationScore(float(t), bool(g)) for t, g in zip(totals.tolist(), greedy.tolist(), strict=True)]


def _check(
    vocab_size: int, max_seq_len: int, context: list[int], continuations: list[list[int]], max_rows: int | None
) -> None:
    if not context:
        raise ValueError("context must hold at least one token id (lm-eval puts a prefix token before an empty one)")
    if not continuations or any(not c for c in continuations):
        empty = [i for i, c in enumerate(continuations) if not c]
        raise ValueError(f"continuations must be a non-empty list of non-empty id lists; empty: {empty or 'the list'}")
    check_positive_int(max_rows, "max_rows", or_none=True)
    ids = [t for seq in (context, *continuations) for t in seq]
    bad = sorted({t for t in ids if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {bad[:5]}")
    total = len(context) + max(map(len, continuations)) - 1
    if total > max_seq_len:
        raise ValueError(
            f"the context ({len(context)} tokens) and the longest continuation need {total} positions, "
            f"more than the model's max_seq_len ({max_seq_len}); keep the context's last tokens"
        )
