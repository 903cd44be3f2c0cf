"""Packed decode: a decode step's linears read their weights pre-packed for oneDNN (CPU).

A decode step multiplies a few rows by every weight matrix. The stock CPU kernels re-lay each
weight out for the matrix unit on every call, which costs more than the product at a few
rows: on a 2-core AMD EPYC (SmolLM2-135M's shape, 30 layers' linears) 45 ms a step at 16
rows in fp32 and 19 ms at one row in bf16 against 19 and 10 ms from weights laid out once
(``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's freezing uses).

``attn.set_packed_decode(model)`` turns it on for a model's eager decode steps (one token
per row, passes that use the cache, on the CPU, in bf16 or fp32) and for the matrix products
of ``attn.compile_for_decode``'s step (linears over more rows than its ``max_rows``, through
the ``attn::packed_linear`` operator); prefill, scoring, training and ``torch.compile``-d
passes run the stock kernels. Each weight is packed on first use and again
whenever it changes (an optimizer step, a load: its version counter or storage moves), so
an RL loop that trains between generations decodes with its current weights.

Without the switch, eager fp32 decode steps on an AMD CPU still run oneDNN's product, on the
weight as it is (``PassPlan.linears == "onednn"``: no copy; 36-38 ms against MKL's 63-68 for those
linears at 16 rows), where torch's fp32 ``F.linear`` runs MKL's slower path
(``plain_onednn_faster``); on Intel CPUs MKL is the faster of the two and ``F.linear`` stays. bf16
steps of more than one row keep ``F.linear``, which is oneDNN's already; at one row (batch 1) they
run ``torch.addmv`` (``"matvec"``), oneDNN's matrix-vector kernel, with the same results as
``F.linear`` and faster on all but the smallest weights through torch 2.13 (1.5-1.8x on the
SmolLM2-135M shape's MLP weights and head; equal from torch 2.15: ``docs/performance.md``).

The price of packing is memory: a packed copy of every weight a decode step reads, as large as the
weights themselves, kept while packed decode is on (``set_packed_decode(model, False)``
frees it). On a CPU without bf16 arithmetic (no AVX512-BF16 or AMX: Ice Lake and older Xeons,
AMD before Zen 4) a bf16 step of at least ``WIDEN_FROM_ROWS`` rows reads fp32 copies instead,
twice the size, and multiplies in fp32 (``widens``): 1.8x faster at 16 rows on an Ice Lake Xeon.
Where oneDNN cannot pack bf16 at all (AVX2-only CPUs, ``bf16_packs``) fewer rows run the stock
kernel (at one row 25 ms a step against 61 widened, AMD EPYC Zen 1, 2 threads).

bf16 results equal the stock kernel's bit for bit in the shapes measured where they are not
widened; fp32 and widened bf16 ones differ in the last bits (another kernel's summation order).
"""

from __future__ import annotations

import contextlib
import functools
import platform
import threading
from collections.abc import Iterator
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Linear", "linear", "packed_decode_available", "packed_linear", "packed_linears", "set_packed_decode"]

PACKED_DTYPES = (torch.bfloat16, torch.float32)
PackedKind = Literal["packed", "onednn", "matvec", "native", "widened"]
"""The products ``packed_linears`` runs: on packed copies, on fp32 weights as they are,
one-row bf16 products as matrix-vector products on the weights as they are, or attn's own
few-row kernels on the weights as they are (``attn.native.native_product``), or bf16 products
of many rows in fp32 on copies widened for the call (``WIDEN_EACH_CALL_FROM_ROWS``)."""

# weight -> ((its version, its storage), the packed copy), by identity; an entry goes when its weight does.
_PACKS = WeakIdKeyDictionary()
_this_thread = threading.local()  # .kind: inside packed_linears(kind) on this thread


