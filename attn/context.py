"""Context managers that say, for a block of code, how forward passes treat the KV-cache.

Each restores the previous state on exit, also when the body raises, and they nest: the
innermost one wins. ``cached_passes`` and ``uncached_passes`` are where attn's own loops run
their passes; ``generation_fallback`` says when a sharded model cannot run them under
inference mode on the installed release.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from attn.compat import FSDP_INFERENCE_MODE_REASON, TENSOR_PARALLEL_INFERENCE_MODE_REASON, release_support
from attn.kv_cache import CacheState
from attn.policy import cache_policy, warn_once
from attn.swap import swapped_attribute
from attn.threads import holding

__all__ = [
    "cache_holder",
    "cached_inference",
    "cached_passes",
    "disable_kv_cache",
    "generation_fallback",
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


def _loaded_class(name: str, *modules: str) -> type | None:
    """``name`` from the first of ``modules`` already imported, else None (imports nothing)."""
    for module in modules:
        found = getattr(sys.modules.get(module), name, None)
        if found is not None:
            return found
    return None


def generation_fallback(model: nn.Module) -> str | None:
    """Why ``attn.generate`` runs ``model`` under ``torch.no_grad()`` with the explicit cache
    flag rather than under inference mode on the installed release, or ``None``.

    A model sharded with FSDP2 (``fully_shard``) or with tensor-parallel (DTensor) parameters,
    where the release table says that cannot run under inference mode. The passes that use
    the cache, and the tokens, are the same either way. Imports nothing: a model can hold FSDP2
    modules or DTensors only once torch.distributed's modules for them are loaded.
    """
    row = release_support(cache_policy().torch_version)
    fsdp_module = _loaded_class("FSDPModule", "torch.distributed.fsdp", "torch.distributed._composable.fsdp")
    sharded = fsdp_module is not None and any(isinstance(module, fsdp_module) for module in model.modules())
    if sharded and not row.fsdp_inference_mode:
        return f"a model sharded with FSDP2 cannot generate under inference mode ({FSDP_INFERENCE_MODE_REASON})"
    dtensor = _loaded_class("DTensor", "torch.distributed.tensor")
    split = dtensor is not None and any(isinstance(parameter, dtensor) for parameter in model.parameters())
    if split and not row.tensor_parallel_inference_mode:
        return (
            "a model with tensor-parallel (DTensor) parameters cannot generate under inference mode "
            f"({TENSOR_PARALLEL_INFERENCE_MODE_REASON})"
        )
    return None


def warn_generation_fallback(reason: str) -> None:
    """``attn.generate`` runs a sharded model under no_grad with the flag (``generation_fallback``)."""
    warn_once(
        f"generation-fallback: {reason.split(' cannot ')[0]}",  # once per kind of model
        f"on torch {cache_policy().torch_version}, {reason}. attn.generate and attn.score_continuations "
        "run it under torch.no_grad() "
        "with the explicit cache flag instead: the same tokens, the same cache. For a decode loop of "
        "your own on this model, do the same (`with torch.no_grad(), attn.kv_cache_mode(model):`); "
        "a model sharded with attn.distributed.shard_fsdp also takes plain torch.inference_mode() "
        "and attn.cached_inference passes.",
    )


def cached_passes(model: nn.Module) -> contextlib.AbstractContextManager[object]:
    """Where attn's own loops (``attn.generate``, ``attn.score_continuations``) run passes that
    use the cache: ``cached_inference(model)``, or, for a sharded model that cannot run under
    inference mode on the installed release (``generation_fallback``),
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
