"""Parity mode: every forward computes a token's logits the same way, bit for bit, whatever
the pass (cached decode, chunked prefill, full pass, training pass with grad), the batch it
shares, or its padding. Generation's log-probs then equal the training forward's: an RL
loop's importance ratio is exactly 1 on-policy.

Shapes: b = batch, h = heads, h_kv = kv heads, g = h / h_kv, s = queries, L = keys,
d = head dim, M = rows of a product, K = its inner dim, N = its output dim.

The default kernels are not invariant: a linear's row depends on how many rows the product
has (MKL and oneDNN choose their kernels by shape, measured in docs/parity.md), and a fused
attention kernel sums one query's keys in another order than many queries'. Parity mode
computes them otherwise while a model's forward runs:

- linears (``F.linear``, swapped by ``ParityKernels``, a ``TorchFunctionMode``, so adapters'
  linears such as peft's LoRA are covered too): ``invariant_linear``. On a CPU with AVX2 or
  AVX512-BF16, bf16 and fp32 products run ``attn::invariant_linear``: tiles of 16 rows through a
  few-row kernel whose row sums do not depend on the other rows, at about the speed of one BLAS
  product of all the rows (``attn/csrc/invariant_linear.cpp``). Elsewhere (other dtypes, other
  devices, no native build) the rows go through BLAS products of exactly ``ROWS`` rows each (the
  last one zero-padded), so every row meets the same kernel, at about twice the time. Which of
  the two runs is fixed for a process, so every pass in it agrees.
- attention: the pass plan's ``exact`` kernel (``attn.plan.Kernel``; the model's
  ``attention_kernel()`` chooses it in parity mode): the scores and the weighted sum in float64
  (``exact_attention``). A product of two bf16 (or fp32) numbers is exact in
  float64 and the sums carry 29 bits more than an fp32 result keeps, so the order in which
  keys are summed, how many masked keys a pass carries, and where padding puts them change
  nothing once the result is rounded back.
- ``F.silu`` and ``F.gelu`` (Gemma's GeGLU), swapped by ``ParityKernels``: in float64 too, for
  the same reason (a vectorised and a scalar ``exp`` may differ in the last bit, and which one
  an element meets depends on the tensor's size).

Gemma 2's soft-capped attention has no exact kernel yet: ``set_parity_mode`` refuses it.

Every other op in the model is an exact IEEE operation or a per-row reduction whose order
does not depend on the row count. The price is speed (``python -m attn bench --parity``);
the default mode stays the fast one. A compiled model runs its parity-mode forward in eager
code (``torch.compiler.disable``): inductor would fuse and reorder these ops, and the
equality would not hold (measured: a bf16 forward compiled by inductor differs from eager).
``attn.compile_for_decode`` refuses a model in parity mode.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from attn.native import invariant_linear_available

__all__ = ["ROWS", "ParityKernels", "exact_attention", "invariant_linear", "modes_report", "set_parity_mode"]

# Rows in every BLAS product a parity-mode linear runs where attn::invariant_linear does not.
# Measured on the Intel Xeon (AMX) and AMD EPYC kinds, bf16 and fp32: a row's result in a
# 16-row product does not depend on the row's place in it, and 16 rows cost a decode step
# little more than one (docs/parity.md).
ROWS = 16


# Inner and output dims of every product, padded with zeros to multiples of this. Measured on
# the AMD EPYC kind (MKL, fp32): where K is not a multiple of 4 or N is 8 or less, a row's
# result in a 16-row product depends on its place in it; padded, no shape tried did (K 1-69,
# N 1-64, fp32 and bf16). Checkpoints' linears need no padding: their dims are multiples of 16.
PAD = 16


# Queries a block of a pass computes, over the keys up to the last one the block may attend
# (exact_attention, its forward and backward): a causal pass of 512 tokens reads 0.62 of its scores.
QUERY_BLOCK = 128


def _rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` (M, K), ``weight`` (N, K), each row's bits whatever the other
    rows: ``attn::invariant_linear`` for bf16 and fp32 on a CPU it runs on (every parity pass of
    those dtypes in the process takes it), else ``ROWS``-row BLAS products."""
    native = x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.shape[0] > 0
    if native and invariant_linear_available():  # builds the kernels on the first call
        return torch.ops.attn.invariant_linear.default(x, weight.contiguous())
    return _chunked_product(x, weight)


