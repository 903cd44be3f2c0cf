"""attn.frames: a loop of Python calls on a frame-stack chunk with room for it.

The property is measured, not assumed: a chunk that CPython maps and unmaps on every call
shows as minor page faults of the thread (``getrusage(RUSAGE_THREAD)``), at least one per
call. The control (the same loop without ``on_fresh_stack``) shows that the measurement
sees the thrash on the releases that have it.
"""

from __future__ import annotations

import resource
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attn.frames import on_fresh_stack

from .conftest import examples

CALLS = 400  # calls a depth; a thrashing depth faults at least once a call
DEPTHS = range(0, 240)  # one small frame a level: more than one 16 KiB chunk of frames

needs_rusage = pytest.mark.skipif(
    not hasattr(resource, "RUSAGE_THREAD"), reason="per-thread page-fault counts need Linux's RUSAGE_THREAD"
)


def _leaf() -> int:
    return 1


def _loop() -> int:
    total = 0
    for _ in range(CALLS):
        total += _leaf()
    return total


def _at_depth(depth: int, fn):  # one frame a level
    return fn() if depth == 0 else _at_depth(depth - 1, fn)


def _faults(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _worst_depth(loop) -> tuple[int, int]:
    """(faults, depth) of the depth whose loop faulted most."""
    return max((_faults(lambda d=depth: _at_depth(d, loop)), depth) for depth in DEPTHS)


@needs_rusage
def test_a_loop_on_a_fresh_stack_does_not_map_a_chunk_per_call():
    faults, depth = _worst_depth(lambda: on_fresh_stack(_loop))
    assert faults < CALLS // 4, f"{faults} page faults for {CALLS} calls at depth {depth}"


@needs_rusage
@pytest.mark.skipif(
    sys.version_info < (3, 11) or sys.version_info >= (3, 13),
    reason="only 3.11 and 3.12 are known to unmap a chunk on every return (3.10 has no chunks; 3.13 and 3.14 "
    "releases from 2026 cache one)",
)
def test_the_control_loop_does_map_a_chunk_per_call_at_some_depth():
    faults, depth = _worst_depth(_loop)
    assert faults >= CALLS, f"no depth thrashed: at most {faults} page faults for {CALLS} calls (depth {depth})"


@given(
    args=st.lists(st.integers(), max_size=4),
    kwargs=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(), max_size=3),
    nested=st.booleans(),
)
@settings(max_examples=examples(30), deadline=None)
def test_it_is_the_plain_call(args, kwargs, nested):
    def fn(*a, **k):
        return a, k

    call = (lambda *a, **k: on_fresh_stack(fn, *a, **k)) if nested else fn
    assert on_fresh_stack(call, *args, **kwargs) == (tuple(args), kwargs)


def test_an_error_propagates_and_the_next_call_starts_fresh_again():
    def fail():
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        on_fresh_stack(fail)
    if hasattr(resource, "RUSAGE_THREAD"):  # not left marked as nested: the next call gets its chunk again
        faults, depth = _worst_depth(lambda: on_fresh_stack(_loop))
        assert faults < CALLS // 4, f"{faults} page faults for {CALLS} calls at depth {depth}"
