"""The pass plan: how one forward pass is computed, made once and read by every layer.

Shapes: b = batch, s = new tokens, d = head dim, n = key slots a query may see (s without
the cache; the first n cache slots with it).

The plan is where a pass's computation is chosen: positions, masks, RoPE rows, the slots it
writes, and its attention kernel.

An entry point (``TransformerDecoder.forward``, a ``MultiHeadAttention`` used on its own)
decides whether the pass uses the cache (``attn.policy``), then ``plan_pass`` does the rest
once: it checks the caller's positions and mask (and, in eager code outside
``CacheState.checked_up_front()``, the cache's capacity, before anything is written), fills
in the defaults, applies the sliding window, gathers the RoPE rows for the positions and,
with the cache, the slots the layers write. The layers take the plan and only compute; the
entry point advances the model's fill once, after them.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from attn.kv_cache import CacheState, attended_slots
from attn.rope import RotaryEmbedding

__all__ = ["Kernel", "Linears", "PassPlan", "check_pass_inputs", "plan_pass", "positions_and_mask"]

Kernel = Literal["sdpa", "softcap", "exact"]
"""How a pass computes attention: ``sdpa``, torch's fused kernels; ``softcap``, scores
soft-capped before the softmax (Gemma 2: ``attn.attention.softcapped_attention``); ``exact``,
parity mode's float64 scores and sums (``attn.parity.exact_attention``)."""

Linears = Literal["default", "onednn", "packed", "matvec", "native", "widened", "exact"]
"""How a pass computes its linears and activations: ``default``, torch's kernels; ``onednn``,
oneDNN's product on fp32 weights as they are (eager decode steps on AMD CPUs); ``packed``, on weights
pre-packed for oneDNN (the same steps, where the model asks: ``attn.packed``); ``matvec``,
matrix-vector products (eager bf16 decode steps of one row on the CPU); ``native``, attn's
few-row products (eager decode steps on a CPU with AVX2 or AVX-512: ``attn.native.native_product``),
with each run of decoder layers in one call to ``attn::decode_layers`` where the CPU has
AVX512-BF16 and the model's layers are ones it takes (``TransformerDecoder.native_layers``,
``attn.native_step``); ``widened``, bf16 products of many rows in fp32 (passes without
gradients other than decode steps, on a CPU without bf16 arithmetic:
``attn.packed.WIDEN_EACH_CALL_FROM_ROWS``); ``exact``, parity mode's (``attn.parity.ParityKernels``)."""


class PassPlan(NamedTuple):
    """One forward pass, as every layer computes it."""

    rotation: torch.Tensor
    """RoPE cosines and sines at the pass's positions, fp32 (``RotaryEmbedding.rotation``):
    (2, s, d), or (2, b, 1, s, d) for per-row positions."""
    mask: torch.Tensor | None
    """Bool, True where a query may attend: (s, n) or (b, s, n); ``None``: the causal kernel
    (a pass without the cache, no mask given, no window in reach)."""
    slots: torch.Tensor | None
    """(s,) the cache slots the layers write (all or nothing: ``CacheState.write_slots``);
    ``None``: the pass leaves the cache alone."""
    local: PassPlan | None = None
    """The plan of the layers a sliding window applies to, where only some have one (Gemma):
    the same slots, the mask ANDed with the window and, with a RoPE of their own (Gemma 3),
    their rotation. The decoder hands each layer its part; ``None``: one plan for all."""
    kernel: Kernel = "sdpa"
    """The attention kernel every layer runs (``Kernel``): the entry point's choice."""
    linears: Linears = "default"
    """The linear and activation kernels of the pass (``Linears``): the entry point's choice,
    which runs the layers inside them."""
    shared: tuple[int, int] | None = None
    """``(group, slots)``: the cache's rows hold their group's first row's keys and values in
    their first ``slots`` slots (``CacheState.shared_slots``, after a fork), which the kernels
    may read once for the group; ``None``: every row reads its own (no cache, none shared, or
    compiled code, which must not guard on the numbers)."""


def plan_pass(
    state: CacheState,
    use_cache: bool,
    batch_size: int,
    seq_len: int,
    rope: RotaryEmbedding,
    *,
    input_pos: torch.Tensor | None,
    mask: torch.Tensor | None,
    window: int | None,
    local: tuple[int, RotaryEmbedding] | None = None,
    kernel: Kernel = "sdpa",
    linears: Linears = "default",
) -> PassPlan:
    """The plan of a pass of ``seq_len`` new tokens per row over ``batch_size`` rows.

    Args:
        state: the model's cache state.
        use_cache: the entry point's decision (``attn.policy``).
        rope: the rotary table the layers share.
        input_pos: RoPE positions the caller gave, (s,) or (b, s), or None.
        mask: the caller's mask (``TransformerDecoder.forward`` documents it), or None.
        window: the sliding window in slots every layer applies, or None.
        local: the window and RoPE of the layers that have a window where others do not
            (``PassPlan.local``), or None.
        kernel: the attention kernel (``Kernel``).
        linears: the linear kernels (``Linears``).

    Raises:
        ValueError, RuntimeError: bad positions or mask, or tokens that do not fit the
            cache; nothing is written.
    """
    cache = state if use_cache else None
    check_pass_inputs(input_pos, mask, batch_size, seq_len, cache)
    span = None if cache is None or cache.skips_checks() else check_cached_pass(cache, batch_size, seq_len, mask)
    device = rope.cos_sin.device
    query_slots = None if cache is None else cache.query_slots(seq_len)  # (s,)
    input_pos, mask = positions_and_mask(cache, query_slots, seq_len, device, input_pos, mask, window, span)
    slots = None if cache is None else cache.write_slots(query_slots)
    shared = None if cache is None or torch.compiler.is_compiling() else cache.shared_slots
    rotation = rope.rotation(input_pos)
    if local is None:
        return PassPlan(rotation, mask, slots, kernel=kernel, linears=linears, shared=shared)
    local_window, local_rope = local
    _, local_mask = positions_and_mask(cache, query_slots, seq_len, device, input_pos, mask, local_window, span)
    local_rotation = rotation if local_rope is rope else local_rope.rotation(input_pos)
    local_plan = PassPlan(local_rotation, local_mask, slots, kernel=kernel, linears=linears, shared=shared)
    return PassPlan(rotation, mask, slots, local_plan, kernel, linears, shared)


