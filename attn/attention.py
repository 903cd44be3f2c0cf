"""Multi-head attention (MHA, GQA, MQA) with RoPE and a static KV-cache.

Shapes: b = batch, s = new tokens, e = embed dim, h = heads, h_kv = kv heads, d = head dim,
L = key slots (s without a cache, the cache's max_seq_len with one).

Whether a pass uses the cache is decided by ``attn.policy.uses_cache``: once per model
forward by the decoder, which hands the answer down as ``use_cache``, or here for a layer
used on its own. A pass that does not use the cache is plain causal attention and leaves the
cache untouched.

Checkpoint features, each switched by an argument: q/k/v and output biases (Qwen2, Llama's
``attention_bias``), a per-head RMSNorm of queries and keys before RoPE (Qwen3), and a
sliding window over slots (Mistral).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn.kv_cache import KVCache, attended_slots
from attn.norm import RMSNorm
from attn.policy import explicit_decision, inference_mode_decides, uses_cache
from attn.rope import RotaryEmbedding
from attn.threads import check_holder

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Causal self-attention with grouped key/value heads and an optional static cache.

    Args:
        embed_dim: model width (e).
        num_heads: query heads (h).
        num_kv_heads: key/value heads (h_kv); ``num_heads`` for MHA, 1 for MQA, a divisor
            of ``num_heads`` in between for GQA. Defaults to ``num_heads``.
        head_dim: size of each head (d); defaults to ``embed_dim // num_heads``.
        max_seq_len: positions the RoPE table covers, and the largest cache allowed.
        rope_base: the RoPE base.
        rope: a ``RotaryEmbedding`` to share between layers; built here when ``None``.
        qkv_bias: the q/k/v projections have biases.
        out_bias: the output projection has a bias.
        qk_norm_eps: give each head's queries and keys an RMSNorm (weights of size d) with
            this epsilon, applied before RoPE; None: no q/k norm.
        sliding_window: a query attends to the ``sliding_window`` slots ending at its own
            at most; None: to every earlier slot.

    Attributes:
        num_heads, num_kv_heads: the heads this module computes: all of them, or this rank's
            share under tensor parallelism (``attn.distributed.parallelize_tensor`` sets them;
            the cache is sized from them).
        kv_cache: the layer's ``KVCache``, or ``None`` until caches are set up.
        cache_mode: the explicit flag: ``None`` (decide by the pass), ``True`` (on), ``False``
            (never use the cache). Set it with ``attn.kv_cache_mode``, not by hand.
    """

    def __init__(
        self,
        *,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        max_seq_len: int,
        rope_base: float = 10_000.0,
        rope: RotaryEmbedding | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) is not divisible by num_heads ({num_heads}); pass head_dim")
            head_dim = embed_dim // num_heads
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=out_bias)
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps)
        self.rope = RotaryEmbedding(head_dim, max_seq_len, rope_base) if rope is None else rope
        self.kv_cache: KVCache | None = None
        self.cache_mode: bool | None = None
        self.cache_holder: int | None = None  # the thread inside a block that holds the caches (attn.threads)

    def setup_cache(
        self, batch_size: int, max_seq_len: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        """Gives the layer a fresh, empty cache (replacing any old one)."""
        self.take_cache(self.new_cache(batch_size, max_seq_len, dtype=dtype, device=device))

    def new_cache(
        self, batch_size: int, max_seq_len: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> KVCache:
        """A fresh, empty cache sized for this layer, not yet its own (``take_cache``)."""
        if max_seq_len > self.max_seq_len:
            raise ValueError(
                f"cache max_seq_len ({max_seq_len}) exceeds the {self.max_seq_len} positions the "
                "RoPE table covers; build the model with a larger max_seq_len"
            )
        return KVCache(batch_size, self.num_kv_heads, max_seq_len, self.head_dim, dtype=dtype, device=device)

    def take_cache(self, cache: KVCache) -> None:
        """Makes ``cache`` the layer's, tearing down the old one (cannot fail)."""
        self.teardown_cache()
        self.kv_cache = cache

    def teardown_cache(self) -> None:
        """Drops the cache; a reference kept elsewhere refuses further updates."""
        if self.kv_cache is not None:
            self.kv_cache.torn_down = True
        self.kv_cache = None

    def uses_cache(self, x: torch.Tensor | None = None) -> bool:
        """Would a pass over ``x`` (b, s, e), run now, use the cache? (``attn.policy.uses_cache``)

        ``x=None`` asks without running a pass: no warnings.
        """
        if x is None:
            return uses_cache(self.kv_cache, self.cache_mode, 1, warn=False)
        return uses_cache(self.kv_cache, self.cache_mode, x.shape[1])

    def forward(
        self,
        x: torch.Tensor,
        *,
        input_pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> torch.Tensor:
        """Attends over ``x`` (b, s, e), and over the cache when this pass uses it.

        Args:
            x: (b, s, e).
            input_pos: RoPE positions, (s,) or (b, s). Default: ``arange(s)`` without the
                cache, the cache's fill position onwards with it.
            mask: bool, True where a query may attend: (b, s, s) or (s, s) without the
                cache; with it, (b, s, n) or (s, n) over the cache's first n slots, which must
                hold this pass's tokens (the slots past n are not read). Default: causal, over
                the filled slots rounded up (``attended_slots``) in eager code, over every slot
                under ``torch.compile``. The sliding window, if any, is applied on top.
            use_cache: the decision, made by the caller for the whole model, which has
                also checked the cache's capacity; ``None`` decides and checks here.

        Returns:
            (b, s, e).
        """
        b, s, _ = x.shape
        checked = use_cache is not None
        if not checked and not torch.compiler.is_compiling():  # a decoder's layer: the decoder checked
            check_holder(self)
        if use_cache is None:  # attn.policy.uses_cache, its inference-mode test in this frame
            use_cache = explicit_decision(self.kv_cache, self.cache_mode)
            if use_cache is None:
                use_cache = inference_mode_decides(self.kv_cache, s, torch.compiler.is_compiling())
        cache = self.kv_cache if use_cache else None
        check_pass_inputs(input_pos, mask, b, s, cache)
        span = check_cached_pass(cache, b, s, mask) if cache is not None and not checked else None
        input_pos, mask = default_pos_and_mask(cache, s, x.device, input_pos, mask, self.sliding_window, span)

        q, k, v = self.project(x, input_pos)
        if cache is not None:
            k, v = cache.update(k, v, checked=True, span=mask.shape[-1])  # each (b, h_kv, span, d)
            q = q.to(k.dtype)
        return self.attend(q, k, v, mask, x.dtype)

    def project(self, x: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x`` (b, s, e) at RoPE positions ``input_pos``, (s,) or
        (b, s): (b, h, s, d), (b, h_kv, s, d), (b, h_kv, s, d)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)  # (b, s, h, d)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)  # (b, s, h_kv, d)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (b, h_kv, s, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, h, s, d), (b, h_kv, s, d)
        return self.rope(q, input_pos), self.rope(k, input_pos), v

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """``q`` (b, h, s, d) over ``k``, ``v`` (b, h_kv, L, d) under ``mask`` ((b, s, L) or (s,
        L) bool; None: causal, s == L), through the output projection: (b, s, e) in ``dtype``."""
        b, _, s, _ = q.shape
        gqa = self.num_heads != self.num_kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            attn_mask = mask.unsqueeze(-3) if mask.dim() == 3 else mask  # (b, 1, s, L) or (s, L)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # (b, s, h * d)
        return self.o_proj(out.to(dtype))


def check_cached_pass(cache: KVCache, b: int, s: int, mask: torch.Tensor | None) -> int | None:
    """Raises, before anything is written, if ``s`` new tokens per row do not fit ``cache``
    or ``mask``'s span (``KVCache.check_update``: one host read, eager only), and returns the
    span a default mask covers: the filled slots rounded up (``attended_slots``); ``None``
    under ``torch.compile``, where nothing is read (a default mask covers every slot)."""
    filled = cache.check_update(b, s, None if mask is None else mask.shape[-1])
    return None if filled is None else attended_slots(filled + s, cache.max_seq_len)


def default_pos_and_mask(
    cache: KVCache | None,
    s: int,
    device: torch.device,
    input_pos: torch.Tensor | None,
    mask: torch.Tensor | None,
    window: int | None = None,
    span: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fills in positions and mask the caller left out, and applies a sliding window.

    Without a cache: positions ``arange(s)`` and no mask (SDPA's causal kernel). With one:
    the queries go to slots ``fill .. fill + s - 1``, take those as positions, and attend
    causally over the first ``span`` slots (default: all of them; ``attended_slots`` sizes it).
    A ``window`` keeps, for the query in slot q, the keys in slots ``q - window + 1 .. q``
    (slots, not positions: a left-padded row counts its padding, as transformers does), ANDed
    with the given or default mask, over the slots that mask covers.
    """
    if cache is None:
        input_pos = torch.arange(s, device=device) if input_pos is None else input_pos
        if window is not None and s > window:  # shorter passes fit the window whole
            slots = torch.arange(s, device=device)  # (s,)
            band = (slots[None, :] <= slots[:, None]) & (slots[None, :] > slots[:, None] - window)  # (s, s)
            mask = band if mask is None else mask & band
        return input_pos, mask
    if input_pos is None or mask is None or window is not None:
        n = mask.shape[-1] if mask is not None else span if span is not None else cache.max_seq_len
        query_slots = cache.cache_pos + torch.arange(s, device=device)  # (s,)
        key_slots = torch.arange(n, device=device)  # (n,)
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
    input_pos: torch.Tensor | None, mask: torch.Tensor | None, b: int, s: int, cache: KVCache | None
) -> None:
    """Static shape checks for the positions and mask a caller passed (free under torch.compile).

    Without a cache the mask's last dim is ``s``. With one it counts cache slots from the first:
    any span up to the capacity, which ``KVCache.check_update`` checks covers the new tokens.
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
    if cache is None:
        if not _has_shape(mask, (s, s), (b, s, s)):
            raise ValueError(
                f"mask must have shape ({b}, {s}, {s}) or ({s}, {s}) (last dim: the sequence length, "
                f"for a pass without the cache), got {tuple(mask.shape)}"
            )
        return
    n = mask.shape[-1]
    if not (_has_shape(mask, (s, n), (b, s, n)) and 1 <= n <= cache.max_seq_len):
        raise ValueError(
            f"mask must have shape ({b}, {s}, n) or ({s}, n) with n the cache slots it covers, "
            f"from the first, 1 <= n <= {cache.max_seq_len} (the cache's max_seq_len), got {tuple(mask.shape)}"
        )
