"""Batched generation with the KV-cache: greedy or sampled, prompts of any lengths.

Shapes: b = batch, P = longest prompt, N = max_new_tokens, L = cache slots, v = vocab.

Prompts are left-padded to P, so every row's next token goes to the same cache slot; each
row keeps its own RoPE positions and a mask hides its padding. Everything runs under
``attn.cached_inference`` (the explicit flag: no inference-mode test, so no graph break in
a compiled model, under every policy), and the
results are cloned out of inference mode: they feed a grad-enabled pass as they are.

Where the model's decode steps are what ``attn::decode_loop`` computes (a CPU with AVX512-BF16
or with AVX2 and no AVX512-BF16, a Llama-style model with no hooks: ``TransformerDecoder.native_loop``),
they run in C++, many a call (``attn.native_loop``), with the same tokens, log-probabilities and
generator draws as the Python loop; ``on_tokens`` keeps the Python loop.

A model sharded with torch.distributed (FSDP2, tensor parallelism) on a release that cannot
run it under inference mode (``attn.context.generation_fallback``) runs under
``torch.no_grad()`` with the same flag instead: the same passes use the cache, the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from attn import native
from attn.checks import bad_ids, check_positive_int, is_int, is_number
from attn.context import cache_holder, cached_passes
from attn.frames import on_fresh_stack
from attn.kv_cache import attended_slots
from attn.masks import left_pad, padding_positions, slot_mask

__all__ = ["GenerationOutput", "generate"]

MIN_TEMPERATURE = 1e-6
"""The lowest sampling temperature: below it, fp32 logits over it overflow (use 0: greedy)."""


@dataclass(frozen=True)
class GenerationOutput:
    """What ``generate`` returns; all ordinary tensors (not inference tensors), also when
    ``generate`` was called under ``torch.inference_mode()``: they feed a grad pass as they are.

    Attributes:
        tokens: (b, P + N) long: each prompt left-padded with ``pad_id``, then the generated
            tokens; ``pad_id`` after a row's stop token.
        padding_mask: (b, P + N) bool, True for real tokens (prompt, and generated tokens up
            to and including the stop token).
        positions: (b, P + N) long RoPE positions of every token, for an uncached re-score:
            ``model(tokens, input_pos=positions, mask=attn.padded_causal_mask(padding_mask))``.
        prompt_length: P, the padded prompt width.
        logprobs: (b, N) float32 log-probability of each generated token under the
            distribution it was drawn from (after temperature and top-k; the model's own
            distribution for greedy); 0 after a row stopped.
        logits: (b, N, v) logits that produced each generated token, when asked for.
    """

    tokens: torch.Tensor
    padding_mask: torch.Tensor
    positions: torch.Tensor
    prompt_length: int
    logprobs: torch.Tensor
    logits: torch.Tensor | None = None

    @property
    def generated(self) -> torch.Tensor:
        """(b, N) the generated tokens alone."""
        return self.tokens[:, self.prompt_length :]

    @property
    def generated_mask(self) -> torch.Tensor:
        """(b, N) bool, True for generated tokens that count (up to and including a stop)."""
        return self.padding_mask[:, self.prompt_length :]

    def groups(self, num_samples: int) -> tuple[list[list[int]], list[list[list[int]]]]:
        """The prompts and their groups of completions, as ``attn.completion_logprobs`` takes
        them: rows ``i * G .. (i + 1) * G - 1`` are G = ``num_samples`` samples of prompt i
        (``generate(..., num_samples=G)``'s layout); each completion up to its stop token.

        Raises:
            ValueError: the rows do not split into groups of ``num_samples``, or a group's
                rows hold different prompts.
        """
        rows = self.tokens.shape[0]
        if not is_int(num_samples) or num_samples <= 0 or rows % num_samples:
            raise ValueError(f"num_samples must be a positive int dividing the {rows} rows, got {num_samples!r}")
        P = self.prompt_length
        prompts = [row[real].tolist() for row, real in zip(self.tokens[:, :P], self.padding_mask[:, :P], strict=True)]
        completions = [row[real].tolist() for row, real in zip(self.generated, self.generated_mask, strict=True)]
        starts = range(0, rows, num_samples)
        for start in starts:
            if any(p != prompts[start] for p in prompts[start : start + num_samples]):
                raise ValueError(
                    f"rows {start}..{start + num_samples - 1} hold different prompts: not one group of "
                    f"{num_samples} samples (generate(..., num_samples={num_samples}) makes such groups)"
                )
        return [prompts[s] for s in starts], [completions[s : s + num_samples] for s in starts]


class _Buffers:
    """The (b, v) tensors sampling writes, made once for a generation and written in place every
    step (``_sample``). Fresh ones each step were freed and faulted back in page by page by
    glibc's allocator: 16 rows of 49,152 logits at temperature 1 made 1,520 page faults a step
    and took 3.8 ms (median of 100), against 1.3 ms with glibc told to keep freed memory and
    none faulted (AMD EPYC, 2 threads)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.scaled = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # (b, v)
        self.probs = torch.empty_like(self.scaled)  # (b, v): probabilities, then log-probabilities
        self.cumulative = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)  # (b, v)


