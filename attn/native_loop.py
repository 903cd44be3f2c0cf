"""The native decode loop: ``attn.generate``'s decode steps as ``attn::decode_loop`` calls, each
running many steps (sampling, the embedding, every layer, the final norm, the output layer) in C++.

Shapes: b = batch, n = attended slots, N = new tokens, v = vocab.

At batch 1 a native decode step (``attn.native_step``) reads the weights at about the machine's
read bandwidth, and the Python around its kernels was 1.1-1.3 ms of a 10-12 ms step
(SmolLM2-135M shape, bf16, 2 threads, AMD EPYC Zen 4): the forward's checks and plan, the step's
mask, sampling and the loop's bookkeeping, each of their objects cold after the weights stream
through the caches. ``attn::decode_loop`` runs ``CHUNK_STEPS`` steps a call, with the sampler's
ATen calls in its order: the tokens, log-probabilities and generator draws of the Python loop, bit
for bit (tests/test_native_loop.py).

``TransformerDecoder.native_loop`` says when a generation's steps are exactly what the op
computes: every layer in one ``attn::decode_layers`` run with the final norm (``NativeStep``), no
hook on the model, its embedding or output layer, none registered globally, the forward and
the modules' classes attn's own, no embedding scale or logit soft cap, no sliding window inside
the attended slots, and no ``on_tokens`` callback (``attn.generate`` asks). Between calls the
loop checks that nothing it read has changed (``current``, as the native step checks itself
every step): another thread may change the model while the op runs, and a change is then seen
within ``CHUNK_STEPS`` steps; an interrupt (Ctrl-C) is raised after the running call.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from attn.native import amx_from_rows, avx2_layers
from attn.native_step import NativeStep, global_hooks

__all__ = ["CHUNK_STEPS", "NativeLoop"]

CHUNK_STEPS = 16
"""Decode steps a call runs: between calls the loop re-checks the model and Python can raise an
interrupt. A check costs about 0.3 ms at the SmolLM2-135M shape, 0.02 ms a step over 16 steps."""


class NativeLoop:
    """The decode steps of one generation on ``model`` as ``attn::decode_loop`` calls.

    Args:
        model: the decoder (``attn.decoder.TransformerDecoder``), whose ``native_loop`` decided
            its steps are what the op computes.
        step: its current native step (one run, the final norm in it).
        head: the output layer's weight (the embedding where they are tied).
    """

    def __init__(self, model: nn.Module, step: NativeStep, head: torch.Tensor) -> None:
        (run,) = step.runs
        self.model, self.step, self.layers, self.head = model, step, run, head
        self.model_steps = 0  # the model's passes it ran, over every call
        self.stats: Any = None  # a DecodeCompileStats whose native_steps count them (attn.fast_decode)
        self.embedding = model.tok_embeddings.weight
        self.cos_sin = model.rope.cos_sin
        # Read by identity between calls (the layers' objects are the step's own watch).
        self._dicts = [model._modules, model._modules, model.tok_embeddings._parameters, model.rope._buffers]
        self._keys = ["tok_embeddings", "output", "weight", "cos_sin"]
        self._seen = list(map(dict.get, self._dicts, self._keys))
        output = model.output
        self._hooked = [model, model.tok_embeddings] + ([output] if output is not None else [])
        if output is not None:
            self._dicts.append(output._parameters)
            self._keys.append("weight")
            self._seen.append(output._parameters.get("weight"))
        self._sizes = [len(m.__dict__) for m in self._hooked]  # one more with a forward set on an instance

    def current(self) -> bool:
        """Does the loop still compute the model's steps: the native step current, and the
        embedding, output layer and RoPE table the objects it read, no hook added, no forward set
        on the model's, the embedding's or the output layer's instance?"""
        return (
            self.step.current()
            and self.model._native_step is self.step
            and all(map(operator.is_, map(dict.get, self._dicts, self._keys), self._seen))
            and not any(m._forward_hooks or m._forward_pre_hooks for m in self._hooked)
            and [len(m.__dict__) for m in self._hooked] == self._sizes
            and not global_hooks()
        )

    def run(
        self,
        logits: torch.Tensor,
        key_valid: torch.Tensor,
        next_pos: torch.Tensor,
        done: torch.Tensor,
        new_tokens: torch.Tensor,
        new_mask: torch.Tensor,
        logprobs: torch.Tensor,
        all_logits: torch.Tensor | None,
        stop_ids: torch.Tensor,
        pad_id: int,
        temperature: float,
        top_k: int | None,
        generator: torch.Generator | None,
        first_step: int,
    ) -> int | None:
        """Steps ``first_step`` .. ``first_step + CHUNK_STEPS - 1`` (fewer at the end); returns the
        step to run next, or ``None`` when the generation ended (its last token, or every row
        stopped). Every tensor is written in place: ``logits`` (b, v) become the next step's,
        ``next_pos`` (b, 1) and ``done`` (b,) advance, and step i's token, mask, log-probability
        (and logits) go to column i of ``new_tokens``, ``new_mask``, ``logprobs`` (and
        ``all_logits``); the caches and their fill advance a slot a model step."""
        run = self.layers
        last_step = min(first_step + CHUNK_STEPS, new_tokens.shape[1])
        ran = torch.ops.attn.decode_loop(
            logits,
            self.embedding,
            self.head,
            run.weights,
            run.biases,
            [cache._buffers["k_cache"] for cache in run.caches],
            [cache._buffers["v_cache"] for cache in run.caches],
            self.step.final_norm,
            self.step.final_eps,
            run.eps,
            run.scale,
            amx_from_rows(),
            self.cos_sin,
            key_valid,
            next_pos,
            self.model.cache_state.fill,
            done,
            new_tokens,
            new_mask,
            logprobs,
            all_logits,
            stop_ids,
            pad_id,
            temperature,
            0 if top_k is None else top_k,
            generator,
            first_step,
            last_step,
            avx2_layers(),
            *(self.model.cache_state.shared_slots or (1, 0)),  # the rows a fork left equal
        )
        self.model_steps += ran
        if self.stats is not None:
            self.stats.native_steps += ran
        return last_step if ran == last_step - first_step else None
