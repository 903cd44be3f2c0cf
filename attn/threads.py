"""Which thread holds a model's KV-caches: one model, several threads, never silently mixed.

A model's caches and its cache flag are the model's, not a call's. While one thread runs a
block that sets the flag or owns the caches (``attn.generate``, ``attn.score_continuations``,
``attn.cached_inference``, ``attn.kv_cache_mode``, ``attn.disable_kv_cache``,
``attn.local_kv_cache``), the model is that thread's: another thread's forward pass, cache
operation (setup, reset, rewind, select, fork, teardown) or such block raises
``RuntimeError`` before it reads or changes anything. Outside those blocks a model has no
holder and any thread may use it, as before. The fix the error names: one model per thread
(``copy.deepcopy``), or a lock around each call.

The forward passes check in eager code; a ``torch.compile``d forward skips the check (the
thread is not something a compiled graph can guard), so a compiled model's raw passes from a
second thread are not caught: the blocks above, which such a thread enters, are.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

__all__ = ["check_holder", "holding"]

_LOCK = threading.Lock()  # one claim at a time: two threads cannot both find a model free


class _Held(Protocol):
    holder: int | None


@torch.compiler.disable  # eager only: where dynamo falls back to a frame's eager run, not traced either
def check_holder(state: _Held) -> None:
    """Raises if another thread holds the model whose ``CacheState`` is ``state``."""
    holder = state.holder
    if holder is not None and holder != threading.get_ident():
        raise RuntimeError(
            f"this model's KV-caches and cache flag are in use by another thread (thread id {holder}, inside "
            "attn.generate, score_continuations, cached_inference, kv_cache_mode or local_kv_cache); a call from "
            "this thread would read or change that thread's caches. Give each thread its own model "
            "(copy.deepcopy(model)), or serialise the calls with a lock"
        )


@contextmanager
def holding(states: Sequence[_Held]) -> Iterator[None]:
    """Makes the current thread the holder of the models whose ``CacheState``s are ``states``
    for the block (nests in one thread); raises, changing nothing, if another thread holds one."""
    me = threading.get_ident()
    with _LOCK:
        for state in states:
            check_holder(state)
        previous = [state.holder for state in states]
        for state in states:
            state.holder = me
    try:
        yield
    finally:
        for state, before in zip(states, previous, strict=True):
            state.holder = before
