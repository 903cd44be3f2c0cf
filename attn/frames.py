"""Running a hot loop of Python calls where CPython's frame stack has room for it.

From Python 3.11, CPython keeps the frames of Python functions on a per-thread stack built
of chunks (16 KiB, or larger for a frame that needs more). A call whose frame does not fit
in the current chunk maps a new one, and its return unmaps it again. A loop that calls
Python functions from a depth just below a chunk's end therefore maps and unmaps memory on
every call: two system calls and page faults, and while another thread of the process runs
(an OpenMP worker of torch's), the unmap interrupts that thread's CPU to flush its TLB, which
on a virtual machine is far dearer still (CPython issue gh-142183; 3.13 and 3.14 releases from
spring 2026 on keep one chunk, 3.11 and 3.12 do not).

A compiled decode step is such a loop: its generated wrapper makes some 30 to 250 Python calls
a step. Measured on a 2-core Intel Xeon 6/167 VM (torch 2.13.0, Python 3.11.7, SmolLM2-135M
shape, bf16, one row): the same compiled step took 23.4 ms at the depth where the bench called
it and 20.4 ms when started on a fresh chunk; ``strace`` counted about 200 pairs of
``mmap``/``munmap`` of 16 KiB a step more at the slow depth. Which depth is the slow one
changes with any frame above the loop, so the loss came and went with unrelated edits.

``on_fresh_stack(fn, ...)`` calls ``fn`` from a frame too large for what is left of any
16 KiB chunk: CPython maps a 64 KiB chunk for it and the frames of everything ``fn`` calls
lie in the roughly 40 KiB after it. One map and one unmap a call (about 7 us on one thread),
and none for calls nested inside another ``on_fresh_stack`` on the same thread.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# A frame of this many slots (8 bytes each, 24.8 KB) does not fit in what is left of a 16 KiB
# chunk, so CPython maps a new chunk for it, sized to the power of two over the frame plus its
# 1,000-slot margin: 64 KiB, which leaves about 40 KB for the frames below it.
_FRAME_SLOTS = 3100

_state = threading.local()


def _enter(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
    return fn(*args, **kwargs)


# The frame's size is its code's locals plus its value stack: a deeper declared stack makes
# the frame large without running anything. Python 3.10 and older have no chunked stack.
if sys.version_info >= (3, 11):
    _enter.__code__ = _enter.__code__.replace(co_stacksize=_enter.__code__.co_stacksize + _FRAME_SLOTS)


def on_fresh_stack(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, with every frame it pushes on a chunk of CPython's frame stack
    that has room for them, whatever the caller's depth.

    Nested calls on the same thread run ``fn`` directly: the outer call's chunk holds them.
    """
    if getattr(_state, "inside", False):
        return fn(*args, **kwargs)
    _state.inside = True
    try:
        return _enter(fn, args, kwargs)
    finally:
        _state.inside = False
