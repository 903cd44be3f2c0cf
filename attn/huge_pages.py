"""A model's weights in transparent huge pages, for CPU decode.

A decode step at a small batch reads every weight once. Linux backs a process's memory with
4 KiB pages unless asked otherwise, and a weight streamed from 4 KiB pages pays a TLB miss every
4 KiB. PyTorch's own switch (``THP_MEM_ALLOC_ENABLE=1``, set before the process starts) asks for
huge pages for tensors of 2 MiB or more only, and most matrices of a small model are smaller
(SmolLM2-135M's largest layer matrix is 1.7 MiB). ``place_in_huge_pages`` copies a module's
parameters into one 2 MiB-aligned private anonymous mapping advised ``MADV_HUGEPAGE``, in the
order the module holds them (the order a forward reads them). Each parameter keeps its own
object and a storage of its own (a window of the mapping, not a view of a shared tensor), so
``state_dict``, safetensors, optimizers and hooks see the parameters they saw before. The
mapping is unmapped when the last of those storages is freed. ``docs/performance.md`` has the
measurements.
"""

from __future__ import annotations

import math
import mmap
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

__all__ = ["HugePageWarning", "huge_page_bytes", "huge_page_zeros", "huge_pages_available", "place_in_huge_pages"]

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's transparent huge page
_ALIGNMENT = 64  # bytes: a cache line, where each parameter starts
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class HugePageWarning(UserWarning):
    """The system refused the mapping or its advice: the parameters stay where they were."""


def huge_pages_available() -> bool:
    """Does this system back memory advised ``MADV_HUGEPAGE`` with transparent huge pages
    (Linux, with the THP mode ``always`` or ``madvise``)?"""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _movable(module: nn.Module) -> list[nn.Parameter]:
    """The module's parameters that can move: on the CPU, plain tensors (no subclass such as
    DTensor), contiguous, each the whole of a storage that no other parameter shares."""
    params = list(module.parameters())
    holders: dict[int, int] = {}
    for p in params:
        if p.device.type == "cpu":
            key = p.untyped_storage().data_ptr()
            holders[key] = holders.get(key, 0) + 1
    return [
        p
        for p in params
        if p.device.type == "cpu"
        and type(p.data) is torch.Tensor
        and p.numel() > 0
        and p.is_contiguous()
        and p.storage_offset() == 0
        and p.untyped_storage().nbytes() == p.numel() * p.element_size()
        and holders[p.untyped_storage().data_ptr()] == 1
    ]


def _windows(
    tensors: Sequence[tuple[Sequence[int], torch.dtype]], who: str, what: str
) -> tuple[list[torch.Tensor], int] | None:
    """Tensors of the given shapes and dtypes (zeros), each a window of one private anonymous
    mapping advised ``MADV_HUGEPAGE``, in that order, each starting on a cache line; and the
    bytes they take. None where the system offers no transparent huge pages or they take less
    than one huge page (an arena of 4 KiB pages reads no faster than separate tensors), and
    where the system refuses the mapping (a ``HugePageWarning`` from ``who`` saying ``what``
    happens instead)."""
    offsets, size = [], 0
    for shape, dtype in tensors:
        offsets.append(size)
        size += -(-math.prod(shape) * dtype.itemsize // _ALIGNMENT) * _ALIGNMENT
    if not huge_pages_available() or size < HUGE_PAGE:
        return None
    length = -(-size // HUGE_PAGE) * HUGE_PAGE
    try:
        arena = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        start = -torch.frombuffer(arena, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE  # the first 2 MiB boundary
        arena.madvise(mmap.MADV_HUGEPAGE, start, length)  # before any page is touched
    except OSError as error:  # no memory to commit (overcommit off), or a kernel without THP
        warnings.warn(
            f"{who}: the system refused a {length >> 20} MiB mapping of huge pages ({error}); {what}",
            HugePageWarning,
            stacklevel=3,
        )
        return None
    windows = []
    with torch.inference_mode(False):  # normal tensors, whatever mode the caller is in
        for (shape, dtype), offset in zip(tensors, offsets, strict=True):
            # a storage of its own, a window of the mapping
            window = torch.frombuffer(
                arena, dtype=torch.uint8, count=math.prod(shape) * dtype.itemsize, offset=start + offset
            )
            windows.append(window.view(dtype).view(tuple(shape)))
    return windows, size


def place_in_huge_pages(module: nn.Module, *, copy: bool = True) -> int:
    """Moves ``module``'s CPU parameters into one mapping backed by transparent huge pages.

    A parameter moves where it is a contiguous CPU tensor that is the whole of its storage and
    shares it with no other parameter (a tied weight is one parameter); the others stay where
    they are. Each moved parameter keeps its object, shape, dtype and ``requires_grad``; only
    its ``.data`` is a new tensor. Where the system offers no transparent huge pages
    (``huge_pages_available``), or the parameters that could move take less than one huge
    page, nothing moves: an arena of 4 KiB pages read no faster than separate tensors.

    Args:
        module: the model (any ``nn.Module``).
        copy: copy each parameter's values into its new place; ``False`` for parameters about
            to be overwritten (``attn.load_pretrained``'s uninitialized ones), which then hold
            zeros.

    Returns:
        The bytes of the mapping the moved parameters take (each rounded up to 64 bytes, where
        it starts); 0 where nothing moved.

    Example::

        model = TransformerDecoder(config).to(torch.bfloat16)
        attn.place_in_huge_pages(model)  # decode reads the weights from 2 MiB pages
    """
    params = _movable(module)
    placed = _windows(
        [(p.shape, p.dtype) for p in params], "place_in_huge_pages", "the parameters stay in the memory they had"
    )
    if placed is None:
        return 0
    places, size = placed
    with torch.no_grad():
        for p, place in zip(params, places, strict=True):
            if copy:
                place.copy_(p.data)
            p.data = place
    return size


def huge_page_zeros(shapes: Sequence[tuple[Sequence[int], torch.dtype]], who: str) -> list[torch.Tensor] | None:
    """Zeroed CPU tensors of the given shapes and dtypes in one mapping backed by transparent
    huge pages, in that order, each a storage of its own; None where the system offers none or
    they take less than one huge page (then allocate them as usual). What
    ``TransformerDecoder.setup_caches`` puts a CPU model's KV-caches in: a decode step reads each
    layer's keys and values once, and from 4 KiB pages the hardware's prefetcher stops at every
    page (``docs/performance.md``). ``who``: the caller, named in the warning where the system
    refuses the mapping."""
    placed = _windows(shapes, who, "the tensors are allocated as usual")
    return None if placed is None else placed[0]


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """The bytes of huge pages backing the memory mapping that holds ``tensor``'s first byte
    (its ``AnonHugePages`` in ``/proc/self/smaps``; 0 off Linux or where none back it)."""
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            low, high = (int(bound, 16) for bound in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0
