"""Per-token log-probs of groups of completions, each group's prompt run once: the reference,
old-policy and policy passes of a GRPO step.

Shapes: B = prompts, R = completions in all (the groups' sizes summed; G each for a GRPO
group), P = the longest prompt, N = the longest completion, e = embed dim, v = vocab.

A full forward over R = B x G sequences of prompt + completion runs each prompt G times.
Here every layer runs the B prompts once (left-padded, causal), then the R completions
(right-padded), whose queries attend over their prompt's keys and values, repeated for its
group, and their own. The layout is the full forward's: prompt slots ``0 .. P - 1``, then
completion slots, the same RoPE positions and masks. So the log-probs equal a full
forward's up to float rounding, and bit for bit in parity mode (``attn.parity``), where
neither the rows a product has nor the keys a query sums change a result.

With grad enabled this is the policy's training forward (the gradients flow through the
prompt's keys and values into every completion that reads them); under ``torch.no_grad()``
or ``torch.inference_mode()`` it is the reference or old-policy pass. It never uses or
touches a KV-cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attn.checks import bad_ids, is_int, is_number
from attn.masks import left_pad, padding_positions
from attn.rope import RotaryEmbedding

__all__ = ["CompletionLogprobs", "completion_logprobs"]


@dataclass(frozen=True)
class CompletionLogprobs:
    """What ``completion_logprobs`` returns.

    Attributes:
        logprobs: (R, N) float32, the log-prob of each completion token given its prompt
            and the tokens before it; 0 past a completion's end. Carries grad when the pass did.
        mask: (R, N) bool, True for real completion tokens.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor


def completion_logprobs(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[Sequence[int]]],
    *,
    temperature: float = 1.0,
    width: int | None = None,
) -> CompletionLogprobs:
    """Log-probs of every completion token, each prompt run once for its whole group.

    Args:
        model: a ``TransformerDecoder`` (eager; in parity mode for bitwise equality).
        prompts: B id sequences (ints, numpy ints; lists, arrays or 1-d tensors), any lengths,
            at least one token each.
        completions: B groups; group i holds the completions of prompt i (any number, at
            least one, of any lengths, each at least one token).
        temperature: the log-probs are of ``softmax(logits / temperature)``, as
            ``attn.generate`` reports them for a sampled token (no top-k).
        width: N, the columns of the result: at least the longest completion; None: the
            longest completion. Pass generate's ``max_new_tokens`` to line the result up
            with its ``logprobs``.

    Returns:
        ``CompletionLogprobs`` with R rows, group by group, in order: for ``attn.generate(...,
        num_samples=G)``'s output (``out.groups(G)``), row ``i * G + j`` is sample j of prompt
        i, as there.

    Raises:
        ValueError: empty prompts, groups or completions, ids outside the vocabulary, a
            prompt and completion longer than ``max_seq_len``, a bad temperature or width.

    Example::

        out = attn.generate(policy, prompts, max_new_tokens=64, temperature=1.0, num_samples=G)
        prompts, groups = out.groups(G)
        with torch.no_grad(), adapters_disabled(policy):                  # your LoRA library's switch
            ref = attn.completion_logprobs(policy, prompts, groups, width=64)   # the reference pass
        new = attn.completion_logprobs(policy, prompts, groups, width=64)       # the policy, with grad
        ratio = (new.logprobs - out.logprobs).exp()                       # 1.0 on-policy in parity mode
    """
    config = model.config
    group_sizes = _check(config.vocab_size, config.max_seq_len, prompts, completions, temperature)
    flat = [c for group in completions for c in group]
    longest = max(map(len, flat))
    if width is not None and (not is_int(width) or width < longest):
        raise ValueError(f"width must be an int >= the longest completion ({longest} tokens), got {width!r}")
    device = model.tok_embeddings.weight.device
    prompt_tokens, prompt_valid = left_pad(prompts, 0, device)  # each (B, P)
    completion_tokens, completion_valid = _right_pad(flat, longest, device)  # each (R, N)
    rows_per_prompt = torch.tensor(group_sizes, device=device)  # (B,)
    with model.kernels():
        hidden = _shared_prefix_hidden(model, prompt_tokens, prompt_valid, completion_tokens, rows_per_prompt)
        logits = model.head(hidden)  # (R, N, v)
    logprobs = (logits.float() / temperature).log_softmax(-1)  # (R, N, v)
    chosen = torch.where(completion_valid, logprobs.gather(-1, completion_tokens[..., None]).squeeze(-1), 0.0)
    pad = (width or longest) - longest  # columns past the longest completion: 0, masked out
    return CompletionLogprobs(F.pad(chosen, (0, pad)), F.pad(completion_valid, (0, pad)))