@functools.cache
def packed_decode_available() -> bool:
    """Does the installed torch have oneDNN's packed linear (CPU builds with MKL-DNN)?"""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def plain_onednn_faster() -> bool:
    """Is oneDNN's product on an fp32 weight as it is faster than ``F.linear`` (MKL's) for a
    decode step on this CPU? Yes on AMD's, where MKL does not take its fastest code paths: the
    30 layers' projections of the SmolLM2-135M shape, 2 threads, 36-38 against 63-68 ms at 16
    rows and 25 against 28 at one (AMD EPYC). No on Intel's, where MKL's are the faster: whole
    eager steps 42 against 31 ms at one row and 83 against 76 at 16 (Xeon 6/167 with AMX); and
    no elsewhere (another vendor, or none to be read): ``F.linear`` is left as it is."""
    return cpu_vendor() == "AuthenticAMD"


@functools.cache
def cpuinfo() -> str:
    """The start of ``/proc/cpuinfo`` (its first CPU's vendor and flags), or, where there is
    none, ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo") as file:
            return file.read(65536)
    except OSError:
        return platform.processor()


@functools.cache
def cpu_vendor() -> str | None:
    """The CPU's vendor id (``"GenuineIntel"``, ``"AuthenticAMD"``) from ``cpuinfo()``; ``None``
    where it names neither."""
    text = cpuinfo()
    return next((vendor for vendor in ("GenuineIntel", "AuthenticAMD") if vendor in text), None)


def _packable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
    )


WIDEN_FROM_ROWS = 4
"""bf16 products of at least this many rows, on a CPU without bf16 arithmetic, run in fp32
(``widens``). Measured on an Ice Lake Xeon, 2 threads, the 30 layers' projections of the
SmolLM2-135M shape: 1 row 17.4 ms bf16 against 35.5 widened (twice the bytes read), 2 rows
32.7 against 39.5, 4 rows 45.6 against 39.5, 16 rows 81.8 against 46.2."""


@functools.cache
def bf16_arithmetic() -> bool:
    """Does this CPU multiply bf16 in hardware (AVX512-BF16 or AMX)? Elsewhere oneDNN widens
    each bf16 operand to fp32 inside its kernel, at a quarter of its fp32 speed. Non-x86 CPUs
    count as yes: their bf16 products are left as they are."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if platform.machine().lower() not in ("x86_64", "amd64") or None in probes:
        return True
    return any(probe() for probe in probes)


