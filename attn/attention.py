"""Multi-head attention (MHA, GQA, MQA) with RoPE and a static KV-cache.

Shapes: b = batch, s = new tokens, e = embed dim, h = heads, h_kv = kv heads, d = head dim,
L = key slots (s without a cache, the span of cache slots the pass attends over with one).

Inside a ``TransformerDecoder`` a layer only computes: the decoder decides once per forward
whether the pass uses the cache and makes the pass plan (``attn.plan``), and each layer runs
``compute(x, plan)``. Used on its own, the layer is its own entry point: ``forward`` decides
(``attn.policy.uses_cache``), plans and advances its cache's fill. A pass that does not use
the cache is plain causal attention and leaves the cache untouched.

Checkpoint features, each switched by an argument: q/k/v and output biases (Qwen2, Llama's
``attention_bias``), a per-head RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3), a
sliding window over slots (Mistral, Gemma), a score scale other than ``d ** -0.5`` and
soft-capped scores (Gemma 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from attn.casts import cast
from attn.checks import head_shape
from attn.kv_cache import CacheState, KVCache
from attn.norm import RMSNorm
from attn.packed import Linear, cpu_vendor
from attn.parity import exact_attention
from attn.plan import Kernel, PassPlan, plan_pass
from attn.policy import uses_cache
from attn.rope import RotaryEmbedding, rotate_by
from attn.threads import check_holder

__all__ = ["MultiHeadAttention", "softcapped_attention"]

_FOLD_DTYPES = (torch.bfloat16, torch.float16)  # where a decode step's grouped heads run faster folded


def _folds(q: torch.Tensor) -> bool:
    """Does a one-query step hand each group's heads to SDPA as its kv head's queries (one call,
    no GQA)? In bf16 and fp16: CPU SDPA runs it 2-8x faster (b 1-16, 64-2048 slots, AMD EPYC, 2
    threads). In fp32 on Intel CPUs only: SDPA 1.6-1.8x at 16 rows, whole eager steps 3-4%
    (Xeon 6/167, docs/performance.md); on the AMD kind fp32 ran slower folded."""
    if q.dtype in _FOLD_DTYPES:
        return True
    return q.dtype == torch.float32 and q.device.type == "cpu" and cpu_vendor() == "GenuineIntel"


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
        scale: what q.k is multiplied by; None: ``head_dim ** -0.5``.
        softcap: scores pass through ``softcap * tanh(score / softcap)`` before the mask
            and softmax (Gemma 2's ``attn_logit_softcapping``); None: they do not.
        unit_offset_norms: the q/k norms scale by ``1 + weight`` (Gemma: ``attn.norm``).
        cache_state: the model's ``CacheState`` to share (a decoder passes its own); None
            builds one for this layer alone.

    Attributes:
        num_heads, num_kv_heads: the heads this module computes: all of them, or this rank's
            share under tensor parallelism (``attn.distributed.parallelize_tensor`` sets them;
            the cache is sized from them).
        kv_cache: the layer's ``KVCache``, or ``None`` until caches are set up.
        cache_state: the ``CacheState`` of the model it belongs to (fill, flag, holder),
            shared by every layer of a ``TransformerDecoder``; its own when built alone.
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
        scale: float | None = None,
        softcap: float | None = None,
        unit_offset_norms: bool = False,
        cache_state: CacheState | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads, head_dim = head_shape(embed_dim, num_heads, num_kv_heads, head_dim)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        self.sliding_window = sliding_window
        self.scale = scale
        self.softcap = softcap
        self.q_proj = Linear(embed_dim, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(embed_dim, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, embed_dim, bias=out_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=unit_offset_norms)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=unit_offset_norms)
        self.rope = RotaryEmbedding(head_dim, max_seq_len, rope_base) if rope is None else rope
        self.kv_cache: KVCache | None = None
        self.cache_state = CacheState() if cache_state is None else cache_state

    @property
    def cache_mode(self) -> bool | None:
        """The explicit flag of the layer's model, ``cache_state.mode`` (read only: set it with
        ``attn.kv_cache_mode``)."""
        return self.cache_state.mode

    def new_cache(
        self, batch_size: int, max_seq_len: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> KVCache:
        """A fresh, empty cache sized for this layer, in its model's state (not attached yet:
        ``CacheState.attach``)."""
        if max_seq_len > self.max_seq_len:
            raise ValueError(
                f"cache max_seq_len ({max_seq_len}) exceeds the {self.max_seq_len} positions the "
                "RoPE table covers; build the model with a larger max_seq_len"
            )
        return KVCache(
            batch_size,
            self.num_kv_heads,
            max_seq_len,
            self.head_dim,
            dtype=dtype,
            device=device,
            state=self.cache_state,
        )

    def setup_cache(
        self, batch_size: int, max_seq_len: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        """Gives a layer used on its own a fresh, empty cache (replacing any old one)."""
        cache = self.new_cache(batch_size, max_seq_len, dtype=dtype, device=device)
        self.cache_state.attach([cache])
        self.kv_cache = cache

    def teardown_cache(self) -> None:
        """Drops a layer's own cache; a reference kept elsewhere refuses further updates."""
        self.cache_state.detach()
        self.kv_cache = None

    def uses_cache(self, x: torch.Tensor | None = None) -> bool:
        """Would a pass over ``x`` (b, s, e), run now, use the cache? (``attn.policy.uses_cache``)

        ``x=None`` asks without running a pass: no warnings.
        """
        if x is None:
            return uses_cache(self.cache_state, 1, warn=False)
        return uses_cache(self.cache_state, x.shape[1])

    def forward(
        self,
        x: torch.Tensor,
        *,
        input_pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
    ) -> torch.Tensor:
        """Attends over ``x`` (b, s, e), and over the cache when this pass uses it: a layer used
        on its own (a decoder's layers run ``compute`` with the decoder's plan).

        Args:
            x: (b, s, e).
            input_pos: RoPE positions, (s,) or (b, s). Default: ``arange(s)`` without the
                cache, the cache's fill position onwards with it.
            mask: bool, True where a query may attend: (b, s, s) or (s, s) without the
                cache; with it, (b, s, n) or (s, n) over the cache's first n slots, which must
                hold this pass's tokens (the slots past n are not read). Default: causal, over
                the filled slots rounded up (``attended_slots``) in eager code, over every slot
                under ``torch.compile``. The sliding window, if any, is applied on top.
            use_cache: the caller's decision; ``None`` decides here (``attn.policy.uses_cache``).

        Returns:
            (b, s, e).
        """
        b, s, _ = x.shape
        state = self.cache_state
        if not torch.compiler.is_compiling():
            check_holder(state)
        if use_cache is None:
            use_cache = uses_cache(state, s)
        kernel = "sdpa" if self.softcap is None else "softcap"
        plan = plan_pass(
            state, use_cache, b, s, self.rope, input_pos=input_pos, mask=mask, window=self.sliding_window, kernel=kernel
        )
        out = self.compute(x, plan)
        if plan.slots is not None:
            state.advance(s)
        return out

    def compute(self, x: torch.Tensor, plan: PassPlan) -> torch.Tensor:
        """The layer's work in a planned pass: ``x`` (b, s, e) -> (b, s, e); writes this
        layer's keys and values at ``plan.slots`` when the pass uses the cache."""
        q, k, v = self.project(x, plan.rotation)
        if plan.slots is not None and plan.mask is not None:  # a cached pass always has a mask
            k, v = self.kv_cache.write(plan.slots, k, v, span=plan.mask.shape[-1])  # each (b, h_kv, L, d)
            q = cast(q, k.dtype)
        return self.attend(q, k, v, plan.mask, x.dtype, plan.kernel, plan.shared)

    def project(self, x: torch.Tensor, rotation: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x`` (b, s, e), rotated by the plan's ``rotation``
        (``RotaryEmbedding.rotation``): (b, h, s, d), (b, h_kv, s, d), (b, h_kv, s, d)."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)  # (b, s, h, d)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)  # (b, s, h_kv, d)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (b, h_kv, s, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, h, s, d), (b, h_kv, s, d)
        cos, signed_sin = rotation[0], rotation[1]  # each (s, d) or (b, 1, s, d)
        return rotate_by(q, cos, signed_sin), rotate_by(k, cos, signed_sin), v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        dtype: torch.dtype,
        kernel: Kernel,
        shared: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """``q`` (b, h, s, d) over ``k``, ``v`` (b, h_kv, L, d) under ``mask`` ((b, s, L) or (s,
        L) bool; None: causal, s == L) with ``kernel`` (``attn.plan.Kernel``), through the
        output projection: (b, s, e) in ``dtype``. ``shared``: the plan's rows that share
        slots (``PassPlan.shared``), which parity mode's kernel reads once for each group."""
        b, _, s, _ = q.shape
        gqa = self.num_heads != self.num_kv_heads
        attn_mask = None if mask is None else mask.unsqueeze(-3) if mask.dim() == 3 else mask  # (b, 1, s, L) or (s, L)
        if kernel == "softcap":
            out = softcapped_attention(q, k, v, attn_mask, self.scale, self.softcap)
        elif kernel == "exact":
            out = exact_attention(q, k, v, attn_mask, self.scale, shared)
        elif gqa and s == 1 and mask is not None and not torch.compiler.is_compiling() and _folds(q):
            # One query per head: the heads of a group become its kv head's queries (compiled
            # steps have their own kernel).
            grouped = q.reshape(
                b, self.num_kv_heads, self.num_heads // self.num_kv_heads, q.shape[-1]
            )  # (b, h_kv, g, d)
            out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=attn_mask, scale=self.scale)
            out = out.view(q.shape)  # (b, h, 1, d)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # (b, s, h * d)
        return self.o_proj(cast(out, dtype))


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None, softcap: float
) -> torch.Tensor:
    """Attention whose scores are soft-capped, ``softcap * tanh(q.k * scale / softcap)``, before
    the mask and softmax (Gemma 2); SDPA has no such option. Computed as transformers' eager
    Gemma 2 does: scores and cap in ``q``'s dtype, the softmax in fp32.

    Args:
        q: (b, h, s, d).
        k, v: (b, h_kv, L, d), h a multiple of h_kv.
        mask: bool, True where a query may attend, (b, 1, s, L) or (s, L); None: causal (s == L).
        scale: None: ``d ** -0.5``.

    Returns:
        (b, h, s, d) in ``q``'s dtype.
    """
    s, L = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # each (b, h, L, d)
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (b, h, s, L)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones((s, L), dtype=torch.bool, device=q.device).tril()  # (s, L)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v  # (b, h, s, d)