def _sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    buffers: _Buffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Picks one token per row from (b, v) logits; returns ``(tokens, logprobs)``, each (b,).
    ``buffers`` (of the logits' shape): written in place of fresh tensors, with the same values."""
    if buffers is None:
        buffers = _Buffers(logits)
    if logits.dtype == torch.float32 and temperature == 0.0:
        scaled = logits  # read only
    elif logits.dtype == torch.float32:
        scaled = torch.div(logits, temperature, out=buffers.scaled)
    else:  # widened first, then divided in fp32
        scaled = buffers.scaled.copy_(logits)
        if temperature != 0.0:
            scaled.div_(temperature)
    if temperature == 0.0:
        tokens = _first_largest(scaled)  # (b,)
    else:
        if top_k is not None:
            _keep_top_k(scaled, top_k)
        tokens = _draw(torch.softmax(scaled, -1, out=buffers.probs), generator, buffers.cumulative)  # (b,)
    logprobs = torch.log_softmax(scaled, -1, out=buffers.probs)  # (b, v)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # each (b,)


def _first_largest(scaled: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit, the first of equal ones, NaN the largest: max's
    indices (as argmax's, in a third of the time on a CPU: 16 rows of 49,152, 186 against 584 us,
    2 threads), or ``attn::first_argmax``'s, the same indices, on a CPU where attn's native
    kernels are loaded (0.04 against 0.27 ms there, Zen 5). (b, v) fp32 -> (b,)."""
    if scaled.device.type == "cpu" and native.loaded():
        return torch.ops.attn.first_argmax.default(scaled)
    return scaled.max(-1).indices


def _keep_top_k(scaled: torch.Tensor, k: int) -> None:
    """Sets each logit below its row's k-th largest (a NaN ranked above every number, as topk
    ranks it) to -inf, in place: with topk and masked_fill_, or ``attn::keep_top_k``, the same
    values, for k up to ``KEEP_TOP_K_MOST`` on a CPU where attn's native kernels are loaded (16
    rows of 49,152 at k = 50, 2 threads, Zen 5: 0.29 against 1.66 ms). (b, v) fp32, in place."""
    if scaled.device.type == "cpu" and scaled.is_contiguous() and k <= native.KEEP_TOP_K_MOST and native.loaded():
        torch.ops.attn.keep_top_k.default(scaled, k)
        return
    kth = scaled.topk(k, dim=-1).values[:, -1:]  # (b, 1)
    scaled.masked_fill_(scaled < kth, float("-inf"))


def _draw(
    probs: torch.Tensor, generator: torch.Generator | None, cumulative: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of (b, v) probabilities, by inverting the cumulative distribution:
    the first token whose running sum (in fp64) passes a uniform draw, so a token of
    probability 0 is never drawn. On a CPU it is several times faster than
    ``torch.multinomial`` (3 against 20 ms for 16 rows of 32k tokens, one thread).
    ``cumulative``: a (b, v) fp64 tensor to write the running sums into, else a new one."""
    cumulative = _running_sums(probs, cumulative)  # (b, v)
    draw = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator)  # (b, 1)
    tokens = torch.searchsorted(cumulative, draw * cumulative[:, -1:], right=True)  # (b, 1)
    return tokens.clamp_(max=probs.shape[-1] - 1).squeeze(-1)  # (b,)


