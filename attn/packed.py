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

Without the switch, eager fp32 decode steps still run oneDNN's product, on the weight as it is
(``PassPlan.linears == "onednn"``: no copy; 36-38 ms against MKL's 63-68 for those linears at 16
rows); bf16 ones keep ``F.linear``, which is oneDNN's already.

The price of packing is memory: a packed copy of every weight a decode step reads, as large as the
weights themselves, kept while packed decode is on (``set_packed_decode(model, False)``
frees it). bf16 results equal the stock kernel's bit for bit in the shapes measured; fp32
ones differ in the last bits (another kernel's summation order).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Linear", "linear", "packed_decode_available", "packed_linear", "packed_linears", "set_packed_decode"]

PACKED_DTYPES = (torch.bfloat16, torch.float32)

# weight -> ((its version, its storage), the packed copy), by identity; an entry goes when its weight does.
_PACKS = WeakIdKeyDictionary()
_this_thread = threading.local()  # .kind: inside packed_linears(kind) on this thread


@functools.cache
def packed_decode_available() -> bool:
    """Does the installed torch have oneDNN's packed linear (CPU builds with MKL-DNN)?"""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == weight.dtype)
    )


def _packed(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight``'s packed copy, packed now if it is new or changed since."""
    key = (weight._version, weight.data_ptr())
    entry = _PACKS.get(weight)
    if entry is None or entry[0] != key:
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: any later pass may read it
            entry = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows))
        _PACKS[weight] = entry
    return entry[1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; inside ``packed_linears()``, in eager code, oneDNN's product where the
    weight can be packed (a CPU bf16/fp32 tensor; not a DTensor, not another device): on its
    packed copy, or (``kind="onednn"``, fp32 only) on the weight as it is."""
    kind = None if torch.compiler.is_compiling() else getattr(_this_thread, "kind", None)
    if kind == "packed":
        return _packed_product(x, weight, bias)
    if kind == "onednn" and weight.dtype == torch.float32 and _packable(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not _packable(x, weight, bias):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed(weight, x.shape[:-1].numel()), bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``attn.packed.linear``: the decoder's projections. The
    same parameters, state dict and behaviour, and peft and tensor parallelism take it as
    any ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


@torch.library.custom_op("attn::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``attn.packed.linear`` inside ``packed_linears()``, as an operator that compiled code
    calls (``attn.compile_for_decode``'s step, for linears it does not rewrite)."""
    return _packed_product(x, weight, bias)


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@contextlib.contextmanager
def packed_linears(kind: str = "packed") -> Iterator[None]:
    """This thread's ``attn.packed.linear`` calls run oneDNN's product for the block: on packed
    weights (``"packed"``), or on fp32 weights as they are (``"onednn"``: no copy; at 16 rows
    1.8x MKL's kernel on the AMD EPYC kind, ``docs/performance.md``)."""
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
