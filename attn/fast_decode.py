"""A fast decode step for CPU: compile the one-token pass, with matrix-vector products that
read each weight once.

Shapes: b = batch, s = new tokens, e = input features (K), n = output features (N),
m = rows of a linear layer's input (b * s).

Decode at small batch is bound by reading the weights: every step reads each weight matrix
once for only ``m <= 8`` rows of input. The stock kernel for ``F.linear`` with so few rows
(BLAS ``sgemm``) reaches about half of this machine's read bandwidth. ``compile_for_decode``
compiles the decode step with inductor and rewrites each such linear into a reduction,
``sum(weight * x_i, -1)`` per row, which inductor turns into one vectorized loop over the
weight rows that keeps every input row's accumulator in registers: each weight element is
read once, at close to the read bandwidth. Attention over the cache is rewritten the same
way (``decode_attention``): for one query per row, the stock SDPA kernel is an opaque call
per layer with its own setup cost (0.1 ms per layer in bf16); written as reductions it fuses
with its neighbours, and the whole step becomes one generated kernel.

bf16 linears of those few rows on a CPU with AVX512-BF16 call ``attn::bf16_matvec`` instead
(``attn.native``): a C++ kernel with bf16 dot-product instructions, which inductor's code cannot
emit. At one row it reads the weights at 24-25 GB/s where the reductions read 13-14; at 8 rows
the bench's step ran 2.06x as fast (Xeon 6/167, 2 threads). On a CPU with AMX, bf16 linears of
5 to 32 rows call ``attn::amx_linear``, tile products on the weight as stored, whatever
``max_rows``: at 16 rows (a GRPO group) they beat oneDNN's product on packed weights; fp32
linears of ``max_rows`` + 1 to 16 rows call ``attn::fp32_linear`` instead of MKL's sgemm. On a
CPU with AVX-512, attention calls ``attn::decode_attention``, a C++ kernel with a vectorized
softmax: the reductions ran at about 20 GFLOP/s, 8.6 ms of a 35 ms bf16 step at 16 rows.

Native layers: on a CPU with AVX512-BF16 (or AVX2 and no AVX512-BF16: the op's AVX2 build), a model
whose layers ``attn::decode_layers`` computes (Llama's, with Qwen2's biases, Qwen3's q/k norms
and sliding windows) runs the layers of an eager decode step as C++ calls, one for all of them
where none has a hook or an adapter (``TransformerDecoder.native_layers``, ``attn.native_step``).
That step was as fast as the compiled one or faster (SmolLM2-135M shape, Xeon 6/167, 2 threads:
bf16 16 rows 708 against 711 tok/s, 8 rows 400 against 404, batch 1 68 against 71; fp32 16 rows
337 against 339, all within the runs' spread; the AVX2 build, forced on a Zen 4: bf16 batch 1
97.5 against 73.5, 16 rows 261.8 against 260.0) and compiles nothing, so ``compile_for_decode``
runs it for such steps (``DecodeCompileStats.native_steps``); ``native_layers=False`` compiles
them.

Compile time: from torch 2.13 the step traces one decoder layer as a region that every layer
calls (``attn.regions.compile_region``), so inductor compiles one layer, not all of them. A
30-layer SmolLM2-shaped model, fp32, on a 2-core AMD EPYC with a compiler build beside it:
18 s in inductor cold, 6.5 s warm (inductor's on-disk cache), against 84 s with every layer
compiled; decode no slower (128 tokens with the prompt: 8.9 s against 10.1 s), tokens equal to eager's.

What it does not do, on purpose:

- no inductor ``freezing``: freezing makes a second, pre-packed copy of every weight
  (doubling the memory) and inlines module state as constants, which is the wrong thing for
  a KV-cache written in place. Here weights and cache buffers stay graph inputs: the cache is
  mutated in place like in eager code, and changing a weight after compiling is seen by the
  next step. ``attn.set_packed_decode(model)`` makes the memory trade on request, without
  freezing: the step's matrix products (more rows than ``max_rows``) call
  ``attn::packed_linear``, which packs each weight once and again whenever it changes.
- no compiled prefill: the prompt runs in eager code (a matrix-matrix product, where the
  stock kernels are good), so prompts of any length never recompile anything.

Cache length: the first graph is compiled for the cache length it first sees (the buffers'
L, and the slots the step's mask covers), with static shapes, the cheapest to compile. When
a second length comes, the step compiles one more graph with the lengths as symbols, and no
later length recompiles (up to 4096 slots; longer caches get one graph of their own, where
inductor changes its reduction scheme). ``attn.generate`` attends over the prompt and the new
tokens rounded up to 64 slots (``attn.attended_slots``), in caches of its own or the
caller's, and a loop that passes no mask over the filled slots rounded up, as the eager
model does: attention reads every slot it covers, so generations of other lengths bring that
second graph rather than read a large cache whole. The symbolic graph compiles slower: for a
30-layer SmolLM2-shaped model, fp32, on a 2-core Intel Xeon, 24-32 s in inductor cold
against 10 s for the static graph (1.3 s warm, and about 6 s of dynamo's trace besides),
decoding at the same speed within the hour's noise.

Example::

    fast = attn.compile_for_decode(model)
    out = attn.generate(fast, prompts, max_new_tokens=128)
    fast.stats.graphs  # 1: one decode graph for every position
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import threading
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attn.checks import is_int
from attn.frames import on_fresh_stack
from attn.kv_cache import CacheState
from attn.native import (
    bf16_linear_kernel,
    build_native,
    decode_attention_available,
    native_available,
    native_head_dim,
    native_product,
)
from attn.native_loop import NativeLoop
from attn.packed import cpu_vendor, cpuinfo  # importing attn.packed registers attn::packed_linear
from attn.plan import positions_and_mask
from attn.regions import compile_regions
from attn.threads import check_holder

__all__ = ["DecodeCompileStats", "DecodeCompiled", "compile_for_decode"]

_LINEAR_TARGETS = (torch._C._nn.linear, F.linear)


def _realize_barrier() -> Any:
    """Inductor's "materialize this tensor" primitive, or ``None`` where it is missing.

    Without it inductor may inline the producer of a linear layer's input (an RMSNorm, a
    SiLU) into the reduction and recompute it once per weight row; with it the input is
    computed once into a buffer. Only a speed matter: results are the same either way.
    """
    try:
        import torch._inductor.inductor_prims  # registers the prims
    except ImportError:  # pragma: no cover - every supported release has it
        return None
    return getattr(torch.ops.prims, "inductor_force_stride_order", None)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` written as one reduction per input row.

    Meant to be traced by inductor for inputs with few rows (decode); in eager code it is
    only a slow reference. Accumulates in fp32 whatever the dtype, like the BLAS kernels.

    Args:
        x: (..., e) with few rows (the product of the leading dims).
        weight: (n, e).
        bias: (n,), added in fp32, or None.

    Returns:
        (..., n), in ``x``'s dtype.
    """
    features = x.shape[-1]
    rows = x.reshape(-1, features)  # (m, e)
    barrier = _realize_barrier()
    if barrier is not None:
        rows = barrier(rows, (features, 1))  # computed once, not once per weight row; no-op in eager
    if rows.dtype != torch.float32:
        rows = rows.float()
        if barrier is not None:  # widened once too: the loop over weight rows converts only the weight
            rows = barrier(rows, (features, 1))
    wide = weight.float()  # (n, e)
    out = torch.stack([(wide * rows[i]).sum(-1) for i in range(rows.shape[0])])  # (m, n)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])  # (..., n)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` for few queries, written as reductions for inductor.

    Same signature; the rewrite only uses it with a bool ``attn_mask``, no dropout, not
    causal. Computes in fp32 whatever the dtype (like the CPU kernels); grouped query heads
    read their key/value head through a broadcast, not a copy. A query whose mask is all
    False gets zeros, like the stock kernel.

    Args:
        q: (b, h, s, d).
        k, v: (b, h_kv, L, d), ``h`` a multiple of ``h_kv``.
        attn_mask: bool, True where a query may attend, broadcastable to (b, h, s, L).

    Returns:
        (b, h, s, d), in ``q``'s dtype.
    """
    b, h, s, d = q.shape
    h_kv, length = k.shape[1], k.shape[2]
    group = h // h_kv
    scale = d**-0.5 if scale is None else scale
    qf = q.float().reshape(b, h_kv, group * s, 1, d) * scale  # (b, h_kv, g*s, 1, d)
    barrier = _realize_barrier()
    if barrier is not None:  # once, not once per key slot (its RoPE would be inlined into the loop)
        qf = barrier(qf, qf.stride())
    scores = (qf * k.float()[:, :, None]).sum(-1)  # (b, h_kv, g*s, L)
    if attn_mask is not None:
        allowed = attn_mask.expand(b, h, s, length).reshape(b, h_kv, group * s, length)
        scores = scores.masked_fill(~allowed, float("-inf"))
    # Softmax with the division after the sum over values (once per output, not per slot).
    peak = scores.amax(-1, keepdim=True)  # (b, h_kv, g*s, 1)
    peak = peak.masked_fill(peak == float("-inf"), 0.0)  # fully masked: every weight exp(-inf) = 0
    weights = (scores - peak).exp()  # (b, h_kv, g*s, L)
    total = weights.sum(-1, keepdim=True)  # >= 1 (the peak's exp(0)), or 0 where fully masked
    out = (weights[..., None] * v.float()[:, :, None]).sum(-2)  # (b, h_kv, g*s, d)
    out = out / total.clamp_min(torch.finfo(torch.float32).tiny)  # fully masked: 0 / tiny, zeros
    return out.reshape(b, h, s, d).to(q.dtype)


_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_RENAMED = {"query": "q", "key": "k", "value": "v"}


def _example_value(arg: Any) -> Any:
    """The value dynamo traced for a graph argument (a fake tensor), or ``None``."""
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None


def _rewrite_decode_attention(gm: torch.fx.GraphModule, max_queries: int, native: bool = False) -> tuple[int, int]:
    """Points every masked, non-causal SDPA call with at most ``max_queries`` queries per
    row at ``decode_attention``, or with ``native``, at ``attn::decode_attention`` where it
    takes the call (CPU, one float dtype, a head dim it handles).

    Returns:
        How many calls were rewritten, and how many of those call ``attn::decode_attention``.
    """
    count = native_count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SDPA_TARGETS:
            continue
        given = dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs)
        q, k, mask = (_example_value(given.get(name)) for name in ("query", "key", "attn_mask"))
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(mask, torch.Tensor)):
            continue  # no mask (plain causal), or not traced tensors: keep the stock kernel
        if q.dim() != 4 or k.dim() != 4 or mask.dtype != torch.bool or given.get("is_causal", False):
            continue
        if given.get("dropout_p", 0.0) != 0.0:
            continue
        queries, heads, kv_heads = q.shape[2], q.shape[1], k.shape[1]
        if not all(isinstance(n, int) for n in (queries, heads, kv_heads)) or queries > max_queries:
            continue
        if heads % kv_heads or (heads != kv_heads and not given.get("enable_gqa", False)):
            continue
        count += 1
        v = _example_value(given.get("value"))
        head_dim = q.shape[-1]
        if (
            native
            and isinstance(head_dim, int)
            and native_head_dim(head_dim)
            and decode_attention_available()
            and q.device.type == "cpu"
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and isinstance(v, torch.Tensor)
            and q.dtype == k.dtype == v.dtype
        ):
            scale = given.get("scale")
            node.target = torch.ops.attn.decode_attention.default
            node.args = (given["query"], given["key"], given["value"], given["attn_mask"])
            node.args += (head_dim**-0.5 if scale is None else scale,)
            node.kwargs = {}
            native_count += 1
            continue
        node.target = decode_attention
        node.args = ()
        node.kwargs = {_RENAMED.get(name, name): value for name, value in given.items()}
    if count:
        gm.graph.lint()
        gm.recompile()
    return count, native_count


@dataclass
class DecodeCompileStats:
    """What the decode compiler did, for tests and benchmarks."""

    graphs: int = 0
    """Graphs compiled so far: 1 after the first decode step; more means a recompile (a new
    batch size, dtype or cache policy, or the second cache length: see the module doc)."""
    regions: int = 0
    """Subgraphs compiled once and called many times, over all graphs: 1 a graph where the
    release compiles one decoder layer for every layer (``attn.compat.compile_regions_supported()``),
    0 where each layer is compiled."""
    linears_rewritten: int = 0
    """Linear calls rewritten for few rows (row-wise reductions, or a native kernel), over
    all graphs and their regions (a layer's count once when its region serves every layer)."""
    linears_native: int = 0
    """Of the rewritten linears, those that call a native kernel (``attn.native``): bf16
    products of at most 16 rows on a CPU with AVX512-BF16 (``attn::bf16_matvec``), or of 5 to
    32 on one with AMX (``attn::amx_linear``); fp32 ones of ``max_rows`` + 1 to 16 rows
    (``attn::fp32_linear``)."""
    linears_packed: int = 0
    """Linear calls that read packed weights (``attn.set_packed_decode``: those with more rows
    than ``max_rows``), counted the same way."""
    attention_rewritten: int = 0
    """Attention calls rewritten for few queries (reductions, ``decode_attention``, or
    ``attn::decode_attention``), counted the same way."""
    attention_native: int = 0
    """Of the rewritten attention calls, those that call ``attn::decode_attention`` (a CPU with
    AVX-512, head dims a multiple of 16: ``attn.native``)."""
    native_steps: int = 0
    """Cached steps that ran the model's eager step, its layers ``attn::decode_layers``
    calls, instead of a compiled graph (``compile_for_decode(native_layers=True)``)."""
    compile_seconds: float = 0.0
    """Wall time spent in inductor, over all graphs."""
    vector_bits: int | None = None
    """SIMD width the last graph was compiled with (``None``: inductor's choice)."""
    dynamic_cache_length: bool = False
    """The step has seen a second cache length and compiles with the length as a symbol:
    one more graph, then none for any later length (up to 4096 slots: inductor picks
    another reduction scheme past that, a graph of its own)."""


def _rewrite_small_linears(
    gm: torch.fx.GraphModule, max_rows: int, packed: bool = False, native: bool = False
) -> tuple[list[tuple[int, torch.dtype]], int, int]:
    """Points every linear with at most ``max_rows`` input rows at ``rowwise_linear``; with
    ``native``, a bf16 one that a native kernel takes (``attn.native.bf16_linear_kernel``: up
    to 16 rows, or up to 32 with AMX, whatever ``max_rows``) at that kernel, and an fp32 one
    of more than ``max_rows`` rows at the one that takes it (``attn.native.native_product``:
    ``attn::fp32_linear`` or, without AVX-512, ``attn::avx2_linear``, up to 16 rows); but with
    ``packed`` (the model asked for packed decode) every linear of more than ``max_rows``
    rows at ``attn.packed.packed_linear``.

    Returns:
        ``(rows, weight dtype)`` of each linear rewritten, how many of those call a native
        kernel, and how many linears read packed weights.
    """
    rewritten = []
    native_count = 0
    packed_count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _LINEAR_TARGETS:
            continue
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        example, weight = _example_value(node.args[0]), _example_value(node.args[1])
        if not isinstance(example, torch.Tensor) or example.dim() == 0:
            continue
        rows = example.numel() // max(int(example.shape[-1]), 1)
        dtype = weight.dtype if isinstance(weight, torch.Tensor) else example.dtype
        kernel = None
        small = isinstance(rows, int) and rows <= max_rows
        if (
            native
            and (small or not packed)  # packed decode, asked for, keeps the matrix products
            and isinstance(rows, int)
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 2
            and weight.is_contiguous()
            and dtype == example.dtype
            and example.device.type == "cpu"
        ):
            if dtype == torch.bfloat16:
                kernel = bf16_linear_kernel(rows, int(weight.shape[1]))
            elif dtype == torch.float32 and rows > max_rows:
                kernel = native_product(rows, int(weight.shape[1]), dtype)
        if kernel is None and not small:  # symbolic or large: a matrix product
            if packed:
                node.target = torch.ops.attn.packed_linear.default
                node.args, node.kwargs = (node.args[0], node.args[1], bias), {}
                packed_count += 1
            continue
        node.target = rowwise_linear if kernel is None else kernel
        node.args = (node.args[0], node.args[1], bias)
        node.kwargs = {}
        rewritten.append((rows, dtype))
        native_count += kernel is not None
    if rewritten or packed_count:
        gm.graph.lint()
        gm.recompile()
    return rewritten, native_count, packed_count


# No size asserts in the generated wrapper: dynamo's guards already check every input's sizes
# and strides before the graph runs (the symbolic cache length's relations included). The asserts
# repeat that per decoder layer call (17 inputs each): 0.6-0.9 ms of a 30-layer step's 2-3 ms
# of Python overhead, measured on a 30-layer model too small for its kernels to matter.
_INDUCTOR_OPTIONS = {"size_asserts": False}


@functools.cache
def _precision_casts_emulated() -> bool:
    """Can inductor's CPU code round each bf16 intermediate where eager code rounds it?

    With ``emulate_precision_casts`` it does (otherwise it keeps some in fp32, such as a
    norm's output read by the next linear), so a bf16 step stays within bf16 rounding of
    eager's (tests/test_fast_decode.py). Through torch 2.8 the vectorized cast misspells
    the argument the option passes (``use_compute_dtypes``) and a bf16 step fails to
    compile; read from the signature, not a version number.
    """
    try:
        from torch._inductor.codegen.cpp import CppVecOverrides
    except ImportError:  # pragma: no cover - every supported release has it
        return False
    return "use_compute_types" in inspect.signature(CppVecOverrides.to_dtype).parameters


@functools.cache
def _cacheable_rewrites() -> dict[str, str]:
    """The rewrite's functions by name, each with a key: a hash of this file.

    AOTAutograd's on-disk cache, which lets a warm compile skip tracing the graph again,
    refuses a graph that calls a function it does not know (``rowwise_linear``,
    ``decode_attention``), since a changed function would not change its key. Inductor's
    ``unsafe_marked_cacheable_functions`` lets it in, keyed by the given string: a hash of
    the file that defines both, so any change to the rewrite makes a new key.
    """
    key = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return {f"{fn.__module__}.{fn.__name__}": key for fn in (rowwise_linear, decode_attention)}


def _inductor_options(vector_bits: int | None) -> dict[str, Any]:
    """``_INDUCTOR_OPTIONS``, the SIMD width, bf16 rounding as eager's and the rewrite's
    functions marked cacheable where the release can (see each)."""
    from torch._inductor import config as inductor_config

    options: dict[str, Any] = dict(_INDUCTOR_OPTIONS)
    if _precision_casts_emulated():
        options["emulate_precision_casts"] = True
    if vector_bits is not None:
        options["cpp.simdlen"] = vector_bits
    marked = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if isinstance(marked, dict):
        options["unsafe_marked_cacheable_functions"] = marked | _cacheable_rewrites()
    return options


def _double_pumped_avx512() -> bool:
    """Is this an AMD CPU with AVX-512 (Zen 4 runs 512-bit vectors as two 256-bit halves)?"""
    return cpu_vendor() == "AuthenticAMD" and " avx512f" in cpuinfo()


def _vector_bits(rewritten: list[tuple[int, torch.dtype]], requested: int | None) -> int | None:
    """The SIMD width to compile with: ``requested``, or a measured choice, or inductor's.

    Measured on an AMD EPYC (Zen 4, AVX-512), one thread: single-row fp32 reductions run
    about 13% faster as 256-bit code (a 56M-parameter decode step: 11.5 -> 10.0 ms); bf16
    and 8-row steps were 2-4% slower, so they keep inductor's default.
    """
    if requested is not None:
        return requested
    if rewritten and all(rows == 1 and dtype == torch.float32 for rows, dtype in rewritten):
        return 256 if _double_pumped_avx512() else None
    return None


def _mark_cache_length_dynamic(state: CacheState | None, mask: torch.Tensor | None) -> None:
    """Tells dynamo that the cache length (L) varies, so that one graph serves every length.

    The key/value buffers' slot dim and the state's slot ids (``state``: pass it when its
    caches are new; the mark stays on a buffer) and ``mask``'s last dim (pass it where it has
    one entry per slot) become symbols;
    every other size stays static (the linears are rewritten for a fixed number of rows).
    ``maybe_mark_dynamic``: where a model's code needs one fixed length after all, dynamo
    specializes rather than fails (a test counts the graphs).
    """
    if state is not None:
        torch._dynamo.maybe_mark_dynamic(state.slot_ids, 0)
        for cache in state.caches:
            for buffer in (cache.k_cache, cache.v_cache):
                torch._dynamo.maybe_mark_dynamic(buffer, 2)
    if mask is not None:
        torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)