def check_cached_pass(state: CacheState, b: int, s: int, mask: torch.Tensor | None) -> int | None:
    """Raises, before anything is written, if ``s`` new tokens per row do not fit the cache
    or ``mask``'s span (``CacheState.check_update``: one host read, eager only), and returns
    the span a default mask covers: the filled slots rounded up (``attended_slots``); ``None``
    under ``torch.compile``, where nothing is read (a default mask covers every slot)."""
    filled = state.check_update(b, s, None if mask is None else mask.shape[-1])
    return None if filled is None else attended_slots(filled + s, state.max_seq_len)


def positions_and_mask(
    state: CacheState | None,
    query_slots: torch.Tensor | None,
    s: int,
    device: torch.device,
    input_pos: torch.Tensor | None,
    mask: torch.Tensor | None,
    window: int | None = None,
    span: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fills in positions and mask the caller left out, and applies a sliding window.

    Without the cache (``state`` None): positions ``arange(s)`` and no mask (SDPA's causal
    kernel). With it: the queries go to ``query_slots`` (``fill .. fill + s - 1``), take
    those as positions, and attend causally over the first ``span`` slots (default: all of
    them; ``attended_slots`` sizes it). A ``window`` keeps, for the query in slot q, the keys
    in slots ``q - window + 1 .. q`` (slots, not positions: a left-padded row counts its
    padding, as transformers does), ANDed with the given or default mask, over the slots that
    mask covers.
    """
    if state is None or query_slots is None:
        input_pos = torch.arange(s, device=device) if input_pos is None else input_pos
        if window is not None and s > window:  # shorter passes fit the window whole
            slots = torch.arange(s, device=device)  # (s,)
            band = (slots[None, :] <= slots[:, None]) & (slots[None, :] > slots[:, None] - window)  # (s, s)
            mask = band if mask is None else mask & band
        return input_pos, mask
    if input_pos is None or mask is None or window is not None:
        n = mask.shape[-1] if mask is not None else span if span is not None else state.max_seq_len
        key_slots = state.slot_ids[:n]  # (n,)
        if input_pos is None:
            input_pos = query_slots
        if mask is None:
            mask = key_slots[None, :] <= query_slots[:, None]  # (s, n)
        if window is not None and window < n:
            mask = mask & (key_slots[None, :] > query_slots[:, None] - window)  # (s, n) or (b, s, n)
    return input_pos, mask


def _has_shape(t: torch.Tensor, *shapes: tuple[int, ...]) -> bool:
    """Is ``t`` of one of ``shapes``? Compares size by size, which also holds when dynamo
    traces the sizes as symbols (a tuple ``in`` test of symbolic sizes can be wrong there)."""
    return any(t.dim() == len(shape) and all(t.shape[i] == n for i, n in enumerate(shape)) for shape in shapes)


def check_pass_inputs(
    input_pos: torch.Tensor | None, mask: torch.Tensor | None, b: int, s: int, state: CacheState | None
) -> None:
    """Static shape checks for the positions and mask a caller passed (free under torch.compile).

    Without the cache the mask's last dim is ``s``. With it, it counts cache slots from the
    first: any span up to the capacity, which ``CacheState.check_update`` checks covers the
    new tokens.
    """
    if input_pos is not None:
        if not _has_shape(input_pos, (s,), (b, s)):
            raise ValueError(f"input_pos must have shape ({s},) or ({b}, {s}), got {tuple(input_pos.shape)}")
        if input_pos.dtype not in (torch.long, torch.int32):
            raise ValueError(f"input_pos must be an integer tensor (torch.long), got {input_pos.dtype}")
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = may attend), got {mask.dtype}")
    if state is None:
        if not _has_shape(mask, (s, s), (b, s, s)):
            raise ValueError(
                f"mask must have shape ({b}, {s}, {s}) or ({s}, {s}) (last dim: the sequence length, "
                f"for a pass without the cache), got {tuple(mask.shape)}"
            )
        return
    n = mask.shape[-1]
    if not (_has_shape(mask, (s, n), (b, s, n)) and 1 <= n <= state.max_seq_len):
        raise ValueError(
            f"mask must have shape ({b}, {s}, n) or ({s}, n) with n the cache slots it covers, "
            f"from the first, 1 <= n <= {state.max_seq_len} (the cache's max_seq_len), got {tuple(mask.shape)}"
        )