def _shared_prefix_hidden(
    model: nn.Module,
    prompt_tokens: torch.Tensor,
    prompt_valid: torch.Tensor,
    completion_tokens: torch.Tensor,
    rows_per_prompt: torch.Tensor,
) -> torch.Tensor:
    """The final hidden states that predict each completion token: (R, N, e), row r's first
    from its prompt's last position, the rest from its own tokens 0 .. N - 2."""
    P = prompt_tokens.shape[1]
    R, N = completion_tokens.shape
    device = prompt_tokens.device
    prompt_pos = padding_positions(prompt_valid)  # (B, P)
    completion_pos = prompt_valid.sum(-1).repeat_interleave(rows_per_prompt)[:, None] + torch.arange(N, device=device)
    prompt_slots, completion_slots = torch.arange(P, device=device), P + torch.arange(N, device=device)
    keys_valid = torch.cat(
        (prompt_valid.repeat_interleave(rows_per_prompt, 0), torch.ones(R, N, dtype=torch.bool, device=device)), 1
    )  # (R, P + N)

    def plan(window: int | None, rope: RotaryEmbedding) -> tuple[torch.Tensor, ...]:
        """Masks and rotations of the prompts and the completions, once for the layers with ``window``."""
        prompt_mask = _slot_mask(prompt_valid, prompt_slots, prompt_slots, window)  # (B, P, P)
        completion_mask = _slot_mask(keys_valid, completion_slots, torch.arange(P + N, device=device), window)
        return prompt_mask, completion_mask, rope.rotation(prompt_pos), rope.rotation(completion_pos)

    kernel = model.attention_kernel()
    plans = {}  # (window, RoPE) -> (B, P, P), (R, N, P + N), (2, B, 1, P, d), (2, R, 1, N, d)
    prompt_h = model.embed(prompt_tokens)  # (B, P, e)
    completion_h = model.embed(completion_tokens)  # (R, N, e)
    for i, layer in enumerate(model.layers):
        attention = layer.attn
        kind = (model.config.window_of(i), attention.rope)  # Gemma: two kinds of layer
        if kind not in plans:
            plans[kind] = plan(*kind)
        prompt_mask, completion_mask, prompt_rotation, completion_rotation = plans[kind]
        q_p, k_p, v_p = attention.project(
            layer.attn_norm(prompt_h), prompt_rotation
        )  # (B, h, P, d), (B, h_kv, P, d) x2
        q_c, k_c, v_c = attention.project(layer.attn_norm(completion_h), completion_rotation)  # (R, h, N, d), ...
        k = torch.cat((k_p.repeat_interleave(rows_per_prompt, 0), k_c), dim=2)  # (R, h_kv, P + N, d)
        v = torch.cat((v_p.repeat_interleave(rows_per_prompt, 0), v_c), dim=2)  # (R, h_kv, P + N, d)
        prompt_h = layer.add_attention(prompt_h, attention.attend(q_p, k_p, v_p, prompt_mask, prompt_h.dtype, kernel))
        completion_h = layer.add_attention(
            completion_h, attention.attend(q_c, k, v, completion_mask, completion_h.dtype, kernel)
        )
        prompt_h = layer.add_mlp(prompt_h)
        completion_h = layer.add_mlp(completion_h)
    last_prompt = prompt_h[:, -1:].repeat_interleave(rows_per_prompt, 0)  # (R, 1, e): predicts token 0
    return torch.cat((last_prompt, completion_h[:, :-1]), dim=1)  # (R, N, e)


def _slot_mask(
    keys_valid: torch.Tensor, query_slots: torch.Tensor, key_slots: torch.Tensor, window: int | None
) -> torch.Tensor:
    """(b, s, L) bool: a query in slot q attends the valid keys in slots ``<= q`` (and, with a
    sliding window, ``> q - window``), and always its own slot, as ``attn.padded_causal_mask``
    and the decoder's window give a full forward."""
    causal = key_slots[None, :] <= query_slots[:, None]  # (s, L)
    if window is not None:
        causal = causal & (key_slots[None, :] > query_slots[:, None] - window)
    own = key_slots[None, :] == query_slots[:, None]  # (s, L)
    return (causal[None] & keys_valid[:, None, :]) | own[None]  # (b, s, L)


def _right_pad(rows: list[Sequence[int]], longest: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros((len(rows), longest), dtype=torch.long)  # (R, N)
    valid = torch.zeros((len(rows), longest), dtype=torch.bool)  # (R, N)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        valid[i, : len(row)] = True
    return tokens.to(device), valid.to(device)


def _check(
    vocab_size: int,
    max_seq_len: int,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[Sequence[int]]],
    temperature: float,
) -> list[int]:
    """Raises on bad input; returns the group sizes."""
    if not is_number(temperature) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    if len(prompts) == 0 or len(prompts) != len(completions):
        raise ValueError(
            f"completion_logprobs takes one group of completions per prompt: got {len(prompts)} prompts "
            f"and {len(completions)} groups"
        )
    for i, prompt in enumerate(prompts):
        group = completions[i]
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; give every prompt at least one token (a BOS id)")
        if len(group) == 0:
            raise ValueError(f"group {i} holds no completions")
        for j, completion in enumerate(group):
            if len(completion) == 0:
                raise ValueError(f"completion {j} of group {i} is empty")
            ids = [*prompt, *completion]
            bad = bad_ids(ids, vocab_size)
            if bad:
                raise ValueError(f"prompt {i} / completion {j}: ids must be ints in [0, {vocab_size}), got {bad[:5]}")
            if len(prompt) + len(completion) > max_seq_len:
                raise ValueError(
                    f"prompt {i} ({len(prompt)} tokens) and completion {j} ({len(completion)}) exceed the "
                    f"model's max_seq_len ({max_seq_len})"
                )
    return [len(group) for group in completions]