def _start_inductor_setup() -> threading.Thread:
    """Starts inductor's own per-process setup in a thread, and returns it.

    Before its first compile in a process inductor checks which vector instruction sets the
    C++ compiler can target: per set, a probe program (built once per cache folder) and a
    child process that loads it, about 2.5 s on a 2-core Intel Xeon with the probes built.
    Those are waits on other processes, so run in a thread they overlap dynamo's tracing of
    the step, which comes first; the step's compile joins the thread before it starts. The
    modules the probes use are imported first, on the calling thread (the compile imports them
    anyway): the thread then runs no module's import-time code beside the caller's.
    """
    with contextlib.suppress(Exception):  # only a head start: inductor probes again, and reports what fails
        import torch._inductor.codecache
        import torch._inductor.cpp_builder
        import torch._inductor.cpu_vec_isa  # noqa: F401

    def probe() -> None:
        with contextlib.suppress(Exception):
            from torch._inductor.cpu_vec_isa import valid_vec_isa_list

            valid_vec_isa_list()  # cached for the process: inductor's later call returns at once

    thread = threading.Thread(target=probe, name="attn-inductor-setup", daemon=True)
    thread.start()
    return thread


# Graphs one model's step may compile besides those already compiled in the process: batch
# sizes, dtypes and cache policies times the two cache-length forms. Dynamo's own default.
_GRAPHS_PER_STEP = 8


