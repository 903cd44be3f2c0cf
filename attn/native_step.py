"""The native decode step: an eager decode step's decoder layers as ``attn::decode_layers`` calls.

Shapes: b = batch, e = embed dim.

Where ``TransformerDecoder.native_layers`` says a decode step's layers are native (a CPU with
AVX512-BF16, or AVX2 and no AVX512-BF16, a model of the layers the op computes), every run of
consecutive layers that are the plain layer the op computes is one call to ``attn::decode_layers``;
a layer with a hook or an adapter on one of its modules runs its own modules, so the hook fires and
the adapter adds its part. A run is cut where the plan changes (the windowed layers of a model
whose windows apply to some layers only).

The step is built once (``NativeStep``) and reused while nothing it read has changed: every
decode step compares, object by object, the layers' modules, parameters, hooks and norm and
attention settings with what it was built from (``NativeStep.current``: about 60 us for 30
layers), and rebuilds on any difference. One call a layer, its arguments gathered each step, had
cost 0.4-0.6 ms more a step on a thin 30-layer model, whose step is its overheads (1.22-1.55
against 0.81-0.97 ms, best of 5 runs of 100 steps, old and new in turn; bf16, 2 threads, AMD EPYC
Zen 4); at the SmolLM2-135M shape the gain was within that machine's noise in one set of rounds
and 1-2 ms in another (``docs/performance.md``).
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from attn.kv_cache import KVCache
from attn.native import amx_from_rows, avx2_layers
from attn.norm import RMSNorm
from attn.plan import PassPlan

__all__ = ["NativeStep", "global_hooks"]


class _Run(NamedTuple):
    """Consecutive layers that one ``attn::decode_layers`` call computes, or (``module`` set)
    one layer that runs its own modules."""

    local: bool  # the layers take the plan's local part (PassPlan.local)
    caches: tuple[KVCache, ...]
    weights: tuple[torch.Tensor, ...]
    biases: tuple[torch.Tensor | None, ...]
    eps: float
    scale: float
    module: nn.Module | None = None


def global_hooks() -> bool:
    """Are forward hooks registered for every module (``register_module_forward_hook``, a
    profiler's or a tracker's)? A native call would skip them, so the step runs the modules."""
    return bool(module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks)


class _Watch:
    """What a ``NativeStep`` was built from, to tell cheaply whether it still holds: the
    decoder's layer list and final norm (its type, hooks, weight, ``eps`` and ``unit_offset``),
    and for each layer, the modules ``DecoderLayer.native_modules`` names: their types, how
    many forward hooks and instance attributes (one more with a ``forward`` set on the
    instance) each has, how many children each container has, and by identity the
    entries read: the containers' children, the leaves' parameters, the norms' ``eps`` and
    attention's ``scale`` and ``head_dim`` (new objects when assigned). The step holds every
    object compared, so none is freed while it is compared against."""

    def __init__(self, model: nn.Module) -> None:
        layers, norm = model.layers, model.norm
        self.modules: list[nn.Module] = [norm]
        sized: list[dict] = [layers._modules]
        read: list[tuple[dict, str]] = [(model._modules, "layers"), (model._modules, "norm")]
        read += [(layers._modules, key) for key in layers._modules]
        read += [(norm._parameters, "weight"), (norm.__dict__, "eps"), (norm.__dict__, "unit_offset")]
        for layer in layers:
            containers, leaves = layer.native_modules()
            self.modules += containers + leaves
            sized += [m._modules for m in containers]
            for entries in [m._modules for m in containers] + [m._parameters for m in leaves]:
                read += [(entries, key) for key in entries]
            read += [(m.__dict__, "eps") for m in leaves if isinstance(m, RMSNorm)]
            read += [(containers[1].__dict__, "scale"), (containers[1].__dict__, "head_dim")]
        # The instances' own attributes: one more where a forward is set on one (accelerate's hooks).
        sized += [d for m in self.modules for d in (m._forward_hooks, m._forward_pre_hooks, m.__dict__)]
        self.sized = sized
        self.dicts = [entries for entries, _ in read]
        self.keys = [key for _, key in read]
        self.seen = (list(map(len, sized)), list(map(type, self.modules)), list(map(dict.get, self.dicts, self.keys)))

    def unchanged(self) -> bool:
        """Is every object still in its place? About 60 us for 30 layers."""
        sizes, types, entries = self.seen
        return (
            list(map(len, self.sized)) == sizes
            and list(map(type, self.modules)) == types
            and all(map(operator.is_, map(dict.get, self.dicts, self.keys), entries))
        )


class NativeStep:
    """The decoder layers of an eager decode step, as runs of ``attn::decode_layers`` calls and
    layers that run their own modules (the module docstring says which), and the final norm
    where the last call can take it (``normed``); reusable while ``current()``.

    Args:
        model: the decoder (``attn.decoder.TransformerDecoder``): its ``layers``
            (``DecoderLayer``), ``local_layers`` (which take the plan's local part), ``norm``
            (the final RMSNorm) and ``native_final_norm()``.
    """

    def __init__(self, model: nn.Module) -> None:
        self._watch = _Watch(model)
        self.runs: list[_Run] = []
        for layer, local in zip(model.layers, model.local_layers, strict=True):
            parts = layer.native_parts()
            if parts is None:
                self.runs.append(_Run(local, (), (), (), 0.0, 0.0, layer))
                continue
            weights, biases, eps = parts
            attention = layer.attn
            scale = attention.head_dim**-0.5 if attention.scale is None else attention.scale
            last = self.runs[-1] if self.runs else None
            if (
                last is not None
                and last.module is None
                and (last.local, last.eps, last.scale) == (local, eps, scale)
                and len(last.weights) // len(last.caches) == len(weights)
            ):
                self.runs[-1] = last._replace(
                    caches=(*last.caches, attention.kv_cache),
                    weights=(*last.weights, *weights),
                    biases=(*last.biases, *biases),
                )
            else:
                self.runs.append(_Run(local, (attention.kv_cache,), tuple(weights), tuple(biases), eps, scale))
        last = self.runs[-1] if self.runs else None
        weight = None if last is None or last.module is not None else model.native_final_norm()
        fits = weight is not None and weight.dtype == last.weights[0].dtype and weight.shape == last.weights[0].shape
        self.final_norm = weight if fits else None  # of the layers' dtype and width, as the op takes it
        self.final_eps = model.norm.eps if self.final_norm is not None else 0.0

    @property
    def normed(self) -> bool:
        """Does the step return the final norm's output (its last call ran it), rather than the
        last layer's?"""
        return self.final_norm is not None

    def __reduce__(self) -> tuple[type, tuple[()]]:
        """A copy or a pickle of the model holds no step (``NoneType()`` is ``None``): it is a
        cache of the model's objects, rebuilt from the copy's own on its first step."""
        return type(None), ()

    def current(self) -> bool:
        """Does the step still compute the model's layers: is nothing it was built from changed?"""
        return self._watch.unchanged()

    def __call__(self, h: torch.Tensor, plan: PassPlan, rotations: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``h`` (b, 1, e) through every layer, each run's keys and values written at
        ``plan.slots``; ``rotations``: the plan's and its local part's, contiguous."""
        local = plan.local or plan
        amx, avx2 = amx_from_rows(), avx2_layers()
        group, shared = plan.shared or (1, 0)  # the rows a fork left equal
        last = self.runs[-1]
        for run in self.runs:
            part = local if run.local else plan
            if run.module is not None:
                h = run.module(h, part)
                continue
            final_norm = self.final_norm if run is last else None
            h = torch.ops.attn.decode_layers(
                h,
                run.weights,
                run.biases,
                [cache._buffers["k_cache"] for cache in run.caches],
                [cache._buffers["v_cache"] for cache in run.caches],
                part.slots,
                part.mask,
                rotations[run.local],
                run.eps,
                run.scale,
                amx,
                final_norm,
                self.final_eps,
                avx2,
                group,
                shared,
            )
        return h
