"""Context managers that say, for a block of code, how forward passes treat the KV-cache.

Each restores the previous state on exit, also when the body raises, and they nest: the
innermost one wins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from attn.kv_cache import CacheState
from attn.policy import generation_fallback, warn_generation_fallback
from attn.swap import swapped_attribute
from attn.threads import holding

__all__ = [
    "cache_holder",
    "cached_inference",
    "cached_passes",
    "disable_kv_cache",
    "kv_cache_mode",
    "local_kv_cache",
    "uncached_passes",
]


def _cache_states(model: nn.Module) -> list[CacheState]:
    """The ``CacheState`` of every attn model in ``model``: one for a ``TransformerDecoder``
    (its layers share it), one per attention layer used on its own."""
    states = [m for m in model.modules() if isinstance(m, CacheState)]
    if not states:
        raise ValueError(f"{type(model).__name__} has no attn.MultiHeadAttention layers to set a cache mode on")
    return states


def cache_holder(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The current thread holds ``model``'s caches for the block (``attn.threads``): what
    ``attn.generate`` does around its cache operations and passes."""
    return holding(_cache_states(model))


@contextmanager
def kv_cache_mode(model: nn.Module, mode: bool = True) -> Iterator[nn.Module]:
    """Sets the explicit KV-cache flag on every attention layer of ``model``.

    ``mode=True``: grad-free passes use the cache, under every policy, with no
    inference-mode test (so they compile with ``fullgraph=True``). A grad-enabled pass
    inside raises. ``mode=False``: no pass touches the cache, under any mode or policy.

    Example::

        with attn.kv_cache_mode(model), torch.no_grad():
            model(prompt)  # writes the cache
    """
    if not isinstance(mode, bool):
        raise ValueError(f"kv_cache_mode mode must be True or False, got {mode!r}")
    states = _cache_states(model)
    if mode and not all(state.caches for state in states):
        raise RuntimeError(
            "kv_cache_mode(model, True) needs caches: call model.setup_caches(batch_size, "
            "max_seq_len) first, or use attn.local_kv_cache(model, ...)"
        )
    with holding(states), swapped_attribute(states, "mode", mode):
        yield model


def disable_kv_cache(model: nn.Module) -> contextlib.AbstractContextManager[nn.Module]:
    """No forward pass inside touches the cache, under any mode or policy.

    Use it for scoring under ``torch.inference_mode()`` (an eval log-likelihood task)::

        with torch.inference_mode(), attn.disable_kv_cache(model):
            logprobs = model(candidates).log_softmax(-1)
    """
    return kv_cache_mode(model, False)


@contextmanager
def cached_inference(model: nn.Module) -> Iterator[nn.Module]:
    """``torch.inference_mode()`` plus the flag: passes inside use the cache.

    Plain ``torch.inference_mode()`` uses the cache too (by default); this spelling adds
    the explicit flag, which needs no inference-mode test: use it where a compiled forward
    must not graph-break (``fullgraph=True``, ``torch.export``, CUDA graphs) and to continue
    a sequence on purpose.
    """
    with torch.inference_mode(), kv_cache_mode(model, True):
        yield model


def cached_passes(model: nn.Module) -> contextlib.AbstractContextManager[object]:
    """Where attn's own loops (``attn.generate``, ``attn.score_continuations``) run passes that
    use the cache: ``cached_inference(model)``, or, for a sharded model that cannot run under
    inference mode on the installed release (``attn.policy.generation_fallback``),
    ``torch.no_grad()`` with the flag: the same passes use the cache, warned once at the
    caller's line."""
    reason = generation_fallback(model)
    if reason is None:
        return cached_inference(model)
    warn_generation_fallback(reason)
    return _no_grad_with_flag(model)


@contextmanager
def _no_grad_with_flag(model: nn.Module) -> Iterator[None]:
    with torch.no_grad(), kv_cache_mode(model, True):
        yield


@contextmanager
def uncached_passes(model: nn.Module) -> Iterator[nn.Module]:
    """Where attn's own scoring runs passes that must not touch the cache (the lm-eval
    adapter's full passes): ``torch.inference_mode()`` inside ``disable_kv_cache(model)``, or
    ``torch.no_grad()`` for a sharded model that cannot run under inference mode on the
    installed release (``cached_passes``' reason, warned once)."""
    reason = generation_fallback(model)
    if reason is not None:
        warn_generation_fallback(reason)
    with torch.inference_mode() if reason is None else torch.no_grad(), disable_kv_cache(model):
        yield model


@contextmanager
def local_kv_cache(
    model: nn.Module,
    *,
    batch_size: int,
    max_seq_len: int,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[nn.Module]:
    """Sets up caches on entry and tears them down on exit.

    Raises:
        RuntimeError: the model already has caches (they would be lost on exit).
    """
    with holding(_cache_states(model)):
        if model.caches_are_setup():
            raise RuntimeError(
                "local_kv_cache: the model already has caches set up and would lose them on exit; "
                "call model.teardown_caches() first, or use the existing caches"
            )
        model.setup_caches(batch_size, max_seq_len, dtype=dtype, device=device)
        try:
            yield model
        finally:
            model.teardown_caches()