@functools.cache
def bf16_packs() -> bool:
    """Can oneDNN pack a bf16 weight on this CPU? It needs AVX512-BW/VL/DQ or AVX-NE-CONVERT on
    x86 (torch's own test, ``torch.ops.mkldnn._is_mkldnn_bf16_supported``): not on AVX2-only
    CPUs (AMD before Zen 4, Intel's client cores before Arrow Lake), where ``_packed_product``
    runs the stock bf16 kernel below ``WIDEN_FROM_ROWS`` rows and a widened fp32 copy from there."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return probe is None or bool(probe())


WIDEN_EACH_CALL_FROM_ROWS = 8
"""bf16 products of at least this many rows, on a CPU without bf16 arithmetic, in a pass that is
not a decode step (``kind="widened"``), run in fp32 on an fp32 copy of the weight made for the
call. oneDNN's bf16 kernel there widens inside its loops at a fifth of fp32's speed. Measured on
an AMD EPYC Zen 1 (``AuthenticAMD 23/1``, AVX2), 2 threads, 1536x576 and 576x1536 weights, median
of 7: 4 rows 0.76/0.97 ms bf16 against 1.54/0.78 widened, 8 rows 2.30/1.33 against 1.83/0.79,
128 rows 23.2/22.0 against 5.9/4.9, 512 rows 94.7/90.8 against 16.0/17.0; a 2048-row one
454 ms against 87 (fp32's own: 85)."""

WIDENED_WEIGHT_ELEMENTS = 1 << 24
"""The most weight elements a widened product copies to fp32 at once (64 MiB)."""


def widens(weight: torch.Tensor, rows: int) -> bool:
    """Does a packed product of ``rows`` rows by ``weight`` run in fp32? For a bf16 weight on a
    CPU without bf16 arithmetic, from ``WIDEN_FROM_ROWS`` rows: the packed copy is fp32 (twice
    the bf16 weight's size), the input is widened and the output rounded to bf16. The products
    of bf16 values are exact in fp32 and both kernels sum in fp32: only the order of the sums
    differs."""
    return weight.dtype == torch.bfloat16 and rows >= WIDEN_FROM_ROWS and not bf16_arithmetic()


def _packed(weight: torch.Tensor, rows: int, wide: bool) -> torch.Tensor:
    """``weight``'s packed copy (fp32 where ``wide``), packed now if it is new or changed since."""
    key = (weight._version, weight.data_ptr(), wide)
    entry = _PACKS.get(weight)
    if entry is None or entry[0] != key:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: any later pass may read it
            source = weight.detach().float() if wide else weight.detach()
            entry = (key, torch.ops.mkldnn._reorder_linear_weight(source, rows))
        _PACKS[weight] = entry
    return entry[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; inside ``packed_linears()``, in eager code, oneDNN's product where the
    weight can be packed (a CPU bf16/fp32 tensor; not a DTensor, not another device): on its
    packed copy, on the weight as it is (``kind="onednn"``, fp32 only), or as a matrix-vector
    product (``kind="matvec"``, bf16 inputs of one row only), or, for a bf16 weight on a CPU
    without bf16 arithmetic, in fp32 on a copy widened for the call (``kind="widened"``, from
    ``WIDEN_EACH_CALL_FROM_ROWS`` rows)."""
    kind = None if torch.compiler.is_compiling() else getattr(_this_thread, "kind", None)
    if kind is None:
        return F.linear(x, weight, bias)
    if kind == "packed":
        return _packed_product(x, weight, bias)
    if kind == "onednn" and weight.dtype == torch.float32 and _packable(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    rows = x.shape[:-1].numel()
    if kind == "matvec" and weight.dtype == torch.bfloat16 and rows == 1 and _packable(x, weight, bias):
        return _matvec(x, weight, bias)
    if (
        kind == "widened"
        and weight.dtype == torch.bfloat16
        and rows >= WIDEN_EACH_CALL_FROM_ROWS
        and _packable(x, weight, bias)
    ):
        return _widened_product(x, weight, bias)
    if kind == "native" and _packable(x, weight, bias) and weight.is_contiguous():
        from attn.native import native_product  # attn.native adds to the operator library defined here

        kernel = native_product(rows, weight.shape[1], weight.dtype)
        if kernel is not None:
            return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


def _widened_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of bf16 operands (x: (..., K), weight: (N, K)) in fp32, rounded to bf16
    once, widening at most ``WIDENED_WEIGHT_ELEMENTS`` of the weight at a time: a large output
    projection (Llama 3's 128,256 x 4,096) would otherwise copy 2 GiB for the call."""
    wide_x = x.float()
    step = max(1, WIDENED_WEIGHT_ELEMENTS // weight.shape[1])  # output features a block
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))  # (..., N), bf16
    for start in range(0, weight.shape[0], step):
        block = slice(start, start + step)
        block_bias = None if bias is None else bias[block].float()
        out[..., block] = F.linear(wide_x, weight[block].float(), block_bias)  # rounds to bf16
    return out


def _matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of one row (x: (..., e), one row in all) as ``torch.mv``, or with a bias
    ``torch.addmv``, which adds it inside as ``F.linear`` does: ``F.linear``'s results bit for
    bit in every shape measured (``docs/performance.md``)."""
    row = x.reshape(-1)  # (e,)
    out = torch.mv(weight, row) if bias is None else torch.addmv(bias, weight, row)  # (n,)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not _packable(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.shape[:-1].numel()
    wide = widens(weight, rows)
    if weight.dtype == torch.bfloat16 and not wide and not bf16_packs():
        return F.linear(x, weight, bias)  # 25 ms against 61 widened, one row, AMD EPYC Zen 1 (bf16_packs)
    if wide:  # fp32 operands on an fp32 copy; the output is rounded back below
        x, bias = x.float(), None if bias is None else bias.float()
    out = torch.ops.mkldnn._linear_pointwise(x, _packed(weight, rows, wide), bias, "none", [], "")
    return out.to(weight.dtype) if wide else out


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``attn.packed.linear``: the decoder's projections. The
    same parameters, state dict and behaviour, and peft and tensor parallelism take it as
    any ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# attn::packed_linear, the operator compiled code calls. Defined on a plain library, not with
# torch.library.custom_op, whose Python layers (autograd among them) cost every call more than a
# small product's own Python does; a decode step makes one call per linear and never needs a
# gradient (docs/performance.md, "The packed operator's own cost").
_LIBRARY = torch.library.Library("attn", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``attn.packed.linear`` inside ``packed_linears()``, as the operator ``attn::packed_linear``
    that compiled code calls (``attn.compile_for_decode``'s step, for linears it does not
    rewrite). No gradient flows through it."""
    return _packed_product(x, weight, bias)


_LIBRARY.impl("packed_linear", packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("attn::packed_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@contextlib.contextmanager
def packed_linears(kind: PackedKind = "packed") -> Iterator[None]:
    """This thread's ``attn.packed.linear`` calls run oneDNN's product for the block: on packed
    weights (``"packed"``), on fp32 weights as they are (``"onednn"``: no copy; at 16 rows
    1.8x MKL's kernel on the AMD EPYC kind, ``docs/performance.md``), or, for bf16 inputs of
    one row, its matrix-vector product on the weights as they are (``"matvec"``), attn's
    own few-row kernels where they take the product (``"native"``: ``attn.native``), or bf16
    products of many rows in fp32 (``"widened"``: ``WIDEN_EACH_CALL_FROM_ROWS``).

    Raises:
        ValueError: ``kind`` is none of these.
    """
    if kind not in get_args(PackedKind):
        raise ValueError(f"packed_linears: kind must be one of {get_args(PackedKind)}, got {kind!r}")
    before = getattr(_this_thread, "kind", None)
    _this_thread.kind = kind
    try:
        yield
    finally:
        _this_thread.kind = before


def set_packed_decode(model: torch.nn.Module, enabled: bool = True) -> None:
    """Turns packed decode (the module doc) on or off for ``model``'s decode steps.

    Args:
        model: a ``TransformerDecoder``, a ``torch.compile`` of one, or
            ``attn.compile_for_decode``'s wrapper.
        enabled: ``False`` turns it off and frees the packed copies of its weights.

    Raises:
        ValueError: ``model`` is not a decoder, ``enabled`` not a bool, or this torch build
            has no oneDNN packed linear.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"set_packed_decode: enabled must be a bool, got {enabled!r}")
    target = getattr(model, "_orig_mod", model)
    if "packed_decode" not in vars(target):  # attn.compile_for_decode's wrapper keeps the model as .model
        target = getattr(target, "model", target)
    if "packed_decode" not in vars(target):
        raise ValueError(
            f"set_packed_decode takes an attn.TransformerDecoder, a torch.compile of one or "
            f"attn.compile_for_decode's wrapper, got a {type(model).__name__}"
        )
    if enabled and not packed_decode_available():
        raise ValueError(
            f"set_packed_decode: torch {torch.__version__} has no oneDNN packed linear "
            "(torch.backends.mkldnn.is_available() is False); decode runs the stock kernels"
        )
    target.packed_decode = enabled
    if not enabled:
        for parameter in target.parameters():
            _PACKS.pop(parameter, None)
