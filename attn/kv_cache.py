"""A static, preallocated key/value cache for one attention layer.

Shapes: b = batch, h_kv = kv heads, s = new tokens, L = max_seq_len, d = head dim.

The buffers have a fixed shape and the fill position lives in a 0-dim tensor, so a decode
step looks the same to ``torch.compile`` at every position and compiles once. A pass may
attend over the first slots only (``update(span=...)``): eager passes over the filled slots
rounded up (``attended_slots``), ``attn.generate`` over as many as its generation needs.
Buffers are ``persistent=False``: a ``state_dict`` never carries a cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from attn.checks import check_positive_int, is_int

__all__ = ["KVCache", "attended_slots"]

SLOT_STEP = 64
"""Cache lengths (``attn.generate``'s own caches) and attended spans come in multiples of this
many slots, so that a compiled step sees few distinct lengths."""


def attended_slots(needed: int, capacity: int) -> int:
    """The slots a pass attends over when ``needed`` slots are filled after it: ``needed``
    rounded up to a multiple of ``SLOT_STEP``, at most ``capacity``. Attention costs time per
    slot it reads, filled or not; the masked slots past the span are skipped, not read."""
    return min(capacity, -(-needed // SLOT_STEP) * SLOT_STEP)


class KVCache(nn.Module):
    """Keys and values of the tokens seen so far, written in place at the fill position.

    Args:
        batch_size: rows the cache holds; every update must have exactly this many.
        num_kv_heads: key/value heads (h_kv).
        max_seq_len: capacity in tokens (L).
        head_dim: size of each head (d).
        dtype: dtype of the key/value buffers.
        device: where the buffers live.

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
            self.register_buffer("cache_pos", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.chunk_end: int | None = None
        """The fill a prefill chunk under plain inference mode left, while the next chunk may
        continue it; ``None`` once anything else wrote or moved the cache (``attn.policy``)."""

    @property
    def batch_size(self) -> int:
        """Rows the cache holds (b): the buffers' first dim."""
        return self.k_cache.shape[0]

    @property
    def max_seq_len(self) -> int:
        """Capacity in tokens (L): the buffers' third dim. Read from the shape, not kept as a
        number of its own, so a compiled step that marks that dim dynamic
        (``attn.compile_for_decode``) serves caches of every length with one graph."""
        return self.k_cache.shape[2]

    @property
    def size(self) -> int:
        """Tokens written so far (eager only: reads the fill position tensor)."""
        return int(self.cache_pos.item())

    def extra_repr(self) -> str:
        return (
            f"batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
            f"max_seq_len={self.max_seq_len}, head_dim={self.head_dim}, dtype={self.k_cache.dtype}"
        )

    def check_update(self, batch_size: int, seq_len: int, span: int | None = None) -> int | None:
        """Raises, before anything is written, if ``seq_len`` new tokens would not fit, or
        would fall outside the ``span`` slots the pass attends over (default: all of them).

        The shape checks are static and cost nothing under ``torch.compile``. The capacity
        check reads the fill position (one host sync), so it runs in eager code only;
        compiled code relies on the caller (``attn.generate`` checks the whole generation
        up front) and on ``update``'s all-or-nothing write.

        Returns:
            The fill it read, or ``None`` under ``torch.compile``, where it reads nothing.
        """
        self._check_rows(batch_size)
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

    def _check_rows(self, batch_size: int) -> None:
        if self.torn_down:
            raise RuntimeError(
                "this KVCache was torn down (teardown_caches()); call setup_caches() to make a "
                "new one instead of keeping a reference to the old one"
            )
        if batch_size != self.batch_size:
            raise ValueError(
                f"batch size {batch_size} does not match the KV-cache batch size "
                f"{self.batch_size}: call setup_caches(batch_size={batch_size}, ...) or pass "
                f"exactly {self.batch_size} rows"
            )

    def update(
        self, k: torch.Tensor, v: torch.Tensor, *, checked: bool = False, span: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``k`` and ``v`` at the fill position and advances it.

        Args:
            k: new keys, (b, h_kv, s, d).
            v: new values, (b, h_kv, s, d).
            checked: the caller ran ``check_update(b, s)`` for this write already (the
                decoder does, once per forward for all its layers); skips the capacity
                read, a host sync.
            span: the slots the caller attends over (default: all L); they must hold the
                new tokens, which eager code checks.

        Returns:
            The key and value buffers' first ``span`` slots, each (b, h_kv, span, d), views;
            slots at or past the new fill position hold stale data and must be masked.
        """
        b, h_kv, s, d = k.shape
        if k.shape != v.shape or (h_kv, d) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"KVCache.update expects k and v of shape (b, {self.num_kv_heads}, s, "
                f"{self.head_dim}), got k {tuple(k.shape)} and v {tuple(v.shape)}"
            )
        if checked:
            self._check_rows(b)
        else:
            self.check_update(b, s, span)
        slots = self.cache_pos + torch.arange(s, device=k.device)  # (s,)
        # All or nothing, where no capacity error was raised (compiled code cannot raise one):
        # the write's own bounds check refuses an overflow, but it runs element by element as
        # it stores, so the slots that fit would be written first. If any slot is past the
        # end, send every slot there: the first store fails.
        slots = torch.where(slots[-1] < self.max_seq_len, slots, self.max_seq_len)  # (s,)
        self.k_cache.index_copy_(2, slots, k.to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, slots, v.to(self.v_cache.dtype))
        self.cache_pos.add_(s)
        # Compiled code always takes the views: a span == L test there would be one more guard.
        if span is None or (not torch.compiler.is_compiling() and span == self.max_seq_len):
            return self.k_cache, self.v_cache
        return self.k_cache.narrow(2, 0, span), self.v_cache.narrow(2, 0, span)

    def rewind(self, fill: int | torch.Tensor, *, checked: bool = False) -> None:
        """Crops the cache to its first ``fill`` tokens, as if it had never gone past them.

        The slots from ``fill`` on are zeroed, so the cache equals one that was only ever
        filled to ``fill``. The fill position is data, not a shape: a compiled forward
        after a rewind does not recompile. Pass ``fill`` as a 0-dim tensor to keep a
        compiled caller from specializing on its value; eager code checks it (one host read).

        Args:
            fill: tokens to keep, in ``[0, size]``.
            checked: the caller checked ``fill`` against a cache of the same fill already (the
                decoder does, once for all its layers); skips the host read.

        Raises:
            ValueError: ``fill`` is not an integer in ``[0, size]``; the cache is unchanged.
        """
        if isinstance(fill, torch.Tensor):
            if fill.dim() != 0 or fill.dtype.is_floating_point or fill.dtype == torch.bool:
                raise ValueError(
                    f"rewind takes an int or a 0-dim integer tensor, got {fill.dtype} of shape {tuple(fill.shape)}"
                )
        elif not is_int(fill):
            raise ValueError(f"rewind takes an int or a 0-dim integer tensor, got {fill!r}")
        self._check_rows(self.batch_size)
        if not checked and not torch.compiler.is_compiling():
            filled, wanted = self.size, int(fill)
            if not 0 <= wanted <= filled:
                raise ValueError(
                    f"cannot rewind to {wanted}: the cache holds {filled} tokens, so a rewind goes to "
                    f"0..{filled} (reset_caches() empties it)"
                )
        kept = torch.arange(self.max_seq_len, device=self.k_cache.device) < fill  # (L,)
        self.k_cache.masked_fill_(~kept[:, None], 0)
        self.v_cache.masked_fill_(~kept[:, None], 0)
        self.cache_pos.fill_(fill)
        self.chunk_end = None

    def select(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Keeps the cache rows ``rows``, in that order: a row may appear many times (a
        fork) or not at all. The batch size becomes ``len(rows)``.

        The buffers are replaced (their shape changes with the batch), so a compiled
        forward sees a new batch size: one compile per batch size, as for any input.

        Args:
            rows: 1-D row indices in ``[0, batch_size)``.

        Raises:
            ValueError: ``rows`` is empty, not 1-D integers, or out of range; the cache is
                unchanged.
        """
        self.keep(*self.gather(self.row_index(rows)))

    def row_index(self, rows: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``rows`` checked against this cache's batch size (one host read), as a long index
        on its device; raises as ``select`` does. A decoder checks once for every layer."""
        self._check_rows(self.batch_size)
        index = torch.as_tensor(rows, device=self.k_cache.device)
        if index.dim() != 1 or index.numel() == 0 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(f"rows must be a non-empty 1-D sequence of row indices, got {rows!r}")
        low, high = (int(v) for v in torch.stack((index.min(), index.max())).tolist())
        if low < 0 or high >= self.batch_size:
            raise ValueError(
                f"rows must be in [0, {self.batch_size}) (the cache's batch size), got min {low} and max {high}"
            )
        return index.long()

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers ``select(index)`` keeps, as new tensors, the cache
        unchanged: a multi-layer operation gathers every layer's before it keeps any
        (``keep``), so that running out of memory halfway changes no layer."""
        with torch.inference_mode(False):  # fresh buffers are normal tensors, as in __init__
            return self.k_cache[index], self.v_cache[index]

    def keep(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Takes buffers from ``gather`` as the cache's own (cannot fail)."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.chunk_end = None

    def reset(self) -> None:
        """Empties the cache (zeroes the buffers and the fill position), in or out of inference mode."""
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cache_pos.zero_()
        self.chunk_end = None