def _recompile_limit_name() -> str:
    """``cache_size_limit`` before torch 2.7, ``recompile_limit`` from 2.7 (the old name an alias)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def recompile_limit() -> int:
    """Dynamo's recompile limit now: graphs per code object."""
    return getattr(torch._dynamo.config, _recompile_limit_name())


def decode_step_options(recompile_limit: int) -> dict[str, Any]:
    """Dynamo options for ``attn.compile_for_decode``'s step, for ``torch._dynamo.config.patch``.

    - A module buffer's dim may be traced as a symbol where it is marked dynamic
      (``torch._dynamo.maybe_mark_dynamic``: the KV-cache length). Dynamo keeps every
      parameter and buffer size static unless told otherwise: ``force_parameter_static_shapes``,
      and ``force_nn_module_property_static_shapes`` (torch 2.5.1 needs this one too: there a
      buffer counts as a module property); both exist in every release the matrix covers.
      Unmarked sizes stay static either way (``tests/test_fast_decode.py`` on every leg).
    - The recompile limit, per code object, becomes ``recompile_limit``. It counts every
      graph compiled for one function in the process, whoever compiled it: each model's step
      is another graph of ``TransformerDecoder.forward``, so the ninth model would fail to
      compile (``fullgraph``).
    """
    return {
        "force_parameter_static_shapes": False,
        "force_nn_module_property_static_shapes": False,
        _recompile_limit_name(): recompile_limit,
    }