def _running_sums(probs: torch.Tensor, cumulative: torch.Tensor | None) -> torch.Tensor:
    """Each row's running sums in fp64, into ``cumulative`` (or a new tensor): ``torch.cumsum``'s,
    or ``attn::running_sums``', the same sums bit for bit (the same additions in the same order,
    8 rows' chains at once), on a CPU where attn's native kernels are loaded (16 rows of 49,152,
    2 threads, Zen 5: 0.19 against 0.34 ms). (b, v) fp32 -> (b, v) fp64."""
    fits = cumulative is None or cumulative.is_contiguous()
    if probs.device.type == "cpu" and probs.dim() == 2 and probs.is_contiguous() and fits and native.loaded():
        if cumulative is None:
            cumulative = torch.empty(probs.shape, dtype=torch.float64)
        torch.ops.attn.running_sums.default(probs, cumulative)
        return cumulative
    return torch.cumsum(probs, -1, dtype=torch.float64, out=cumulative)


def _check_arguments(
    vocab_size: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    stop_tokens: Iterable[int] | None,
    pad_id: int,
) -> list[int]:
    check_positive_int(max_new_tokens, "max_new_tokens")
    if not is_number(temperature) or not 0.0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {temperature!r} is below {MIN_TEMPERATURE}: logits divided by it overflow to inf and "
            "the probabilities to NaN; sampling that cold is greedy, pass temperature=0"
        )
    if top_k is not None and not (is_int(top_k) and 0 < top_k <= vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, {vocab_size}], got {top_k!r}")
    if isinstance(stop_tokens, torch.Tensor):
        stop_tokens = stop_tokens.reshape(-1).tolist()
    stops = list(stop_tokens or [])
    bad = bad_ids([*stops, pad_id], vocab_size)
    if bad:
        raise ValueError(f"stop_tokens and pad_id must be ids in [0, {vocab_size}), got {bad}")
    return [int(t) for t in stops]


