"""A Llama-style reference decoder: embedding, RMSNorm, attention, SwiGLU, RoPE, GQA.

Shapes: b = batch, s = sequence, e = embed dim, v = vocab size.

Parameter names follow the Llama layout (``q_proj``, ``gate_proj``, ...), so a checkpoint
maps onto it one tensor at a time. Gemma 2 and 3 are the same decoder with the options
their checkpoints need (``DecoderConfig``: scaled embeddings, ``1 + w`` norms, GeGLU, norms
around each block's outputs, soft-capping, sliding windows on some layers only).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attn.attention import MultiHeadAttention
from attn.checks import check_positive_int, head_shape, is_int, is_number
from attn.huge_pages import huge_page_zeros
from attn.kv_cache import CacheState, KVCache
from attn.native import decode_layers_available, native_product
from attn.native_loop import NativeLoop
from attn.native_step import NativeStep, global_hooks
from attn.norm import RMSNorm
from attn.packed import Linear, bf16_arithmetic, linear, packed_decode_available, packed_linears, plain_onednn_faster
from attn.parity import ParityKernels
from attn.plan import Kernel, Linears, PassPlan, check_cached_pass, check_pass_inputs, plan_pass
from attn.policy import explicit_decision, inference_mode_decides, uses_cache
from attn.regions import compile_region
from attn.rope import RopeScaling, RotaryEmbedding
from attn.threads import check_holder

__all__ = ["DecoderConfig", "TransformerDecoder", "decoder_of"]

_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)  # not a DTensor, not another subclass


def _runs_as_is(module: nn.Module) -> bool:
    """Does ``module`` run its class's ``forward`` alone: no hook on it, and no forward set on the
    instance (accelerate's ``add_hook_to_module``)? A native kernel may then compute it."""
    return not (module._forward_hooks or module._forward_pre_hooks) and "forward" not in module.__dict__


def _plain_module(module: nn.Module, kind: type[nn.Module]) -> bool:
    """Is ``module`` a ``kind`` itself (not a subclass, not peft's wrapper) that runs as is?"""
    return type(module) is kind and _runs_as_is(module)


ACTIVATIONS = ("silu", "gelu_tanh")
"""The MLP gates ``DecoderConfig.activation`` names: SiLU (SwiGLU), tanh-approximated GELU (GeGLU)."""


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a ``TransformerDecoder``; validated on construction.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        embed_dim: model width (e).
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (``None``: same as ``num_heads``).
        head_dim: size of each head (``None``: ``embed_dim // num_heads``).
        hidden_dim: width of the SwiGLU MLP.
        max_seq_len: positions the RoPE table covers; caches can hold at most this many.
        norm_eps: RMSNorm epsilon.
        rope_base: RoPE base (``rope_theta``).
        rope_scaling: how RoPE's frequencies are stretched (Llama 3.1+), or None.
        tie_embeddings: the output projection reuses the token embedding.
        qkv_bias: the q/k/v projections have biases (Qwen2, Llama's ``attention_bias``).
        out_bias: the output projection has a bias (Llama's ``attention_bias``).
        qk_norm: each head's queries and keys go through an RMSNorm before RoPE (Qwen3).
        sliding_window: a query attends to at most this many slots ending at its own
            (Mistral's ``sliding_window``); None: to every earlier slot.
        window_layers: the layers the sliding window applies to (Gemma's sliding layers);
            None: every layer.
        local_rope_base: the RoPE base of the windowed layers, unscaled (Gemma 3's
            ``rope_local_base_freq``); None: they rotate as every other layer.
        embed_scale: token embeddings are multiplied by ``sqrt(embed_dim)``, rounded to
            their dtype (Gemma).
        unit_offset_norms: every RMSNorm scales by ``1 + weight`` in fp32 (Gemma; ``attn.norm``).
        activation: the MLP's gate: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, Gemma).
        sandwich_norms: each block normalizes its attention and MLP outputs before adding
            them back (Gemma 2 and 3).
        attn_scale: what q.k is multiplied by (Gemma: ``query_pre_attn_scalar ** -0.5``);
            None: ``head_dim ** -0.5``.
        attn_softcap: attention scores pass through ``c * tanh(score / c)`` (Gemma 2).
        logit_softcap: the output logits pass through ``c * tanh(logit / c)`` (Gemma 2).
    """

    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    hidden_dim: int
    max_seq_len: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    norm_eps: float = 1e-5
    rope_base: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    window_layers: tuple[int, ...] | None = None
    local_rope_base: float | None = None
    embed_scale: bool = False
    unit_offset_norms: bool = False
    activation: str = "silu"
    sandwich_norms: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "hidden_dim", "max_seq_len"):
            check_positive_int(getattr(self, name), f"DecoderConfig.{name}")
        num_kv_heads, head_dim = head_shape(self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim)
        object.__setattr__(self, "num_kv_heads", num_kv_heads)
        object.__setattr__(self, "head_dim", head_dim)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), got {self.head_dim}")
        for name in ("norm_eps", "rope_base"):
            value = getattr(self, name)
            if not is_number(value) or not 0 < value < math.inf:
                raise ValueError(f"DecoderConfig.{name} must be a finite positive number, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"DecoderConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        check_positive_int(self.sliding_window, "DecoderConfig.sliding_window", or_none=True)
        for name in ("local_rope_base", "attn_scale", "attn_softcap", "logit_softcap"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or not 0 < value < math.inf):
                raise ValueError(f"DecoderConfig.{name} must be a finite positive number or None, got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"DecoderConfig.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.window_layers is not None or self.local_rope_base is not None:
            self._check_window_layers()

    def _check_window_layers(self) -> None:
        if self.sliding_window is None:
            raise ValueError(
                f"DecoderConfig.window_layers ({self.window_layers!r}) and local_rope_base ({self.local_rope_base!r}) "
                "describe windowed layers, but sliding_window is None; set sliding_window or leave both None"
            )
        if self.window_layers is None:
            return
        layers = self.window_layers
        if not (
            isinstance(layers, tuple)
            and all(is_int(i) and 0 <= i < self.num_layers for i in layers)
            and list(layers) == sorted(set(layers))
        ):
            raise ValueError(
                f"DecoderConfig.window_layers must be a tuple of distinct layer indices in increasing order, each "
                f"in [0, {self.num_layers}), got {layers!r}"
            )

    def window_of(self, layer: int) -> int | None:
        """The sliding window layer ``layer`` applies, or None."""
        if self.window_layers is None or layer in self.window_layers:
            return self.sliding_window
        return None


class FeedForward(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, SwiGLU with ``silu``, GeGLU with ``gelu_tanh``."""

    def __init__(self, embed_dim: int, hidden_dim: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(embed_dim, hidden_dim, bias=False)
        self.up_proj = Linear(embed_dim, hidden_dim, bias=False)
        self.down_proj = Linear(hidden_dim, embed_dim, bias=False)
        self.activation = activation  # a name, not a function: the module pickles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with sandwich norms
    (Gemma) each output is normalized once more before it is added back."""

    def __init__(self, config: DecoderConfig, index: int, rope: RotaryEmbedding, cache_state: CacheState) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(config.embed_dim, config.norm_eps, unit_offset=config.unit_offset_norms)

        self.attn_norm = norm()
        self.attn = MultiHeadAttention(
            embed_dim=config.embed_dim,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_seq_len=config.max_seq_len,
            rope=rope,
            qkv_bias=config.qkv_bias,
            out_bias=config.out_bias,
            qk_norm_eps=config.norm_eps if config.qk_norm else None,
            sliding_window=config.window_of(index),
            scale=config.attn_scale,
            softcap=config.attn_softcap,
            unit_offset_norms=config.unit_offset_norms,
            cache_state=cache_state,
        )
        self.attn_out_norm = norm() if config.sandwich_norms else None
        self.mlp_norm = norm()
        self.mlp = FeedForward(config.embed_dim, config.hidden_dim, config.activation)
        self.mlp_out_norm = norm() if config.sandwich_norms else None

    @compile_region  # attn.compile_for_decode compiles one layer for all of them
    def forward(self, x: torch.Tensor, plan: PassPlan) -> torch.Tensor:
        """``x`` (b, s, e) -> (b, s, e), computed as ``plan`` says (``attn.plan``)."""
        return self.add_mlp(self.add_attention(x, self.attn.compute(self.attn_norm(x), plan)))

    def native_modules(self) -> tuple[tuple[nn.Module, ...], tuple[nn.Module, ...]]:
        """The modules ``native_parts`` reads: ``(containers, leaves)``, the containers the layer,
        its attention and its MLP, the leaves its norms (attn_norm, mlp_norm, and q_norm,
        k_norm where it has them) then its seven projections (q, k, v, o, gate, up, down)."""
        attention, mlp = self._modules["attn"], self._modules["mlp"]
        inner, outer = attention._modules, mlp._modules
        norms = (self._modules["attn_norm"], self._modules["mlp_norm"])
        if inner.get("q_norm") is not None:  # Qwen3: each head's queries and keys
            norms += (inner["q_norm"], inner["k_norm"])
        projections = (
            inner["q_proj"], inner["k_proj"], inner["v_proj"], inner["o_proj"],
            outer["gate_proj"], outer["up_proj"], outer["down_proj"],
        )  # fmt: skip
        return (self, attention, mlp), norms + projections

    def native_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None], float] | None:
        """The weights (norm, q, k, v, o, norm, gate, up, down, and the q and k norms where the
        layer has them), biases (q, k, v, o) and norm epsilon ``attn::decode_layers`` takes for
        this layer; ``None`` where the layer is not the plain one it computes: a hook on one of
        its modules (FSDP2's) or a forward set on one's instance (accelerate's), a projection
        that is not attn's ``Linear`` (peft's LoRA layers), a weight that is not a plain
        contiguous tensor (a DTensor, a parametrization), norms of two epsilons or Gemma's
        ``1 + w``, a biased MLP. ``attn.native_step.NativeStep`` asks
        once, and again after any change to what ``native_modules`` names."""
        containers, leaves = self.native_modules()
        norms, projections = leaves[:-7], leaves[-7:]
        if not all(map(_runs_as_is, containers + leaves)):
            return None
        for projection in projections:
            if type(projection) is not Linear:
                return None
        for norm in norms:
            if type(norm) is not RMSNorm or norm.unit_offset or norm.eps != norms[0].eps:
                return None
        weights = [norms[0]._parameters.get("weight")]
        weights += [p._parameters.get("weight") for p in projections[:4]]
        weights.append(norms[1]._parameters.get("weight"))
        weights += [p._parameters.get("weight") for p in projections[4:]]
        weights += [norm._parameters.get("weight") for norm in norms[2:]]
        for weight in weights:
            if type(weight) not in _PLAIN_TENSORS or not weight.is_contiguous():
                return None
        biases = [p._parameters.get("bias") for p in projections]
        if biases[4] is not None or biases[5] is not None or biases[6] is not None:
            return None
        return weights, biases[:4], norms[0].eps

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream ``x`` (b, s, e) plus the attention's output (b, s, e)."""
        return x + (attended if self.attn_out_norm is None else self.attn_out_norm(attended))

    def add_mlp(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (b, s, e) plus the MLP of its norm: the block's second half."""
        out = self.mlp(self.mlp_norm(x))
        return x + (out if self.mlp_out_norm is None else self.mlp_out_norm(out))


class TransformerDecoder(nn.Module):
    """A Llama-style decoder whose KV-caches follow the kind of forward pass.

    Example::

        model = TransformerDecoder(DecoderConfig(vocab_size=100, embed_dim=64, num_layers=2,
                                                 num_heads=4, num_kv_heads=2, hidden_dim=128,
                                                 max_seq_len=256))
        model.setup_caches(batch_size=1, max_seq_len=64)
        with attn.cached_inference(model):
            logits = model(prompt)                     # prefill, writes the cache
            logits = model(logits[:, -1:].argmax(-1))  # decode, continues where it stopped
        loss = model(batch).logsumexp(-1).mean()       # training: cache untouched
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.embed_dim)
        self.rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_base, config.rope_scaling)
        self.local_rope = None  # the windowed layers' RoPE, where it differs (Gemma 3)
        if config.local_rope_base is not None:
            self.local_rope = RotaryEmbedding(config.head_dim, config.max_seq_len, config.local_rope_base)
        self.cache_state = CacheState()  # the fill, flag and holder of every layer's cache
        windowed_rope = self.local_rope or self.rope
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, windowed_rope if config.window_of(i) else self.rope, self.cache_state)
            for i in range(config.num_layers)
        )
        # Where the windowed layers differ from the rest (Gemma: some layers only, or a RoPE of
        # their own), they run the plan's `local` part.
        split = config.window_layers is not None or config.local_rope_base is not None
        self.local_layers = tuple(split and config.window_of(i) is not None for i in range(config.num_layers))
        # What plan_pass is told, once: the window every layer applies, or the local part's.
        local = any(self.local_layers)
        self._plan_window = None if local else config.sliding_window
        self._plan_local = (config.sliding_window, windowed_rope) if local else None
        self.norm = RMSNorm(config.embed_dim, config.norm_eps, unit_offset=config.unit_offset_norms)
        self.output = None if config.tie_embeddings else Linear(config.embed_dim, config.vocab_size, bias=False)
        # The layers attn::decode_layers computes: Llama's, with Qwen2's biases, Qwen3's q/k norms and
        # Mistral's windows; none of Gemma's options; widths its vectors take whole.
        self._native_config = (
            not (config.sandwich_norms or config.unit_offset_norms or config.attn_softcap)
            and config.activation == "silu"
            and config.head_dim % 16 == 0
            and config.head_dim <= 512
            and config.embed_dim % 16 == 0
            and config.hidden_dim % 16 == 0
        )
        self._native_step: NativeStep | None = None  # built on the first native decode step (_logits)
        self.parity = False  # parity mode (attn.parity): set it with attn.set_parity_mode
        self.packed_decode = False  # packed decode (attn.packed): set it with attn.set_packed_decode

    # -- caches ------------------------------------------------------------------------

    def _attention(self) -> list[MultiHeadAttention]:
        return [layer.attn for layer in self.layers]

    def setup_caches(
        self,
        batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        huge_pages: bool = True,
    ) -> None:
        """Gives every layer a fresh, empty static cache, replacing any old one.

        Args:
            batch_size: rows each forward that uses the cache must have.
            max_seq_len: tokens the cache holds; at most ``config.max_seq_len``.
            dtype: cache dtype (default: the model's parameter dtype).
            device: cache device (default: the model's parameter device).
            huge_pages: on the CPU, put every layer's keys and values in one mapping backed by
                transparent huge pages (``attn.huge_pages.huge_page_zeros``), where the system
                offers them and the caches take at least one (2 MiB): a decode step reads them
                from 4 KiB pages more slowly (``docs/performance.md``). ``False``: ordinary
                tensors.
        """
        check_positive_int(batch_size, "setup_caches batch_size")
        check_positive_int(max_seq_len, "setup_caches max_seq_len")
        if max_seq_len > self.config.max_seq_len:
            raise ValueError(
                f"setup_caches max_seq_len ({max_seq_len}) exceeds the model's max_seq_len "
                f"({self.config.max_seq_len}, the positions its RoPE table covers); use at most "
                f"{self.config.max_seq_len} or build the model with a larger DecoderConfig.max_seq_len"
            )
        check_holder(self.cache_state)
        weight = self.tok_embeddings.weight
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"setup_caches dtype {dtype!r} cannot hold keys and values; pass a floating dtype "
                f"(None: the model's, {weight.dtype})"
            )
        layers = self._attention()
        dtype, device = dtype or weight.dtype, device or weight.device
        caches = self._new_caches(layers, batch_size, max_seq_len, dtype, torch.device(device), huge_pages)
        self.cache_state.attach(caches)  # allocated all, then replace: no layer is left half set up
        self._native_step = None  # it holds the old caches' modules
        for attention, cache in zip(layers, caches, strict=True):
            attention.kv_cache = cache

    @staticmethod
    def _new_caches(
        layers: list[MultiHeadAttention],
        batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device,
        huge_pages: bool,
    ) -> list[KVCache]:
        """A fresh cache per layer; on the CPU with ``huge_pages``, their buffers in one
        huge-page mapping where there is one (built on the meta device first: never allocated
        twice)."""
        if huge_pages and device.type == "cpu":
            caches = [a.new_cache(batch_size, max_seq_len, dtype=dtype, device="meta") for a in layers]
            shapes = [(cache.k_cache.shape, dtype) for cache in caches for _ in range(2)]  # k, v of each layer in turn
            zeros = huge_page_zeros(shapes, "setup_caches")
            if zeros is not None:
                for cache, k, v in zip(caches, zeros[0::2], zeros[1::2], strict=True):
                    cache.k_cache, cache.v_cache = k, v
                return caches
        return [a.new_cache(batch_size, max_seq_len, dtype=dtype, device=device) for a in layers]

    def caches_are_setup(self) -> bool:
        """Do the layers have KV-caches?"""
        return bool(self.cache_state.caches)

    def caches_are_enabled(self) -> bool:
        """Would a forward pass started now, in the current grad/inference mode and flags, use the cache?

        Returns ``False`` for a grad-enabled pass with the flag on: that pass raises.
        """
        try:
            return uses_cache(self.cache_state, 1, warn=False)
        except RuntimeError:
            return False

    def uses_cache(self, num_tokens: int) -> bool:
        """Will a forward pass of ``num_tokens`` tokens per row, run now, use the cache?

        The decision ``forward`` makes (``attn.policy.uses_cache``). A caller that runs the
        model compiled with ``fullgraph=True`` can make it in eager code and pass it on:
        ``model(tokens, use_cache=model.uses_cache(s))``.

        Raises:
            RuntimeError: the flag is on and grad is enabled.
        """
        return uses_cache(self.cache_state, num_tokens)

    def check_cache_capacity(self, batch_size: int, num_tokens: int, mask: torch.Tensor | None = None) -> int | None:
        """Raises, before anything is written, if ``num_tokens`` more tokens per row do not
        fit the caches or the slots ``mask`` covers, or ``batch_size`` rows do not match them
        (one host read, eager only). Returns the slots a default mask covers then
        (``attn.attended_slots`` of the fill after the pass); ``None`` under ``torch.compile``."""
        state = self._state_or_raise()
        check_pass_inputs(None, mask, batch_size, num_tokens, state)
        return check_cached_pass(state, batch_size, num_tokens, mask)

    def reset_caches(self) -> None:
        """Empties every cache (keeps them set up); works in and out of inference mode."""
        self._state_or_raise().reset()

    def rewind_caches(self, fill: int | torch.Tensor) -> None:
        """Crops every cache to its first ``fill`` tokens, as if the model had never run past
        them (``CacheState.rewind``): roll back a rejected draft, or score another continuation
        of a prefilled context. Checked once, before any layer changes."""
        self._state_or_raise().rewind(fill)

    def select_caches(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Keeps the cache rows ``rows`` in every layer (``CacheState.keep_rows``): drop finished
        rows, reorder them, or copy one prompt's rows. Checked once, and every layer's new
        buffers allocated, before any layer changes."""
        state = self._state_or_raise()
        state.keep_rows(state.row_index(rows))

    def fork_caches(self, num_copies: int) -> None:
        """Repeats every cache row ``num_copies`` times in place, row i becoming rows
        ``i * num_copies .. (i + 1) * num_copies - 1``: prefill each prompt once, then sample
        ``num_copies`` continuations of it (``attn.generate(..., num_samples=)`` does). Every
        layer's new buffers are allocated before any layer changes. The copies' slots are
        recorded as shared (``CacheState.shared_slots``): the native decode reads them once for
        each group of ``num_copies`` rows."""
        check_positive_int(num_copies, "num_copies")
        state = self._state_or_raise()
        state.keep_rows(torch.arange(state.batch_size, device=state.fill.device).repeat_interleave(num_copies))
        state.share_slots(num_copies)

    def _state_or_raise(self) -> CacheState:
        check_holder(self.cache_state)
        if not self.caches_are_setup():
            raise RuntimeError("caches are not set up: call setup_caches() first")
        return self.cache_state

    def teardown_caches(self) -> None:
        """Removes the caches; forward passes run plain causal attention afterwards."""
        check_holder(self.cache_state)
        self.cache_state.detach()
        self._native_step = None  # it holds the caches' modules
        for attention in self._attention():
            attention.kv_cache = None

    def kv_caches(self) -> list[KVCache]:
        """The layers' caches, in order (empty when none are set up)."""
        return list(self.cache_state.caches)

    def first_kv_cache(self) -> KVCache | None:
        """Deprecated: the model's batch size, length and fill are ``cache_state``'s."""
        warnings.warn(
            "TransformerDecoder.first_kv_cache() is deprecated: read model.cache_state (batch_size, "
            "max_seq_len, size) or model.kv_caches()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.cache_state.caches[0] if self.cache_state.caches else None

    # -- forward -----------------------------------------------------------------------

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        input_pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        last_only: bool = False,
        use_cache: bool | None = None,
        checked: bool | None = None,
    ) -> torch.Tensor:
        """Logits for every position of ``tokens``, or for the last one.

        Args:
            tokens: (b, s) integer token ids in ``[0, vocab_size)``.
            input_pos: RoPE positions, (s,) or (b, s); default ``arange(s)``, or from the
                cache's fill position onwards when the pass uses the cache.
            mask: bool, True where a query may attend; (b, s, s) without the cache, (b, s,
                n) over the cache's first n slots with it (n up to max_seq_len; they must hold
                this pass's tokens, and the slots past them are not read). Default: causal,
                over the filled slots rounded up (``attn.attended_slots``) in eager code and
                over every slot in code that ``torch.compile`` traces, which reads no fill
                (``attn.compile_for_decode`` passes the eager default). See
                ``attn.padded_causal_mask`` for left-padded batches.
            last_only: compute logits for the last position only (a prompt's prefill needs
                no more): skips the output layer for the other positions and never holds a
                (b, s, v) tensor.
            use_cache: the decision, made by the caller with ``self.uses_cache(s)`` (for a
                ``fullgraph`` compile); ``None`` (the default) decides here.
            checked: deprecated: a loop that checked its ids and capacity up front runs its
                passes in ``with model.cache_state.checked_up_front():`` (``attn.generate``
                does), which skips the host reads those checks cost.

        Returns:
            (b, s, v) logits, in the model's dtype; (b, 1, v) with ``last_only``.
        """
        if checked is not None:
            _warn_checked("TransformerDecoder.forward")
            if checked:
                with self.cache_state.checked_up_front():
                    return self(tokens, input_pos=input_pos, mask=mask, last_only=last_only, use_cache=use_cache)
        if not isinstance(last_only, bool):
            raise TypeError(f"last_only must be a bool, got {last_only!r}")
        self.check_tokens(tokens)
        b, s = tokens.shape
        state = self.cache_state
        if not torch.compiler.is_compiling():  # eager code only: no graph can guard a thread
            check_holder(state)
        if use_cache is None:  # attn.policy.uses_cache, its inference-mode test in this frame
            use_cache = explicit_decision(state)
            if use_cache is None:
                use_cache = inference_mode_decides(state, s, torch.compiler.is_compiling())
        elif use_cache and torch.is_grad_enabled():
            raise RuntimeError(
                "use_cache=True in a grad-enabled forward pass: the cache must never hold autograd "
                "history; pass use_cache=model.uses_cache(s), which is False under grad"
            )
        plan = plan_pass(
            state,
            use_cache,
            b,
            s,
            self.rope,
            input_pos=input_pos,
            mask=mask,
            window=self._plan_window,
            local=self._plan_local,
            kernel=self.attention_kernel(),
            linears=self.linear_kernels(use_cache, s, b),
        )  # checks before any write
        run = self._logits if plan.linears == "default" else self._kernel_logits
        if plan.slots is None:
            return run(tokens, plan, last_only)
        if torch.compiler.is_compiling():  # traced code cannot undo
            return self._cached_logits(run, tokens, plan, last_only)
        return self.all_layers_or_none(lambda: self._cached_logits(run, tokens, plan, last_only))

    def _cached_logits(
        self, run: Callable[..., torch.Tensor], tokens: torch.Tensor, plan: PassPlan, last_only: bool
    ) -> torch.Tensor:
        # The fill advances here, not in a call around run(...): where a graph breaks inside run
        # (FSDP2's hooks on torch 2.7 and 2.8), a callable pushed before run's call stays on the
        # stack across the break, dynamo guards it by identity, and a fresh bound method each
        # call recompiled the rest of the forward every call (tests/test_distributed_compile.py).
        logits = run(tokens, plan, last_only)
        self.cache_state.advance(tokens.shape[1])  # once, after every layer wrote its slots
        return logits

    def all_layers_or_none(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run()``, a pass that writes every layer's cache in turn; if it fails partway (out
        of memory, an interrupt, a hook), the layers it wrote are rewound to the fill they all
        had before, so no layer keeps the failed pass's tokens (the slots past a fill are
        always zero: a rewind restores them bit for bit). Called from eager code: the forward,
        and ``attn.compile_for_decode``'s step around its compiled call."""
        fill = self.cache_state.fill.clone()  # a copy on the device, no host read
        try:
            return run()
        except BaseException:
            self.cache_state.restore(fill)
            raise

    @torch.compiler.disable  # inductor would fuse and reorder what parity mode keeps in order
    def _kernel_logits(self, tokens: torch.Tensor, plan: PassPlan, last_only: bool) -> torch.Tensor:
        with self.kernels(plan.linears):
            return self._logits(tokens, plan, last_only)

    def kernels(self, linears: Linears | None = None) -> contextlib.AbstractContextManager[object]:
        """The context the linear and activation kernels ``linears`` (``attn.plan.Linears``)
        run in; ``None``: this model's for a pass that is no decode step (parity mode's or
        the default ones). Every forward, and ``attn.completion_logprobs``, runs inside it;
        the attention kernel is the plan's (``attention_kernel``)."""
        if linears is None:
            linears = "exact" if self.parity else "default"
        if linears == "exact":
            return ParityKernels()
        # "native": attn's products; the layers attn::decode_layers calls where native_layers says so (_logits).
        return contextlib.nullcontext() if linears == "default" else packed_linears(linears)

    def linear_kernels(self, use_cache: bool, num_tokens: int, batch_size: int) -> Linears:
        """The linear kernels of a pass (``attn.plan.Linears``): parity mode's exact ones; for
        an eager decode step (one token per row, with the cache) oneDNN's, on packed weights
        where ``attn.set_packed_decode`` asked for them, else attn's few-row products where
        they take every linear (``native_products``), else oneDNN's on the weights as they are:
        in a CPU fp32 model where that is the faster (``attn.packed.plain_onednn_faster``: AMD
        CPUs), and as matrix-vector products in a CPU bf16 model at batch 1; for any other
        pass without gradients (a prefill, scoring) of a CPU bf16 model on a CPU without bf16
        arithmetic, its products of many rows in fp32 (``"widened"``); else torch's."""
        if self.parity:
            return "exact"
        # A branch on the switch, before any return: a compiled step guards it on every release
        # (compile_for_decode packs its matrix products by it).
        if self.packed_decode:
            kernels: Linears = "packed"
        else:
            kernels = self._plain_weight_kernels(batch_size)
        if torch.compiler.is_compiling():
            return "default"
        if not (use_cache and num_tokens == 1):
            return "widened" if self._widens_products() else "default"
        if kernels != "packed" and self.native_products(batch_size):
            return "native"
        if not packed_decode_available():
            return "default"
        # The vendor only here, past the compile check: a traced step cannot read /proc/cpuinfo.
        return "default" if kernels == "onednn" and not plain_onednn_faster() else kernels

    def _widens_products(self) -> bool:
        """Does a pass other than a decode step run its bf16 products in fp32
        (``attn.plan.Linears``: ``"widened"``)? For a CPU bf16 model on a CPU without bf16
        arithmetic (``attn.packed.bf16_arithmetic``: oneDNN's bf16 product there runs at a fifth
        of fp32's), in a pass without gradients: with them, autograd would keep each layer's
        fp32 weight copy for the backward pass (twice the bf16 weights' memory a forward)."""
        weight = self.tok_embeddings.weight
        return (
            not torch.is_grad_enabled()
            and weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and not bf16_arithmetic()
        )

    def native_products(self, batch_size: int) -> bool:
        """Do attn's few-row kernels take every linear of an eager decode step of
        ``batch_size`` rows (``attn.native.native_product``: a CPU with AVX2 or AVX-512, a CPU
        bf16 or fp32 model, up to 16 rows, 32 in bf16 with AMX)?"""
        weight = self.tok_embeddings.weight
        if weight.device.type != "cpu":
            return False
        config = self.config
        widths = (config.embed_dim, self.layers[0].attn.num_heads * config.head_dim, config.hidden_dim)
        return all(native_product(batch_size, width, weight.dtype) is not None for width in widths)

    def native_final_norm(self) -> torch.Tensor | None:
        """The final norm's weight where ``attn::decode_layers`` can run the norm after the last
        layer (Llama's RMSNorm, no hook on it nor a forward set on the instance, a plain
        contiguous weight), else None:
        ``attn.native_step.NativeStep`` asks once, as it asks each layer for ``native_parts``."""
        norm = self.norm
        if not _plain_module(norm, RMSNorm) or norm.unit_offset:
            return None
        weight = norm._parameters.get("weight")
        return weight if type(weight) in _PLAIN_TENSORS and weight.is_contiguous() else None

    def native_layers(self, batch_size: int) -> bool:
        """Does an eager decode step of ``batch_size`` rows run its layers as calls to
        ``attn::decode_layers`` (``attn.plan.Linears``: ``"native"``)? Where the CPU has
        AVX512-BF16, or AVX2 and no AVX512-BF16 (the op's AVX2 build), and the kernels build (the
        first call builds them, ``attn.native``), for a CPU bf16 or fp32 model of the layers it
        computes (Llama's, with Qwen2's biases, Qwen3's
        q/k norms, sliding windows; widths of whole vectors), with caches of its dtype, and rows
        its products take (``attn.native.native_product``: up to 32 in bf16 with AMX, 16
        without, 16 in fp32). A layer with a hook or an adapter on one of its modules runs them
        in that step (``attn.native_step``)."""
        caches = self.cache_state.caches
        if not (self._native_config and caches and caches[0].k_cache.dtype == self.tok_embeddings.weight.dtype):
            return False
        return self.native_products(batch_size) and decode_layers_available()

    def native_step(self) -> NativeStep:
        """The native decode step of this model's layers (``attn.native_step``), built anew where
        anything it was built from changed."""
        step = self._native_step
        if step is None or not step.current():
            step = self._native_step = NativeStep(self)
        return step

    def native_loop(self, batch_size: int, num_slots: int) -> NativeLoop | None:
        """The decode steps of a generation of ``batch_size`` rows attending over ``num_slots``
        cache slots, as ``attn::decode_loop`` calls (``attn.native_loop``), where they are
        exactly what it computes; else None, and ``attn.generate`` runs its steps in Python.
        What it computes: every layer in one ``attn::decode_layers`` run with the final norm
        (``native_layers``, ``native_step``), attn's own forward and modules with no hook on
        the model, the embedding or the output layer (a bias-free ``Linear`` or the tied
        embedding), none registered globally, no embedding scale, logit soft cap or window
        inside ``num_slots``."""
        if type(self) is not TransformerDecoder or "forward" in self.__dict__:
            return None
        if self._forward_hooks or self._forward_pre_hooks or global_hooks():
            return None
        if self.config.embed_scale or self.config.logit_softcap is not None:
            return None
        window = self._plan_window
        if self._plan_local is not None or (window is not None and window < num_slots):
            return None
        if self.linear_kernels(True, 1, batch_size) != "native" or not self.native_layers(batch_size):
            return None
        step = self.native_step()
        if len(step.runs) != 1 or step.runs[0].module is not None or not step.normed:
            return None
        embedding, output = self.tok_embeddings, self.output
        if not _plain_module(embedding, nn.Embedding):
            return None
        if output is None:
            head = embedding.weight
        elif _plain_module(output, Linear) and output.bias is None:
            head = output.weight
        else:
            return None
        dtype = step.runs[0].weights[0].dtype
        weights = (embedding.weight, head, self.rope.cos_sin)
        if any(type(w) not in _PLAIN_TENSORS or not w.is_contiguous() or w.device.type != "cpu" for w in weights):
            return None
        if embedding.weight.dtype != dtype or head.dtype != dtype or self.rope.cos_sin.dtype != torch.float32:
            return None
        return NativeLoop(self, step, head)

    def _plain_weight_kernels(self, batch_size: int) -> Linears:
        """A decode step's kernels on the weights as they are: oneDNN's product for a CPU fp32
        model, its matrix-vector product for a CPU bf16 model at batch 1, else torch's."""
        weight = self.tok_embeddings.weight
        if weight.device.type != "cpu":
            return "default"
        if weight.dtype == torch.float32:
            return "onednn"
        return "matvec" if weight.dtype == torch.bfloat16 and batch_size == 1 else "default"

    def attention_kernel(self) -> Kernel:
        """The attention kernel of this model's passes (``attn.plan.Kernel``): parity mode's
        exact one, Gemma 2's soft-capped one, or torch's fused kernels."""
        if self.parity:
            return "exact"
        return "sdpa" if self.config.attn_softcap is None else "softcap"

    def _logits(self, tokens: torch.Tensor, plan: PassPlan, last_only: bool) -> torch.Tensor:
        local = plan.local or plan
        h = self.embed(tokens)  # (b, s, e)
        if plan.linears == "native" and not global_hooks() and self.native_layers(tokens.shape[0]):
            step = self.native_step()
            h = step(h, plan, (plan.rotation.contiguous(), local.rotation.contiguous()))
            if step.normed:  # its last call ran the final norm; one token a row: the last
                return self.output_logits(h)
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, local if self.local_layers[i] else plan)
        if last_only:
            h = h[:, -1:]  # (b, 1, e)
        return self.head(h)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s, e) the first hidden states."""
        h = self.tok_embeddings(tokens)  # (b, s, e)
        if self.config.embed_scale:  # sqrt(e) rounded to h's dtype first, as Gemma's checkpoints were trained
            h = h * torch.tensor(math.sqrt(self.config.embed_dim), dtype=h.dtype, device=h.device)
        return h

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """(b, s, e) the last hidden states -> (b, s, v) logits: the final norm and output layer."""
        return self.output_logits(self.norm(h))

    def output_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(b, s, e) hidden states after the final norm -> (b, s, v) logits: the output layer
        (the embedding where they are tied) and Gemma 2's soft cap."""
        logits = linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)  # (b, s, v)
        cap = self.config.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def check_tokens(self, tokens: torch.Tensor) -> None:
        """Raises unless ``tokens`` is a (b, s) integer tensor of ids in ``[0, vocab_size)``;
        the id range (one host read) is skipped under ``torch.compile`` and inside
        ``cache_state.checked_up_front()`` (``CacheState.skips_checks``)."""
        if not isinstance(tokens, torch.Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of ids, got {type(tokens).__name__}")
        if tokens.dim() != 2:
            raise ValueError(
                f"tokens must have shape (batch, seq_len), got {tuple(tokens.shape)}; "
                "use tokens[None] for a single sequence"
            )
        if tokens.dtype not in (torch.long, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"tokens must be integer ids (torch.long), got dtype {tokens.dtype}")
        if tokens.shape[1] == 0:
            raise ValueError(f"tokens has no positions: shape {tuple(tokens.shape)}")
        if not self.cache_state.skips_checks():
            low, high = torch.stack((tokens.min(), tokens.max())).tolist()  # one host read
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(
                    f"token ids must be in [0, {self.config.vocab_size}), got min {low} and max "
                    f"{high}; check the tokenizer matches the model's vocab_size"
                )


def _warn_checked(caller: str) -> None:
    warnings.warn(
        f"{caller}(checked=...) is deprecated: run the passes of a loop that checked its token ids and cache "
        "capacity up front inside `with model.cache_state.checked_up_front():`",
        DeprecationWarning,
        stacklevel=3,
    )


def decoder_of(model: nn.Module, caller: str) -> TransformerDecoder:
    """The ``TransformerDecoder`` behind ``model``: the model itself, a ``torch.compile`` of
    it, or ``attn.compile_for_decode``'s wrapper (which keeps it as ``.model``).

    Raises:
        TypeError: ``model`` is none of these; the message names ``caller``.
    """
    base = getattr(model, "_orig_mod", model)
    if not isinstance(base, TransformerDecoder):
        base = getattr(base, "model", base)
    if not isinstance(base, TransformerDecoder):
        raise TypeError(
            f"{caller} takes an attn.TransformerDecoder, a torch.compile of one or attn.compile_for_decode's "
            f"wrapper, got {type(model).__name__}"
        )
    return base