@functools.lru_cache(maxsize=8)
def _step_options(recompile_limit: int) -> contextlib.AbstractContextManager[None]:
    """Dynamo's options for the step (``decode_step_options``), as one patch made once
    per limit: entered every step, where a fresh patch would cost about twice as much (20
    against 44 us; a 30-layer step is 50 ms and more)."""
    return torch._dynamo.config.patch(**decode_step_options(recompile_limit))


class DecodeCompiled(nn.Module):
    """A ``TransformerDecoder`` whose one-token passes run a compiled, bandwidth-bound step.

    Calls with more than one token (prefill, scoring) run the wrapped model in eager code.
    Everything else (``config``, ``setup_caches``, ``kv_caches``, ...) is the wrapped
    model's, so ``attn.generate`` and the context managers take it as they take the model.

    Build it with ``attn.compile_for_decode``.
    """

    graphs_in_process: int = 0
    """Graphs compiled by every ``DecodeCompiled`` of this process: dynamo counts them all
    against one recompile limit, which each step call raises past this many."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_rows: int,
        rewrite: bool = True,
        vector_bits: int | None = None,
        native: bool | None = None,
        native_layers: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.max_rows = max_rows
        self.rewrite = rewrite
        self.vector_bits = vector_bits
        self.native = native
        self.native_layers = native_layers
        self.stats = DecodeCompileStats()
        self._first_cache_lengths: tuple[int, int] | None = None  # the first cached step's (L, attended slots)
        self._marked_buffer: weakref.ref[torch.Tensor] | None = None  # the first cache's, once marked dynamic
        # Not a submodule: the wrapped model is registered once, as ``model``. Static shapes: a
        # new batch size compiles a graph of its own, with its linears rewritten for that many
        # rows (a graph with a symbolic batch would keep the BLAS kernel). The cache length
        # alone turns symbolic, from its second value on (``_mark_cache_length_dynamic``).
        step = torch.compile(model, fullgraph=True, dynamic=False, backend=self._backend)
        object.__setattr__(self, "_step", step)
        # Started by the first compiled call (none where every step runs natively), joined by the first compile.
        object.__setattr__(self, "_inductor_setup", None)
        object.__setattr__(self, "_setup_started", False)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "model" not in modules:
                raise
            return getattr(modules["model"], name)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        start = time.perf_counter()
        if self._inductor_setup is not None:  # the probes, run beside dynamo's trace
            self._inductor_setup.join()
            object.__setattr__(self, "_inductor_setup", None)
        self.stats.graphs += 1
        DecodeCompiled.graphs_in_process += 1
        rewritten = []
        graphs = [module for module in gm.modules() if isinstance(module, torch.fx.GraphModule)]
        self.stats.regions += len(graphs) - 1  # a decoder layer's region: one subgraph for every layer
        if self.rewrite:
            packed = self.model.packed_decode  # dynamo guards it: a change compiles another graph
            native = self._native(example_inputs)
            for graph in graphs:
                small, native_count, packed_count = _rewrite_small_linears(graph, self.max_rows, packed, native)
                rewritten += small
                self.stats.linears_native += native_count
                self.stats.linears_packed += packed_count
                attention, native_count = _rewrite_decode_attention(graph, self.max_rows, native)
                self.stats.attention_rewritten += attention
                self.stats.attention_native += native_count
            self.stats.linears_rewritten += len(rewritten)
        bits = self.stats.vector_bits = _vector_bits(rewritten, self.vector_bits)
        with inductor_config.patch(_inductor_options(bits)):
            compiled = compile_fx(gm, example_inputs)
        self.stats.compile_seconds += time.perf_counter() - start
        return compiled

    def _native(self, example_inputs: list[torch.Tensor]) -> bool:
        """Does the step call attn's native kernels? As asked (``native``), or by default on a
        CPU where they are built; not for a graph on another device."""
        devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
        if self.native is False or devices - {"cpu"}:
            return False
        return self.native or native_available()  # True: compile_for_decode built them already

    def _runs_native_layers(self, batch_size: int) -> bool:
        """Does a cached step of ``batch_size`` rows run the model's eager step, its layers
        ``attn::decode_layers`` calls (``TransformerDecoder.native_layers``), rather than compile?
        Unless ``native_layers`` or ``native`` is False."""
        return self.native_layers and self.native is not False and self.rewrite and self.model.native_layers(batch_size)

    def native_loop(self, batch_size: int, num_slots: int) -> NativeLoop | None:
        """``attn.generate``'s decode steps as ``attn::decode_loop`` calls where this step would
        run the model's eager step (``_runs_native_layers``) and the model's ``native_loop``
        takes them; each model pass it runs counts in ``stats.native_steps``."""
        if "forward" in self.__dict__ or self._forward_hooks or self._forward_pre_hooks:
            return None
        if not self._runs_native_layers(batch_size):
            return None
        loop = self.model.native_loop(batch_size, num_slots)
        if loop is not None:
            loop.stats = self.stats
        return loop

    def _follow_cache_length(self, mask: torch.Tensor | None) -> None:
        """From the second cache length on (the buffers' L, or the slots a mask covers), every
        cached step runs with the lengths marked dynamic: the buffers when they are new
        (``setup_caches``, a fork), a mask each step (a fresh tensor); 30 layers' buffers
        marked every step would cost about 0.3 ms."""
        state = self.model.cache_state
        capacity = state.max_seq_len
        lengths = (capacity, capacity if mask is None else mask.shape[-1])  # (L, attended)
        if self._first_cache_lengths is None:
            self._first_cache_lengths = lengths
        elif lengths != self._first_cache_lengths:
            self.stats.dynamic_cache_length = True
        if not self.stats.dynamic_cache_length:
            return
        buffer = state.caches[0].k_cache  # new after a setup, a select or a fork
        fresh = self._marked_buffer is None or self._marked_buffer() is not buffer
        if fresh:
            self._marked_buffer = weakref.ref(buffer)
        _mark_cache_length_dynamic(state if fresh else None, mask)

    def forward(
        self, tokens: torch.Tensor, *, use_cache: bool | None = None, checked: bool | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Same contract as ``TransformerDecoder.forward``; (b, 1) tokens run compiled.

        The cache decision and the capacity check run here, in eager code, and the compiled
        step (``fullgraph``) takes the decision as a bool: a plain ``torch.inference_mode()``
        decode loop runs it as ``attn.generate`` does, with no graph break. ``checked`` is
        deprecated as the model's is (``CacheState.checked_up_front``).
        """
        state = self.model.cache_state
        if checked is not None:
            warnings.warn(
                "DecodeCompiled.forward(checked=...) is deprecated: run the passes of a loop that checked its "
                "token ids and cache capacity up front inside `with model.cache_state.checked_up_front():`",
                DeprecationWarning,
                stacklevel=2,
            )
            if checked:
                with state.checked_up_front():
                    return self(tokens, use_cache=use_cache, **kwargs)
        if tokens.dim() != 2 or tokens.shape[1] != 1:
            return self.model(tokens, use_cache=use_cache, **kwargs)
        _refuse_parity_mode(self.model)
        check_holder(state)  # eager: the compiled step cannot tell threads apart
        self.model.check_tokens(tokens)  # the eager error, not one from inside the step
        if use_cache is None:
            use_cache = self.model.uses_cache(1)
        if use_cache and self._runs_native_layers(tokens.shape[0]):
            self.stats.native_steps += 1
            return self.model(tokens, use_cache=True, **kwargs)  # the eager step: its own checks, its own plan
        if use_cache and not state.prechecked:  # before anything is written
            span = self.model.check_cache_capacity(tokens.shape[0], 1, kwargs.get("mask"))
            if kwargs.get("mask") is None:  # the eager model's default, over the span it read: not every slot
                kwargs["input_pos"], kwargs["mask"] = positions_and_mask(
                    state, state.query_slots(1), 1, tokens.device, kwargs.get("input_pos"), None, span=span
                )
        if use_cache:
            self._follow_cache_length(kwargs.get("mask"))
        if not self._setup_started:  # the step may compile now: inductor's probes start beside its trace
            object.__setattr__(self, "_setup_started", True)
            object.__setattr__(self, "_inductor_setup", _start_inductor_setup())
        # Checked here or by the caller: one compiled step for generate and hand-written loops.
        limit = max(DecodeCompiled.graphs_in_process + _GRAPHS_PER_STEP, recompile_limit())
        step = functools.partial(self._step, tokens, use_cache=use_cache, **kwargs)
        with compile_regions(), _step_options(limit):
            # The step's wrapper makes 30-250 Python calls: run them where a frame-stack chunk
            # has room for them, not wherever the caller's depth puts them (attn.frames).
            return on_fresh_stack(self.model.all_layers_or_none, step) if use_cache else on_fresh_stack(step)


def compile_for_decode(
    model: nn.Module,
    *,
    max_rows: int = 8,
    rewrite_linears: bool = True,
    vector_bits: int | None = None,
    native: bool | None = None,
    native_layers: bool = True,
) -> DecodeCompiled:
    """Compiles ``model``'s decode step (one token per row) for CPU inference.

    The step compiles on its first call (seconds to tens of seconds on two cores: the module
    doc has figures) and once per new batch size or dtype after that; decode through
    ``attn.generate`` compiles once for a whole generation. Generations of other lengths
    compile one more graph between them, with the cache length as a symbol (the module doc
    has the cost). The cache decision runs in eager code before the step, so a plain
    ``torch.inference_mode()`` decode loop drives it exactly as it drives the model.

    Args:
        model: a ``TransformerDecoder`` in eval mode; it is shared, not copied.
        max_rows: linear layers with at most this many input rows (batch size for decode)
            are rewritten into row-wise reductions; larger batches keep the BLAS kernel,
            except, up to 16 rows in fp32 and 32 in bf16, for attn's native products where
            the CPU runs them (``native``, below) and the model did not ask for packed
            decode.
        rewrite_linears: ``False`` compiles the step with stock inductor (for comparison):
            no linear and no attention rewrite.
        vector_bits: SIMD width for the generated code (inductor's ``cpp.simdlen``: 256,
            512); ``None`` lets inductor choose, except 256 for fp32 batch-1 decode on AMD
            CPUs with AVX-512, where it measured faster.
        native: attn's C++ kernels, built on first use (``attn.native``): attention calls
            ``attn::decode_attention`` (AVX-512); bf16 linears of 5 to 32 rows
            ``attn::amx_linear`` (AMX), and of at most 16 rows (fewer than 5 with AMX)
            ``attn::bf16_matvec`` (AVX512-BF16 dot products), whatever ``max_rows``; fp32 linears of more than
            ``max_rows`` and at most 16 rows ``attn::fp32_linear`` (AVX512-BF16 CPUs), where
            the CPU has those instructions; on a CPU with AVX2 and no AVX512-BF16 both dtypes'
            linears ``attn::avx2_linear`` (attention ``attn::decode_attention`` where the CPU
            has AVX-512, else inductor's). ``None`` (default)
            where the CPU has AVX2 or AVX-512 and the build succeeds (else one warning and
            inductor's code), ``True`` to require the build (its error if not), ``False`` for
            inductor's code.
        native_layers: cached steps the model's eager step runs as ``attn::decode_layers``
            calls (``TransformerDecoder.native_layers``: a CPU with AVX512-BF16, or AVX2 and
            no AVX512-BF16, a Llama-style model, rows its products take) run so, and compile
            nothing: that step was faster than the compiled one (``docs/performance.md``). ``False`` compiles
            every step (as ``native=False`` and ``rewrite_linears=False`` do).

    Returns:
        A ``DecodeCompiled`` to pass to ``attn.generate`` in place of the model.

    Example::

        fast = attn.compile_for_decode(model)
        out = attn.generate(fast, [[1, 5, 9]], max_new_tokens=64)
    """
    if not is_int(max_rows) or max_rows < 0:
        raise ValueError(f"max_rows must be a non-negative int, got {max_rows!r}")
    if vector_bits not in (None, 128, 256, 512):
        raise ValueError(f"vector_bits must be None, 128, 256 or 512, got {vector_bits!r}")
    if not (native is None or isinstance(native, bool)):
        raise ValueError(f"native must be None, True or False, got {native!r}")
    if not isinstance(native_layers, bool):
        raise ValueError(f"native_layers must be True or False, got {native_layers!r}")
    if native and not rewrite_linears:
        raise ValueError(
            "native=True rewrites linears and attention, which rewrite_linears=False turns off: drop one of them"
        )
    if model.training:
        raise ValueError("compile_for_decode is for inference: call model.eval() first")
    _refuse_parity_mode(model)
    if native:  # asked for: fails here, before anything is compiled, where it cannot run
        build_native()
    return DecodeCompiled(
        model,
        max_rows=max_rows,
        rewrite=rewrite_linears,
        vector_bits=vector_bits,
        native=native,
        native_layers=native_layers,
    )


def _refuse_parity_mode(model: nn.Module) -> None:
    """The compiled step's rewritten kernels cannot keep parity mode's order (``attn.parity``)."""
    if getattr(model, "parity", False):
        raise RuntimeError(
            "compile_for_decode: the model is in parity mode, whose decode steps must compute "
            "exactly as its training forward does; a compiled step fuses and reorders those "
            "ops. Generate with the model itself (attn.generate(model, ...)), or call "
            "attn.set_parity_mode(model, False) for the fast compiled step"
        )