def generate(
    model: nn.Module,
    prompts: torch.Tensor | Sequence[Sequence[int] | torch.Tensor],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    stop_tokens: Iterable[int] | None = None,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    return_logits: bool = False,
    on_tokens: Callable[[torch.Tensor], None] | None = None,
    num_samples: int = 1,
) -> GenerationOutput:
    """Generates up to ``max_new_tokens`` after each prompt, using the KV-cache.

    If the model has no caches, a cache is set up for the call and torn down after: the
    longest prompt plus ``max_new_tokens`` slots, rounded up to a multiple of
    ``attn.kv_cache.SLOT_STEP`` (at most the model's ``max_seq_len``), so that a compiled model
    (``torch.compile`` with static shapes, ``attn.compile_for_decode``) does not compile again
    for every new length; the slots past a row's tokens are masked. If it has caches, they
    are reset and must fit the batch and the length (a call that fails or is interrupted
    leaves them set up as it found them, rows and capacity, and empty); the passes attend over as many of their
    slots as a cache of its own would hold (``attn.attended_slots``), not over all of them.
    A row stops after it produces any of ``stop_tokens``; the call ends when every row has
    stopped.

    With ``num_samples`` G > 1 each prompt is prefilled once and its cache rows are copied G
    times (``fork_caches``) before G continuations are drawn: the output has b x G rows,
    row ``i * G + j`` the j-th sample of prompt i (what a GRPO group needs), at the cost of
    b prompt prefills instead of b x G.

    On a model sharded across processes (``attn.distributed``) every rank calls it: with
    FSDP2 on its own prompts, with tensor parallelism on the same prompts (and, to sample, a
    ``generator`` seeded alike on every rank).

    Args:
        model: a ``TransformerDecoder`` (or a ``torch.compile`` of one).
        prompts: a list of id sequences (any lengths), or a (b, s) id tensor.
        max_new_tokens: tokens to generate per row at most.
        temperature: 0 for greedy; otherwise softmax temperature for sampling.
        top_k: sample from the k most likely tokens only.
        stop_tokens: ids that end a row (the stop token is kept).
        pad_id: id used for left padding and after a row stopped.
        generator: random generator for sampling, for reproducible draws.
        return_logits: also return the (b, N, v) logits of each step.
        num_samples: continuations per prompt (G); caches set up by the caller must have
            b x G rows.
        on_tokens: called after each step with its (b x G,) new tokens (an inference tensor),
            as they appear in ``generated`` (``pad_id`` for rows that stopped), to stream
            text as it comes. Reading them (``.tolist()``) is a host sync of the callback's
            own; steps that do not run (every row stopped) are not reported. None: no call,
            no sync. A callback keeps every step in the Python loop (``attn.native_loop``
            runs steps in C++ otherwise, where the model's are what it computes).

    Example::

        out = attn.generate(model, [[1, 5, 9], [1, 7]], max_new_tokens=16, stop_tokens=[2])
        loss = -(policy_logprobs(model, out) * advantages).mean()   # out.tokens needs no clone
    """
    config = model.config
    stops = _check_arguments(config.vocab_size, max_new_tokens, temperature, top_k, stop_tokens, pad_id)
    device = model.tok_embeddings.weight.device
    prompt_tokens, prompt_mask = left_pad(prompts, pad_id, device)  # each (b, P)
    b, P = prompt_tokens.shape
    total = P + max_new_tokens
    check_positive_int(num_samples, "num_samples")
    rows = b * num_samples
    if prompt_tokens.min() < 0 or prompt_tokens.max() >= config.vocab_size:
        raise ValueError(
            f"prompt token ids must be in [0, {config.vocab_size}), got min {int(prompt_tokens.min())} "
            f"and max {int(prompt_tokens.max())}"
        )
    with cache_holder(model):  # another thread's call meanwhile raises (attn.threads)
        owns_cache = not model.caches_are_setup()
        if owns_cache:
            if total > config.max_seq_len:
                raise ValueError(
                    f"generate: the longest prompt ({P} tokens) plus max_new_tokens ({max_new_tokens}) "
                    f"is {total}, more than the model's max_seq_len ({config.max_seq_len}); shorten the "
                    "prompts or ask for fewer tokens"
                )
        else:
            cache = model.cache_state
            if cache.batch_size != rows or total > cache.max_seq_len:
                raise ValueError(
                    f"generate: {b} prompts x {num_samples} samples of up to {P} prompt tokens plus max_new_tokens "
                    f"({max_new_tokens}) need a cache of batch_size {rows} and max_seq_len >= {total}, but the "
                    f"model's cache has batch_size {cache.batch_size} and max_seq_len {cache.max_seq_len}; call "
                    f"setup_caches({rows}, {total}) or teardown_caches() to let generate make its own"
                )
        if owns_cache:  # rounded up, so that a compiled model compiles once for similar lengths
            model.setup_caches(b, attended_slots(total, config.max_seq_len))
        try:
            if not owns_cache:
                model.reset_caches()
                if num_samples > 1:
                    model.select_caches(torch.arange(b))  # one row a prompt for the prefill; forked back after it
            steps = on_fresh_stack(  # the decode loop's many Python calls on a frame-stack chunk with room
                _decode,
                model,
                attended_slots(total, model.cache_state.max_seq_len),
                prompt_tokens,
                prompt_mask,
                max_new_tokens,
                temperature,
                top_k,
                stops,
                pad_id,
                generator,
                return_logits,
                on_tokens,
                num_samples,
            )
        except BaseException:  # an error or an interrupt (KeyboardInterrupt) on the caller's caches
            if not owns_cache:
                _restore_rows(model, rows)
            raise
        finally:
            if owns_cache:
                model.teardown_caches()
    new_tokens, new_mask, logprobs, logits = steps  # inference tensors; cloned out below
    with torch.inference_mode(False):  # ordinary tensors, also when the caller is in inference mode
        prompt_tokens, prompt_mask = (t.repeat_interleave(num_samples, 0) for t in (prompt_tokens, prompt_mask))
        tokens = torch.cat((prompt_tokens, new_tokens), dim=1).clone()  # (b * G, P + N)
        padding_mask = torch.cat((prompt_mask, new_mask), dim=1).clone()  # (b * G, P + N)
        return GenerationOutput(
            tokens=tokens,
            padding_mask=padding_mask,
            positions=padding_positions(padding_mask),
            prompt_length=P,
            logprobs=logprobs.clone(),
            logits=None if logits is None else logits.clone(),
        )


