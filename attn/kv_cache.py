"""Static, preallocated key/value caches: one model's shared state, and each layer's buffers.

Shapes: b = batch, h_kv = kv heads, s = new tokens, L = max_seq_len, d = head dim.

A model's caches share everything but their buffers, and ``CacheState`` holds it once: the
fill position (a 0-dim tensor, so a decode step looks the same to ``torch.compile`` at every
position and compiles once), the batch size, the explicit flag, the thread holding the
caches, and the scoring trap's memory (``chunk_end``). Every layer's ``KVCache`` holds its
key/value buffers and writes the slots the pass plan gives it (``attn.plan``); the model
advances the fill once per pass. A ``KVCache`` built on its own gets a state of its own and
keeps the whole API (``update``, ``rewind``, ``select``, ``reset``) for use outside a model.

A pass may attend over the first slots only: eager passes over the filled slots rounded up
(``attended_slots``), ``attn.generate`` over as many as its generation needs. Buffers are
``persistent=False``: a ``state_dict`` never carries a cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from attn.casts import cast
from attn.checks import check_positive_int, is_int

__all__ = ["CacheState", "KVCache", "attended_slots"]

SLOT_STEP = 64
"""Cache lengths (``attn.generate``'s own caches) and attended spans come in multiples of this
many slots, so that a compiled step sees few distinct lengths."""


def attended_slots(needed: int, capacity: int) -> int:
    """The slots a pass attends over when ``needed`` slots are filled after it: ``needed``
    rounded up to a multiple of ``SLOT_STEP``, at most ``capacity``. Attention costs time per
    slot it reads, filled or not; the masked slots past the span are skipped, not read."""
    return min(capacity, -(-needed // SLOT_STEP) * SLOT_STEP)


def _torn_down() -> RuntimeError:
    return RuntimeError(
        "this KVCache was torn down (teardown_caches()); call setup_caches() to make a "
        "new one instead of keeping a reference to the old one"
    )


class CacheState(nn.Module):
    """What one model's KV-caches share, owned once: by a ``TransformerDecoder`` for all its
    layers, or by an attention layer or a ``KVCache`` used on its own.

    Attributes:
        mode: the explicit flag: ``None`` (decide by the pass), ``True`` (on), ``False``
            (never use the cache). Set it with ``attn.kv_cache_mode``, not by hand.
        holder: the thread inside a block that holds the caches (``attn.threads``), or None.
        caches: the layers' caches, in order; empty until caches are set up.
        chunk_end: the fill a prefill chunk under plain inference mode left, while the next
            chunk may continue it; ``None`` once anything else wrote or moved the cache
            (``attn.policy.inference_mode_decides``).
        prechecked: inside ``checked_up_front()``: eager passes skip the token-id and capacity
            checks, which their caller made once for the whole block.
        shared_slots: ``(group, slots)`` after ``fork_caches``: rows ``b`` hold in their first
            ``slots`` slots the keys and values of row ``b - b % group`` (its copies), so a
            CPU decode reads those once for the group (``PassPlan.shared``: the native
            kernels, parity mode's attention); ``None`` once the rows or the slots below the fill
            change (``keep_rows``, ``restore``, ``reset``, ``detach``). Passes write only from
            the fill on, which never goes below ``slots`` while it is set.
        fill: tokens written so far, a 0-dim long tensor (``size`` reads it).
        slot_ids: ``arange(L)``; its length is the capacity, read from a shape so that a
            compiled step with that dim marked dynamic serves every cache length.
        row_ids: ``arange(b)``; its length is the batch size, a shape for the same reason:
            a compiled forward guards on it as on any input's size (a number kept on the
            module would be guarded by value instead).
    """

    def __init__(self) -> None:
        super().__init__()
        self.mode: bool | None = None
        self.holder: int | None = None
        self.caches: list[KVCache] = []
        self.chunk_end: int | None = None
        self.prechecked = False
        self.shared_slots: tuple[int, int] | None = None
        self.register_buffer("fill", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("slot_ids", torch.zeros(0, dtype=torch.long), persistent=False)
        self.register_buffer("row_ids", torch.zeros(0, dtype=torch.long), persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # A model built on the meta device gets its buffers by to_empty (attn.load_pretrained):
        # without caches, the fill must still read 0.
        super()._apply(fn, recurse)
        if not self.caches:
            with torch.inference_mode(False):
                self.fill = torch.zeros((), dtype=torch.long, device=self.fill.device)
        return self

    def extra_repr(self) -> str:
        return f"layers={len(self.caches)}, batch_size={self.batch_size}, max_seq_len={self.max_seq_len}"

    @property
    def max_seq_len(self) -> int:
        """Capacity in tokens (L); 0 without caches."""
        return self.slot_ids.shape[0]

    @property
    def batch_size(self) -> int:
        """Rows every cached pass must have (b); 0 without caches."""
        return self.row_ids.shape[0]

    @property
    def size(self) -> int:
        """Tokens written so far (eager only: reads the fill position tensor)."""
        return int(self.fill.item())

    def attach(self, caches: list[KVCache]) -> None:
        """Makes ``caches`` (one per layer, same batch, length and device, fresh and empty) the
        model's, tearing down the old ones (cannot fail once the tensors below exist)."""
        buffer = caches[0].k_cache  # (b, h_kv, L, d)
        device = buffer.device
        with torch.inference_mode(False):  # normal tensors, as the buffers: reset works in any mode
            fill = torch.zeros((), dtype=torch.long, device=device)
            slot_ids = torch.arange(buffer.shape[2], device=device)
            row_ids = torch.arange(buffer.shape[0], device=device)
        self.detach()
        self.fill, self.slot_ids, self.row_ids = fill, slot_ids, row_ids
        self.caches = list(caches)

    def detach(self) -> None:
        """Drops the caches; a reference kept elsewhere refuses further use."""
        for cache in self.caches:
            cache.torn_down = True
        self.caches = []
        self.chunk_end = None
        self.shared_slots = None
        self.slot_ids, self.row_ids = self.slot_ids[:0], self.row_ids[:0]
        self.fill.zero_()

    # -- checks, before anything is written ----------------------------------------------

    @contextmanager
    def checked_up_front(self) -> Iterator[None]:
        """The block's passes skip the token-id and capacity checks (a host read each; on a GPU,
        a wait for every queued kernel): for a loop that checked its whole run before it.
        ``attn.generate`` and ``attn.score_continuations`` open it inside the block that holds
        the model (``attn.threads``), so no other thread's pass runs unchecked meanwhile."""
        before = self.prechecked
        self.prechecked = True
        try:
            yield
        finally:
            self.prechecked = before

    def skips_checks(self) -> bool:
        """Does a pass made now skip the host-read checks? Under ``torch.compile`` always (a
        graph reads nothing back; and the flag is never read there, so no guard is put on
        it), in eager code inside ``checked_up_front()``."""
        return torch.compiler.is_compiling() or self.prechecked

    def check_rows(self, batch_size: int) -> None:
        """Raises unless caches are set up and hold ``batch_size`` rows."""
        if not self.caches:
            raise _torn_down()
        if batch_size != self.batch_size:
            raise ValueError(
                f"batch size {batch_size} does not match the KV-cache batch size "
                f"{self.batch_size}: call setup_caches(batch_size={batch_size}, ...) or pass "
                f"exactly {self.batch_size} rows"
            )

    def check_update(self, batch_size: int, seq_len: int, span: int | None = None) -> int | None:
        """Raises, before anything is written, if ``seq_len`` new tokens would not fit, or
        would fall outside the ``span`` slots the pass attends over (default: all of them).

        The shape checks are static and cost nothing under ``torch.compile``. The capacity
        check reads the fill position (one host sync), so it runs in eager code only;
        compiled code relies on the caller (``attn.generate`` checks the whole generation
        up front) and on the all-or-nothing write (``write_slots``).

        Returns:
            The fill it read, or ``None`` under ``torch.compile``, where it reads nothing.
        """
        self.check_rows(batch_size)
        if torch.compiler.is_compiling():
            return None
        if span is not None and not (is_int(span) and 1 <= span <= self.max_seq_len):
            raise ValueError(f"span must be an int in [1, {self.max_seq_len}] (the cache's max_seq_len), got {span!r}")
        filled = self.size
        if filled + seq_len > self.max_seq_len:
            raise RuntimeError(
                f"KV-cache overflow: it holds {filled} tokens, {seq_len} more do not fit in "
                f"its capacity of {self.max_seq_len}; call reset_caches() to start over or "
                "setup_caches() with a larger max_seq_len"
            )
        if span is not None and filled + seq_len > span:
            raise ValueError(
                f"the mask covers the first {span} cache slots, but this pass writes {seq_len} "
                f"tokens after the {filled} the cache holds, up to slot {filled + seq_len - 1}; "
                f"pass a mask over at least {filled + seq_len} slots (at most {self.max_seq_len})"
            )
        return filled

    # -- a pass's write ------------------------------------------------------------------

    def query_slots(self, seq_len: int) -> torch.Tensor:
        """The slots a pass of ``seq_len`` tokens writes: ``fill .. fill + seq_len - 1``, (s,)."""
        return self.fill + torch.arange(seq_len, device=self.fill.device)

    def write_slots(self, query_slots: torch.Tensor) -> torch.Tensor:
        """``query_slots`` (s,) as the layers write them: all or nothing. A write's own bounds
        check runs element by element as it stores, so the slots that fit would be written
        before an overflowing one fails (compiled code cannot raise the capacity error); if
        any slot is past the end, every slot is sent there and the first store fails."""
        return torch.where(query_slots[-1] < self.max_seq_len, query_slots, self.max_seq_len)

    def advance(self, seq_len: int) -> None:
        """Moves the fill past a pass's ``seq_len`` tokens, once all layers wrote them."""
        self.fill.add_(seq_len)

    # -- moving the fill and the rows ----------------------------------------------------

    def rewind(self, fill: int | torch.Tensor) -> None:
        """Crops every cache to its first ``fill`` tokens, as if it had never gone past them.

        The slots from ``fill`` on are zeroed, so each cache equals one that was only ever
        filled to ``fill``. The fill position is data, not a shape: a compiled forward after
        a rewind does not recompile. Eager code checks ``fill`` (one host read), once for
        every layer, before any changes.

        Raises:
            ValueError: ``fill`` is not an integer in ``[0, size]``; nothing is changed.
        """
        if isinstance(fill, torch.Tensor):
            if fill.dim() != 0 or fill.dtype.is_floating_point or fill.dtype == torch.bool:
                raise ValueError(
                    f"rewind takes an int or a 0-dim integer tensor, got {fill.dtype} of shape {tuple(fill.shape)}"
                )
        elif not is_int(fill):
            raise ValueError(f"rewind takes an int or a 0-dim integer tensor, got {fill!r}")
        self.check_rows(self.batch_size)
        if not torch.compiler.is_compiling():
            filled, wanted = self.size, int(fill)
            if not 0 <= wanted <= filled:
                raise ValueError(
                    f"cannot rewind to {wanted}: the cache holds {filled} tokens, so a rewind goes to "
                    f"0..{filled} (reset_caches() empties it)"
                )
        self.restore(fill)

    def restore(self, fill: int | torch.Tensor) -> None:
        """``rewind`` without its checks: zero every cache's slots from ``fill`` on and set the
        fill there. A failed pass restores the fill it copied before it wrote (cannot fail)."""
        kept = self.slot_ids < fill  # (L,)
        for cache in self.caches:
            cache.k_cache.masked_fill_(~kept[:, None], 0)
            cache.v_cache.masked_fill_(~kept[:, None], 0)
        self.fill.fill_(fill)
        self.chunk_end = None
        self.shared_slots = None

    def row_index(self, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``rows`` checked against the batch size (one host read), as a long index on the
        caches' device."""
        self.check_rows(self.batch_size)
        index = torch.as_tensor(rows, device=self.fill.device)
        if index.dim() != 1 or index.numel() == 0 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(f"rows must be a non-empty 1-D sequence of row indices, got {rows!r}")
        low, high = (int(v) for v in torch.stack((index.min(), index.max())).tolist())
        if low < 0 or high >= self.batch_size:
            raise ValueError(
                f"rows must be in [0, {self.batch_size}) (the cache's batch size), got min {low} and max {high}"
            )
        return index.long()

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keeps the rows ``index`` (from ``row_index``) in every cache, in that order. Every
        layer's new buffers are allocated before any layer takes its own: running out of
        memory halfway leaves every layer as it was. The batch size becomes ``len(index)``."""
        buffers = [cache.gather(index) for cache in self.caches]
        with torch.inference_mode(False):
            row_ids = torch.arange(index.shape[0], device=self.row_ids.device)
        for cache, (k, v) in zip(self.caches, buffers, strict=True):
            cache.k_cache, cache.v_cache = k, v
        self.row_ids = row_ids
        self.chunk_end = None
        self.shared_slots = None

    def reset(self) -> None:
        """Empties every cache (zeroes the buffers and the fill), in or out of inference mode."""
        self.check_rows(self.batch_size)
        for cache in self.caches:
            cache.k_cache.zero_()
            cache.v_cache.zero_()
        self.fill.zero_()
        self.chunk_end = None
        self.shared_slots = None

    def share_slots(self, group: int) -> None:
        """Records that rows ``b`` now hold row ``b - b % group``'s keys and values in every
        slot below the fill (``fork_caches`` just copied them there): ``shared_slots``. On
        the CPU only, where the decode kernels read it: there the fill's host read waits for
        nothing; elsewhere it would wait for every queued kernel."""
        self.shared_slots = None
        if group > 1 and self.fill.device.type == "cpu":
            filled = self.size
            self.shared_slots = (group, filled) if filled > 0 else None


class KVCache(nn.Module):
    """One layer's keys and values, written in place at the slots a pass plan gives.

    Args:
        batch_size: rows the cache holds; every update must have exactly this many.
        num_kv_heads: key/value heads (h_kv).
        max_seq_len: capacity in tokens (L).
        head_dim: size of each head (d).
        dtype: dtype of the key/value buffers.
        device: where the buffers live.
        state: the model's ``CacheState`` this cache joins (``TransformerDecoder.setup_caches``
            passes it); ``None`` builds one of its own, for a cache used alone.

    Example::

        cache = KVCache(batch_size=2, num_kv_heads=4, max_seq_len=128, head_dim=64)
        k_all, v_all = cache.update(k, v)  # k, v: (2, 4, s, 64); k_all: (2, 4, 128, 64)
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        state: CacheState | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("max_seq_len", max_seq_len),
            ("head_dim", head_dim),
        ):
            check_positive_int(value, f"KVCache {name}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.torn_down = False
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        # Cache buffers are normal tensors even when created under inference mode: an
        # inference-tensor buffer could not be reset outside inference mode.
        with torch.inference_mode(False):
            self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        if state is None:  # a cache on its own: the model is this one cache
            state = CacheState()
            state.attach([self])
        self.state = state

    # The model-wide facts are its state's: rows (b), capacity (L), the shared fill position (a
    # 0-dim tensor) and the tokens written so far (eager only: reads the fill).
    batch_size = property(lambda self: self.state.batch_size)
    max_seq_len = property(lambda self: self.state.max_seq_len)
    cache_pos = property(lambda self: self.state.fill)
    size = property(lambda self: self.state.size)

    def extra_repr(self) -> str:
        return (
            f"batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
            f"max_seq_len={self.max_seq_len}, head_dim={self.head_dim}, dtype={self.k_cache.dtype}"
        )

    def write(
        self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``k`` and ``v`` (b, h_kv, s, d) at ``slots`` (s,), from the pass plan, and
        returns the buffers' first ``span`` slots, each (b, h_kv, span, d), views: the slots
        at or past the new fill hold stale data and must be masked. Moves no fill."""
        self.k_cache.index_copy_(2, slots, cast(k, self.k_cache.dtype))
        self.v_cache.index_copy_(2, slots, cast(v, self.v_cache.dtype))
        # Compiled code always takes the views: a span == L test there would be one more guard.
        if not torch.compiler.is_compiling() and span == self.max_seq_len:
            return self.k_cache, self.v_cache
        return self.k_cache.narrow(2, 0, span), self.v_cache.narrow(2, 0, span)

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers' rows ``index``, as new tensors; the cache unchanged
        (``CacheState.keep_rows`` gathers every layer's before any layer takes its own)."""
        with torch.inference_mode(False):  # fresh buffers are normal tensors, as at setup
            return self.k_cache[index], self.v_cache[index]

    # -- a cache used on its own: its state's operations -----------------------------------

    def live_state(self) -> CacheState:
        """Its model's state; raises if this cache was torn down (its model may hold new ones)."""
        if self.torn_down:
            raise _torn_down()
        return self.state

    def check_update(self, batch_size: int, seq_len: int, span: int | None = None) -> int | None:
        """``CacheState.check_update`` of its model's state."""
        return self.live_state().check_update(batch_size, seq_len, span)

    def update(self, k: torch.Tensor, v: torch.Tensor, *, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``k`` and ``v`` (b, h_kv, s, d) at the fill position and advances it: the
        whole pass of a cache used alone (in a model, the layers ``write`` and the model
        advances the fill once).

        Args:
            span: the slots the caller attends over (default: all L); they must hold the
                new tokens, which eager code checks.

        Returns:
            The key and value buffers' first ``span`` slots, as ``write`` returns them.
        """
        b, h_kv, s, d = k.shape
        state = self.live_state()
        if k.shape != v.shape or (h_kv, d) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"KVCache.update expects k and v of shape (b, {self.num_kv_heads}, s, "
                f"{self.head_dim}), got k {tuple(k.shape)} and v {tuple(v.shape)}"
            )
        state.check_update(b, s, span)
        slots = state.write_slots(state.query_slots(s))
        out = self.write(slots, k, v, self.max_seq_len if span is None else span)
        state.advance(s)
        return out

    def rewind(self, fill: int | torch.Tensor) -> None:
        """Crops its model's caches to their first ``fill`` tokens (``CacheState.rewind``)."""
        self.live_state().rewind(fill)

    def select(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Keeps the rows ``rows`` of its model's caches, in that order: a row may appear many
        times (a fork) or not at all (``CacheState.keep_rows``). A compiled forward sees a new
        batch size: one compile per batch size, as for any input.

        Raises:
            ValueError: ``rows`` is empty, not 1-D integers, or out of range; nothing changes.
        """
        state = self.live_state()
        state.keep_rows(state.row_index(rows))

    def reset(self) -> None:
        """Empties its model's caches, in or out of inference mode."""
        self.live_state().reset()