def _chunked_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` (M, K), ``weight`` (N, K), one ``ROWS``-row product at a time."""
    (m, k), n = x.shape, weight.shape[0]
    k_pad, n_pad = -k % PAD, -n % PAD
    if k_pad or n_pad:  # adds exact zeros to each sum and columns that are dropped
        weight = F.pad(weight, (0, k_pad, 0, n_pad))  # (N', K')
    padded = x.new_zeros((-(-m // ROWS) * ROWS, k + k_pad))  # (M', K'), M' a multiple of ROWS
    padded[:m, :k] = x
    out = x.new_empty((padded.shape[0], weight.shape[0]))  # (M', N')
    weight_t = weight.t()
    for start in range(0, padded.shape[0], ROWS):
        torch.mm(padded[start : start + ROWS], weight_t, out=out[start : start + ROWS])
    return out[:m, :n]


class _InvariantLinear(torch.autograd.Function):
    """Forward as ``_rows_product``; backward as one BLAS product each (gradients need not be
    bitwise, and one (M, K) x (K, N) product is the fastest)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        return _rows_product(x, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None  # (M, K)
        grad_weight = grad.t() @ x if ctx.needs_input_grad[1] else None  # (N, K)
        return grad_x, grad_weight


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row is the same bits whatever the other rows are.

    Args:
        x: (..., K).
        weight: (N, K).
        bias: (N,) or None; added after the product.

    Returns:
        (..., N), in the dtype ``F.linear`` gives.
    """
    if x.dtype != weight.dtype:
        raise ValueError(f"invariant_linear: input dtype {x.dtype} differs from the weight's {weight.dtype}")
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    out = _InvariantLinear.apply(rows, weight)  # (M, N)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class _ExactAttention(torch.autograd.Function):
    """Attention in float64, ``QUERY_BLOCK`` queries at a time (``_query_blocks``), that saves
    only q, k, v and the mask for backward: each block's (s_block, keys) probabilities are
    recomputed there (a training pass's float64 scores would not fit whole). q (b, h, s, d), k
    and v (b, h_kv, L, d), mask as ``_head_mask`` gives it; (b, h, s, d)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):  # type: ignore[no-untyped-def, override]
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale, ctx.block = scale, QUERY_BLOCK  # backward recomputes the forward's blocks
        b, h, _, d = q.shape
        blocks = [
            (probs @ v[:, :, :keys].double()).to(q.dtype).view(b, h, last - first, d)  # (b, h, s_block, d)
            for first, last, keys, _, probs in _query_blocks(q, k, mask, scale, QUERY_BLOCK)
        ]
        return torch.cat(blocks, 2)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        q, k, v, mask = ctx.saved_tensors
        b, h, _, d = q.shape
        h_kv = k.shape[1]
        grad_k = torch.zeros(k.shape, dtype=torch.float64, device=k.device)  # (b, h_kv, L, d): a sum over blocks
        grad_v = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
        grad_q = []
        for first, last, keys, rows, probs in _query_blocks(q, k, mask, ctx.scale, ctx.block):
            grad_rows = grad[:, :, first:last].double().reshape(b, h_kv, -1, d)  # (b, h_kv, g * s_block, d)
            values, keys_wide = v[:, :, :keys].double(), k[:, :, :keys].double()  # (b, h_kv, keys, d)
            grad_v[:, :, :keys] += probs.transpose(-1, -2) @ grad_rows
            grad_probs = grad_rows @ values.transpose(-1, -2)  # (b, h_kv, g * s_block, keys)
            grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True)) * ctx.scale
            grad_q.append((grad_scores @ keys_wide).view(b, h, last - first, d))
            grad_k[:, :, :keys] += grad_scores.transpose(-1, -2) @ rows.double()
        return torch.cat(grad_q, 2).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None


def _query_blocks(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float, block: int
) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
    """q's queries ``block`` at a time, each block over the keys up to the last one any of
    its queries may attend: a causal pass of 512 tokens reads 0.62 of the scores. The keys left
    out have zero weight for every query of the block, so a query's float64 sums change only
    their grouping, as between a decode step and a prefill, and its rounded result does not.
    q (b, h, s, d), k (b, h_kv, L, d), mask as ``_head_mask`` gives it. Yields each block's
    first and last query (s_block = last - first), its keys, its queries as rows (b, h_kv,
    g * s_block, d), head-major as q's heads, and their probabilities (b, h_kv, g * s_block,
    keys)."""
    b, h, s, d = q.shape
    h_kv, L = k.shape[1], k.shape[2]
    by_query = mask.shape[-2] != 1
    allowed = mask.reshape(-1, *mask.shape[-2:]).any(0)  # (s or 1, L or 1): may any row attend
    for first in range(0, s, block):
        last = min(first + block, s)
        block_mask = mask[..., first:last, :] if by_query else mask  # (.., s_block or 1, L or 1)
        keys = L
        if mask.shape[-1] != 1:
            seen = (allowed[first:last] if by_query else allowed).any(0).nonzero()
            keys = int(seen[-1]) + 1 if len(seen) else 1  # none: the block's queries get zeros
            block_mask = block_mask[..., :keys]
        rows = q[:, :, first:last].reshape(b, h_kv, (h // h_kv) * (last - first), d)  # (b, h_kv, g * s_block, d)
        yield first, last, keys, rows, _probabilities(rows, k[:, :, :keys], block_mask, scale)


def _probabilities(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax of the float64 scores of q (b, h_kv, g * s, d) against k (b, h_kv, L, d), under
    ``mask`` (broadcastable to (b, h_kv, g, s, L)): (b, h_kv, g * s, L). A query with no key
    it may attend (a padding query) gets zeros, not the NaN a zero weight would carry on."""
    return _softmax((q.double() @ k.double().transpose(-1, -2)) * scale, mask)


def _softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``_probabilities`` of float64 scores (b, h_kv, g * s, L)."""
    b, h_kv, rows, _ = scores.shape
    s, L = mask.shape[-2], scores.shape[-1]
    scores = scores.view(b, h_kv, rows // s, s, L).masked_fill(~mask, float("-inf"))  # (b, h_kv, g, s, L)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), 0.0, top)
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    return (weights / torch.where(total == 0, 1.0, total)).view(b, h_kv, rows, L)


def _by_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """(b, h_kv, r, c) as (b / group, h_kv, group * r, c): a group's rows one after another."""
    b, h_kv, r, c = x.shape
    return x.reshape(b // group, group, h_kv, r, c).transpose(1, 2).reshape(b // group, h_kv, group * r, c)


def _by_row(x: torch.Tensor, group: int) -> torch.Tensor:
    """``_by_group`` undone: (b / group, h_kv, group * r, c) as (b, h_kv, r, c)."""
    n, h_kv, rows, c = x.shape
    return x.reshape(n, h_kv, group, rows // group, c).transpose(1, 2).reshape(n * group, h_kv, rows // group, c)


def _shared_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, group: int, slots: int
) -> torch.Tensor:
    """``_ExactAttention``'s forward where rows ``b`` hold row ``b - b % group``'s keys and
    values in their first ``slots`` slots (``PassPlan.shared``): those are widened and multiplied
    once for the group, its rows' queries in one product; the rest row by row. q (b, h_kv,
    g * s, d), k and v (b, h_kv, L, d); (b, h_kv, g * s, d). Float64 sums in another grouping:
    the rounded result is the same, as for a pass of another shape."""
    queries = q.double()
    lead_k, lead_v = (t[::group, :, :slots].double() for t in (k, v))  # (b / group, h_kv, slots, d)
    head = _by_row(_by_group(queries, group) @ lead_k.transpose(-1, -2), group)  # (b, h_kv, g * s, slots)
    tail = queries @ k[:, :, slots:].double().transpose(-1, -2)  # (b, h_kv, g * s, L - slots)
    probs = _softmax(torch.cat((head, tail), -1) * scale, mask)  # (b, h_kv, g * s, L)
    out = _by_row(_by_group(probs[..., :slots], group) @ lead_v, group) + probs[..., slots:] @ v[:, :, slots:].double()
    return out.to(q.dtype)


def _head_mask(mask: torch.Tensor, b: int, h: int, h_kv: int, s: int, L: int) -> torch.Tensor:
    """An SDPA mask (broadcastable to (b, h, s, L)) as one broadcastable to (b, h_kv, g, s, L),
    without a copy where it has one head (attn's masks)."""
    if mask.dim() < 4 or mask.shape[1] == 1:
        return mask.reshape(*(1,) * (4 - mask.dim()), *mask.shape).unsqueeze(2)  # (b or 1, 1, 1, s or 1, L or 1)
    return mask.expand(b, h, s, L).reshape(b, h_kv, h // h_kv, s, L)


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    shared: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Attention with its scores and weighted sums in float64, so that a query's result does
    not depend on how many queries, keys or masked slots the pass has (the ``exact`` kernel of
    ``attn.plan.Kernel``).

    Args:
        q: (b, h, s, d).
        k, v: (b, h_kv, L, d), h a multiple of h_kv.
        mask: bool, True where a query may attend, broadcastable to (b, h, s, L); None:
            causal, query i attends to keys 0..i (s == L).
        scale: what q.k is multiplied by; None: ``d ** -0.5``.
        shared: ``(group, slots)``: rows that hold their group's first row's keys and values
            in their first ``slots`` slots (a cached pass after a fork, ``PassPlan.shared``):
            read once for the group where no gradient is taken (a cached pass takes none).

    Returns:
        (b, h, s, d) in q's dtype. A query with no key to attend gets zeros (SDPA: NaN or 0).
    """
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"parity mode takes a bool attention mask, got {mask.dtype}")
    b, h, s, d = q.shape
    h_kv, L = k.shape[1], k.shape[2]
    if mask is None:
        mask = torch.ones((s, L), dtype=torch.bool, device=q.device).tril()
    mask = _head_mask(mask.expand(*mask.shape[:-2], s, L), b, h, h_kv, s, L)
    factor = 1.0 / math.sqrt(d) if scale is None else scale
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if shared is not None and shared[0] > 1 and 0 < shared[1] <= L and not grad:
        rows = q.reshape(b, h_kv, (h // h_kv) * s, d)  # (b, h_kv, g * s, d): head-major, as q's heads
        return _shared_attention(rows, k, v, mask, factor, *shared).reshape(b, h, s, d)
    return _ExactAttention.apply(q, k, v, mask, factor)


def _exact_silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    if inplace:
        raise ValueError("parity mode computes silu out of place; call F.silu(x) without inplace=True")
    return F.silu(x.double()).to(x.dtype)


def _exact_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x.double(), approximate=approximate).to(x.dtype)


class ParityKernels(TorchFunctionMode):
    """While active, ``F.linear``, ``F.silu`` and ``F.gelu`` run their parity-mode forms (the
    module doc); every other function runs as it is. Attention is the plan's choice."""

    _SWAPS: ClassVar[dict[object, object]] = {
        F.linear: invariant_linear,
        F.silu: _exact_silu,
        F.gelu: _exact_gelu,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        swap = self._SWAPS.get(func)
        return (swap or func)(*args, **(kwargs or {}))


def set_parity_mode(model: torch.nn.Module, enabled: bool = True) -> None:
    """Turns parity mode on (or off) for every forward of ``model`` from now on.

    Args:
        model: a ``TransformerDecoder``, or a ``torch.compile`` of one (whose forward then
            runs eagerly in parity mode).
        enabled: ``True`` for parity mode, ``False`` for the default, fast kernels.

    Example::

        attn.set_parity_mode(policy)
        out = attn.generate(policy, prompts, max_new_tokens=64, temperature=1.0, num_samples=8)
        new = attn.completion_logprobs(policy, ...)      # with grad: equals out.logprobs bit for bit
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"set_parity_mode: enabled must be a bool, got {enabled!r}")
    target = getattr(model, "_orig_mod", model)  # a torch.compile of the model: the model itself
    if "parity" not in vars(target):
        raise ValueError(
            f"set_parity_mode takes an attn.TransformerDecoder (or a torch.compile of one), got a "
            f"{type(model).__name__}; attn.compile_for_decode refuses parity mode: set it on the model"
        )
    softcap = getattr(getattr(target, "config", None), "attn_softcap", None)
    if enabled and softcap is not None:
        raise ValueError(
            f"set_parity_mode: this model soft-caps its attention scores (attn_softcap={softcap}, Gemma 2), "
            "which parity mode's float64 attention does not compute yet; its passes run with the default kernels"
        )
    target.parity = enabled


def modes_report() -> str:
    """What each kernel mode promises, for ``attn info``."""
    linears = "attn::invariant_linear" if invariant_linear_available() else f"{ROWS}-row BLAS products"
    return "\n".join(
        [
            "kernels (attn.set_parity_mode(model, on)):",
            "  default:           the fast kernels (SDPA, BLAS); generation's and training's log-probs agree to",
            "                     float rounding (fp32: ~1e-6; bf16: up to ~0.2 abs on a 30-layer model)",
            "  parity mode:       every forward computes a token's logits bit for bit alike (linears in",
            f"                     {linears},",
            "                     attention and silu in float64): generate's log-probs == the training",
            "                     forward's, eager; a torch.compile'd model runs it eagerly,",
            "                     compile_for_decode refuses it",
        ]
    )