def _restore_rows(model: nn.Module, rows: int) -> None:
    """Leaves the caller's caches as generate found them set up (``rows`` rows), empty: a
    failed or interrupted generate never leaves them at the prefill's row count."""
    filled_rows = model.cache_state.batch_size
    if filled_rows != rows:
        model.fork_caches(rows // filled_rows)  # the prefill ran on one row a prompt
    model.reset_caches()


def _decode(
    model: nn.Module,
    num_slots: int,
    prompt_tokens: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    stops: list[int],
    pad_id: int,
    generator: torch.Generator | None,
    return_logits: bool,
    on_tokens: Callable[[torch.Tensor], None] | None,
    num_samples: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Prefill, fork G ways, then one token a step, attending over the caches' first
    ``num_slots`` slots (one mask length for the whole generation: a compiled step compiles
    once); returns (b * G, N) tokens, mask, logprobs, and logits."""
    b, P = prompt_tokens.shape
    device = prompt_tokens.device
    stop_ids = torch.tensor(stops, dtype=torch.long, device=device)
    # Ids and capacity were checked up front: the passes make no host reads of their own.
    with cached_passes(model), model.cache_state.checked_up_front():
        key_valid = torch.ones((b, num_slots), dtype=torch.bool, device=device)  # (b, n)
        key_valid[:, :P] = prompt_mask
        positions = padding_positions(prompt_mask)  # (b, P)
        # The prefill attends over the prompt's slots alone: the n - P slots after them are
        # masked for every prompt query, and a CPU SDPA call pays for each (bf16 and fp32, 16
        # rows, P 128 of n 192: 11.5 against 7.2 ms a layer, AMD EPYC, 2 threads).
        mask = slot_mask(key_valid[:, :P], torch.arange(P, device=device))  # (b, P, P)
        logits = model(prompt_tokens, input_pos=positions, mask=mask, last_only=True)[:, -1]  # (b, v)
        next_pos = positions[:, -1:] + 1  # (b, 1); the last prompt token is never padding
        if num_samples > 1:  # every row from here on is one sample: b becomes b * G
            model.fork_caches(num_samples)
            logits, key_valid, next_pos = (t.repeat_interleave(num_samples, 0) for t in (logits, key_valid, next_pos))
            b = b * num_samples
        new_tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=device)
        new_mask = torch.zeros((b, max_new_tokens), dtype=torch.bool, device=device)
        logprobs = torch.zeros((b, max_new_tokens), dtype=torch.float32, device=device)
        all_logits = None  # (b, N, v): zeros after the last step that ran
        if return_logits:
            all_logits = torch.zeros((b, max_new_tokens, logits.shape[-1]), dtype=torch.float32, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        buffers = _Buffers(logits)  # (b, v) each, written in place every step
        # Steps in C++ where the model's are what attn::decode_loop computes (attn.native_loop);
        # a callback is Python between steps, so it keeps the loop below.
        # The class's method: a torch.compile'd model (whose attributes are its module's) runs its
        # compiled steps, as asked.
        native = getattr(type(model), "native_loop", None)
        loop = native(model, b, num_slots) if native is not None and on_tokens is None else None
        step: int | None = 0
        while step is not None:
            if loop is not None and loop.current():
                logits = logits.contiguous()  # written in place: the next step's
                step = loop.run(
                    logits, key_valid, next_pos, done, new_tokens, new_mask, logprobs, all_logits,
                    stop_ids, pad_id, temperature, top_k, generator, step,
                )  # fmt: skip
                continue
            loop = None  # changed since (a hook, a new weight): this generation's steps run here
            if all_logits is not None:
                all_logits[:, step] = logits
            token, logprob = _sample(logits, temperature, top_k, generator, buffers)  # each (b,)
            token = torch.where(done, pad_id, token)
            new_tokens[:, step] = token
            logprobs[:, step] = torch.where(done, 0.0, logprob)
            new_mask[:, step] = ~done
            done |= torch.isin(token, stop_ids)
            if on_tokens is not None:
                on_tokens(token)
            if step == max_new_tokens - 1 or (stops and bool(done.all())):  # the one host read a step
                break
            slot = torch.tensor([P + step], device=device)  # (1,)
            # A fresh (b, 1) tensor, not a slice of new_tokens: a changing storage offset
            # would make torch.compile recompile the decode step.
            step_mask = slot_mask(key_valid, slot)  # (b, 1, n)
            logits = model(token[:, None], input_pos=next_pos, mask=step_mask)[:, -1]  # (b, v)
            next_pos += 1
            step += 1
    return new_tokens, new_mask, logprobs, all_logits
