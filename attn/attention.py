"""Multi-head attention (MHA, GQA, MQA) with RoPE and a KV-cache that follows the pass.

Shapes: b = batch, s = new tokens, e = embed dim, h = heads, h_kv = kv heads, d = head dim,
L = key slots (s without a cache, the cache's max_seq_len with one).

Each forward pass decides on its own whether to use the cache (``uses_cache``), by the
policy of ``attn.compat``:

- ``INFERENCE``: iff caches are set up, not disabled, grad is off, and the input is an
  inference tensor (the pass runs under ``torch.inference_mode()``);
- ``FLAG``: iff caches are set up and the flag is on (``kv_cache_mode``).

A pass that does not use the cache is plain causal attention and leaves the cache untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn import compat
from attn.compat import CachePolicy
from attn.kv_cache import KVCache
from attn.rope import RotaryEmbedding

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

    Attributes:
        kv_cache: the layer's ``KVCache``, or ``None`` until caches are set up.
        cache_mode: the explicit flag: ``None`` (decide by policy), ``True`` (on), ``False``
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
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False)
        self.rope = RotaryEmbedding(head_dim, max_seq_len, rope_base) if rope is None else rope
        self.kv_cache: KVCache | None = None
        self.cache_mode: bool | None = None

    def setup_cache(
        self, batch_size: int, max_seq_len: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        """Gives the layer a fresh, empty cache (replacing any old one)."""
        if max_seq_len > self.max_seq_len:
            raise ValueError(
                f"cache max_seq_len ({max_seq_len}) exceeds the {self.max_seq_len} positions the "
                "RoPE table covers; build the model with a larger max_seq_len"
            )
        cache = KVCache(batch_size, self.num_kv_heads, max_seq_len, self.head_dim, dtype=dtype, device=device)
        self.teardown_cache()
        self.kv_cache = cache

    def teardown_cache(self) -> None:
        """Drops the cache; a reference kept elsewhere refuses further updates."""
        if self.kv_cache is not None:
            self.kv_cache.torn_down = True
        self.kv_cache = None

    def uses_cache(self, x: torch.Tensor | None = None) -> bool:
        """Would a pass over ``x``, run now, use the cache?

        ``x=None`` asks about a pass that has not started yet (eager only): under the
        ``INFERENCE`` policy it then reads ``torch.is_inference_mode_enabled()``, and it
        never warns. A real pass (``x`` given) under ``FLAG`` that runs in inference mode
        without the flag warns once per process that it did not use the cache.

        Raises:
            RuntimeError: the flag is on and grad is enabled (a cache must never record
                autograd history).
        """
        if self.kv_cache is None or self.cache_mode is False:
            return False
        grad_enabled = torch.is_grad_enabled()
        if self.cache_mode is True and grad_enabled:
            raise RuntimeError(
                "a grad-enabled forward pass ran with the KV-cache flag on (kv_cache_mode / "
                "cached_inference); the cache must never hold autograd history. Run "
                "generation under attn.cached_inference(model) or torch.no_grad(), and "
                "training outside kv_cache_mode."
            )
        if compat.active_policy() is CachePolicy.FLAG:
            if self.cache_mode is None:
                if x is not None and not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
                    compat.warn_inference_mode_ignored()
                return False
            return True
        if grad_enabled:
            return False
        return torch.is_inference_mode_enabled() if x is None else x.is_inference()

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
            mask: bool, True where a query may attend: (b, s, L) or (s, L). Default: causal
                (over cache slots when the cache is used).
            use_cache: the decision, when the caller has already made it for the whole
                model; ``None`` decides here.

        Returns:
            (b, s, e).
        """
        b, s, _ = x.shape
        if use_cache is None:
            use_cache = self.uses_cache(x)
        cache = self.kv_cache if use_cache else None  # update() checks before it writes
        input_pos, mask = default_pos_and_mask(cache, s, x.device, input_pos, mask)
        key_len = cache.max_seq_len if cache is not None else s
        _check_aux(input_pos, mask, b, s, key_len)

        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # (b, h, s, d)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (b, h_kv, s, d)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (b, h_kv, s, d)
        q = self.rope(q, input_pos)
        k = self.rope(k, input_pos)
        if cache is not None:
            k, v = cache.update(k, v)  # each (b, h_kv, L, d)
            q = q.to(k.dtype)
        gqa = self.num_heads != self.num_kv_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            attn_mask = mask.unsqueeze(-3) if mask.dim() == 3 else mask  # (b, 1, s, L) or (s, L)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # (b, s, h * d)
        return self.o_proj(out.to(x.dtype))


def default_pos_and_mask(
    cache: KVCache | None,
    s: int,
    device: torch.device,
    input_pos: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fills in positions and mask the caller left out.

    Without a cache: positions ``arange(s)`` and no mask (SDPA's causal kernel). With one:
    the queries go to slots ``fill .. fill + s - 1``, take those as positions, and attend
    causally over the slots.
    """
    if cache is None:
        return (torch.arange(s, device=device) if input_pos is None else input_pos), mask
    if input_pos is None or mask is None:
        query_slots = cache.cache_pos + torch.arange(s, device=device)  # (s,)
        if input_pos is None:
            input_pos = query_slots
        if mask is None:
            key_slots = torch.arange(cache.max_seq_len, device=device)  # (L,)
            mask = key_slots[None, :] <= query_slots[:, None]  # (s, L)
    return input_pos, mask


def _check_aux(input_pos: torch.Tensor, mask: torch.Tensor | None, b: int, s: int, key_len: int) -> None:
    """Static shape checks for positions and mask (free under torch.compile)."""
    if input_pos.shape not in ((s,), (b, s)):
        raise ValueError(f"input_pos must have shape ({s},) or ({b}, {s}), got {tuple(input_pos.shape)}")
    if input_pos.dtype not in (torch.long, torch.int32):
        raise ValueError(f"input_pos must be an integer tensor (torch.long), got {input_pos.dtype}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = may attend), got {mask.dtype}")
        if mask.shape not in ((s, key_len), (b, s, key_len)):
            where = "the cache's max_seq_len" if key_len != s else "the sequence length"
            raise ValueError(
                f"mask must have shape ({b}, {s}, {key_len}) or ({s}, {key_len}) (last dim: "
                f"{where}), got {tuple(mask.shape)}"
            )
