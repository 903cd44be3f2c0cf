"""The decoder past one process: FSDP2 and tensor parallelism, on torch.distributed.

Shapes: b = rows on this rank, h = query heads, h_kv = kv heads, L = cache slots, d = head
dim, n = ranks in the mesh.

``shard_fsdp`` shards every parameter across the ranks (``fully_shard`` on each decoder
layer, then on the model): each rank generates, scores and trains on rows of its own, and
its cache holds every head of its rows, (b, h_kv, L, d). ``parallelize_tensor`` splits the
heads: q/k/v and gate/up column-wise, o and down row-wise; every rank runs the same rows,
holds h / n query heads and h_kv / n kv heads, and its cache those, (b, h_kv / n, L, d).
The cache rule is the one of a single process (``attn.policy.uses_cache``); where a release
cannot run a sharded model under inference mode, ``attn.generate`` runs it under
``torch.no_grad()`` with the explicit flag (``attn.context.generation_fallback``).

Import it as ``attn.distributed`` (``import attn`` does not). It costs no import time of its
own: the torch.distributed modules it needs are loaded by ``torch._dynamo``, which ``import
attn`` loads.

Example (every rank, after ``torch.distributed.init_process_group``)::

    model = attn.distributed.shard_fsdp(attn.TransformerDecoder(config))
    optimizer = torch.optim.AdamW(model.parameters())
    out = attn.generate(model, my_prompts, max_new_tokens=64)   # this rank's prompts
    loss = ppo_loss(model, out)                                 # grad pass: no cache
    loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from attn import compat
from attn.decoder import TransformerDecoder
from attn.errors import first_line

__all__ = [
    "DistributedProbeResult",
    "FsdpApi",
    "fsdp_api",
    "fsdp_runs_on",
    "gloo_reduce_scatter_averages",
    "parallelize_tensor",
    "probe_distributed_inference_mode",
    "shard_fsdp",
]


def _default_mesh(model: TransformerDecoder) -> DeviceMesh:
    """All ranks of the default process group, on the model's device type."""
    device = model.tok_embeddings.weight.device
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _check_unsharded(model: Any, caller: str) -> None:
    if not isinstance(model, TransformerDecoder):
        raise TypeError(f"{caller} takes an attn.TransformerDecoder, got {type(model).__name__}")
    if not dist.is_initialized():
        raise RuntimeError(f"{caller} needs torch.distributed: call torch.distributed.init_process_group() first")
    if any(isinstance(module, fsdp_api().FSDPModule) for module in model.modules()):
        raise RuntimeError(f"{caller}: the model is sharded with FSDP2 already")
    if any(isinstance(parameter, DTensor) for parameter in model.parameters()):
        raise RuntimeError(f"{caller}: the model's parameters are split across ranks already (DTensor)")


def shard_fsdp(
    model: TransformerDecoder, *, mesh: DeviceMesh | None = None, **fully_shard_kwargs: Any
) -> TransformerDecoder:
    """Shards ``model`` with FSDP2: ``fully_shard`` on every decoder layer, then on the model.

    Every rank calls it, on a model built alike (the same config; the weights of rank 0 are
    not broadcast, so build them from one seed or load one checkpoint). The model is changed
    in place and returned. Where the release cannot unshard under inference mode
    (``attn.compat.RELEASES``, ``fsdp_inference_mode``), FSDP2's unsharded parameters are
    allocated here, outside inference mode, one module at a time, so later passes under
    ``torch.inference_mode()`` or ``attn.cached_inference`` do not turn them into inference
    tensors that the grad step could not refill. ``attn.generate`` runs under
    ``torch.no_grad()`` with the flag there anyway, whoever sharded the model. On CPU, where
    gloo's reduce-scatter sums when asked to average (torch 2.8 and before,
    ``gloo_reduce_scatter_averages``), gradients are reduced in float64, so the
    ranks' gradients are averaged as on other devices.

    Args:
        model: an unsharded ``TransformerDecoder``; caches set up before stay as they are (each
            rank's rows, every head).
        mesh: a device mesh to shard over; default: every rank, the model's device type.
        **fully_shard_kwargs: passed to every ``fully_shard`` call (``reshard_after_forward``,
            ``mp_policy``, ``offload_policy``).

    Returns:
        The model, now an FSDP2 module (``isinstance(model, attn.TransformerDecoder)`` holds).

    Raises:
        RuntimeError: torch.distributed is not initialized, the model is sharded already, or
            FSDP2 does not run on the device type on this release (CPU before torch 2.7); the
            model is unchanged.
    """
    _check_unsharded(model, "shard_fsdp")
    mesh = mesh or _default_mesh(model)
    if not fsdp_runs_on(mesh.device_type):
        raise RuntimeError(
            f"FSDP2 does not run on {mesh.device_type} on torch {torch.__version__} (its first forward "
            "fails: it needs torch.cpu.Stream.record_event, torch 2.7 on); use torch >= 2.7, or CUDA devices"
        )
    fsdp = fsdp_api()
    if mesh.device_type == "cpu" and not gloo_reduce_scatter_averages(mesh.get_group(mesh.ndim - 1)):
        # FSDP2 averages fp32/bf16 gradients with ReduceOp.AVG, which gloo sums there; any other
        # reduce dtype takes its sum-then-divide path.
        policy = fully_shard_kwargs.get("mp_policy") or fsdp.MixedPrecisionPolicy()
        fully_shard_kwargs["mp_policy"] = dataclasses.replace(policy, reduce_dtype=torch.float64)
    for layer in model.layers:
        fsdp.fully_shard(layer, mesh=mesh, **fully_shard_kwargs)
    fsdp.fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    if not compat.release_support().fsdp_inference_mode:
        with torch.inference_mode(False), torch.no_grad():
            for module in model.modules():
                if isinstance(module, fsdp.FSDPModule):  # not recursive: one module's parameters at a time
                    module.unshard()
                    module.reshard()
    return model


def _decoder_layer_plan() -> dict[str, Any]:
    """The tensor-parallel plan of one decoder layer, by submodule name: each rank computes
    its heads and its part of the MLP's hidden units; o and down sum the parts (an
    all-reduce). Inputs and outputs of the layer are ordinary, replicated tensors."""
    return {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _dtensor_inputs(placement: Placement) -> Callable[[nn.Module, tuple[Any, ...], DeviceMesh], tuple[Any, ...]]:
    """A ``distribute_module`` input_fn: ordinary tensor inputs become DTensors placed so."""

    def input_fn(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(x, mesh, [placement], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    return input_fn


def _local_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _replicate_the_rest(model: TransformerDecoder, mesh: DeviceMesh) -> None:
    """Makes every parameter the plan leaves whole (embedding, norms, output layer) a replicated
    DTensor, computed on DTensor inputs and handing back ordinary tensors.

    Optimizers need it: their multi-tensor (``foreach``) step, the default on CUDA, takes a
    device's parameters in one call and refuses a mix of DTensors and tensors. The q/k norms
    see this rank's heads only, (b, s, h / n, d), so their inputs are sharded on the head dim
    and DTensor sums their weights' gradients over the ranks (each rank's is partial). With
    tied embeddings the decoder multiplies the final norm's output by the embedding's weight,
    so that norm hands back its DTensor and the model's output is made ordinary at the end.
    """
    tied = model.output is None
    head_norms = [norm for layer in model.layers for norm in (layer.attn.q_norm, layer.attn.k_norm)]
    for module in list(model.modules()):
        if all(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            continue  # parallelized by the plan, or no parameters of its own
        placement = Shard(2) if any(module is norm for norm in head_norms) else Replicate()
        distribute_module(
            module,
            mesh,
            input_fn=_dtensor_inputs(placement),
            output_fn=None if tied and module is model.norm else _local_output,
        )
    if tied:
        model.register_forward_hook(lambda module, inputs, output: _local_output(module, output, mesh))


def parallelize_tensor(model: TransformerDecoder, mesh: DeviceMesh | None = None) -> TransformerDecoder:
    """Splits every decoder layer's heads and MLP across the ranks of ``mesh`` (tensor parallelism).

    q/k/v and gate/up are column-wise parallel, o and down row-wise
    (``torch.distributed.tensor.parallel``); the embedding, the norms, RoPE and the output
    layer stay whole on every rank. Each attention layer then holds ``num_heads / n`` query
    heads and ``num_kv_heads / n`` kv heads (set on the module, as torchtitan does), and
    ``setup_caches`` sizes each rank's cache from those. Every rank runs the same tokens; the
    logits are the same on every rank.

    Every rank calls it, on a model built alike. The model is changed in place and returned.

    Args:
        model: an unsharded ``TransformerDecoder`` without caches.
        mesh: a 1-D device mesh of the n ranks that split the heads; default: every rank, the
            model's device type.

    Raises:
        ValueError: n does not divide the kv heads or the MLP width; the model is unchanged.
        RuntimeError: torch.distributed is not initialized, or the model has caches or is sharded.
    """
    _check_unsharded(model, "parallelize_tensor")
    if model.caches_are_setup():
        raise RuntimeError(
            "parallelize_tensor: the model has KV-caches set up, sized for all its heads; call "
            "model.teardown_caches() first, and setup_caches() after (it sizes them from each rank's heads)"
        )
    mesh = mesh or _default_mesh(model)
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_tensor takes a 1-D mesh of the ranks that split the heads, got {mesh.ndim}-D")
    ranks, config = mesh.size(), model.config
    if config.num_kv_heads % ranks or config.hidden_dim % ranks:
        raise ValueError(
            f"tensor parallelism over {ranks} ranks needs num_kv_heads ({config.num_kv_heads}) and "
            f"hidden_dim ({config.hidden_dim}) divisible by {ranks}; use a mesh of a divisor of both"
        )
    for layer in model.layers:
        parallelize_module(layer, mesh, _decoder_layer_plan())
        layer.attn.num_heads = config.num_heads // ranks  # this rank's heads: (b, s, h / n, d)
        layer.attn.num_kv_heads = config.num_kv_heads // ranks
    _replicate_the_rest(model, mesh)
    return model


# -- what the installed release offers (detected, not looked up) -----------------------------


class FsdpApi(NamedTuple):
    """FSDP2's names, wherever the installed release keeps them."""

    fully_shard: Any
    FSDPModule: type
    MixedPrecisionPolicy: type


def fsdp_api() -> FsdpApi:
    """FSDP2's ``fully_shard``, ``FSDPModule`` and ``MixedPrecisionPolicy``: in
    ``torch.distributed.fsdp`` from torch 2.6, in ``torch.distributed._composable.fsdp``
    before (detected by import, not looked up).

    Imported when first asked for, by the code that shards a model.
    """
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    return FsdpApi(fully_shard, FSDPModule, MixedPrecisionPolicy)


def gloo_reduce_scatter_averages(group: Any) -> bool:
    """Does ``reduce_scatter_tensor(op=ReduceOp.AVG)`` average on this gloo process group?

    Detected with one tiny reduce-scatter (a collective: every rank of ``group`` calls it).
    Measured on CPU with 2 ranks: gloo sums instead, silently, on torch 2.5.1 to 2.8.0, and
    averages on 2.13.0 and 2.15.0; FSDP2 reduces fp32 and bf16 gradients with AVG, so there
    it sums the ranks' gradients where it should average them.
    """
    size = dist.get_world_size(group)
    out = torch.zeros(1)
    dist.reduce_scatter_tensor(out, torch.ones(size), op=dist.ReduceOp.AVG, group=group)
    return bool(out.item() == 1.0)


def fsdp_runs_on(device_type: str) -> bool:
    """Does FSDP2 run on this device type? Detected, not looked up: on CPU it needs
    ``torch.cpu.Stream.record_event`` (torch 2.7 on). Before, it fails on CPU in its first
    forward: "FSDP requires CUDA for streams" (2.5), "'Stream' object has no attribute
    'record_event'" (2.6)."""
    return device_type != "cpu" or hasattr(torch.cpu.Stream, "record_event")


class DistributedProbeResult(NamedTuple):
    """Outcome of ``probe_distributed_inference_mode`` on the installed torch."""

    fsdp_runs: bool
    """Did FSDP2 run a forward and a grad step on the device (no inference mode)?"""
    fsdp_inference_mode: bool
    """Did a grad step after an inference-mode forward work too?"""
    tensor_parallel_inference_mode: bool
    """Did a column-wise parallel linear run under inference mode?"""
    errors: tuple[str, ...]
    """The first line of each error met, in order."""


def probe_distributed_inference_mode(device: torch.device | str = "cpu") -> DistributedProbeResult:
    """Runs tiny sharded linears under inference mode, then a grad step, on ``device``.

    A collective: every rank of the default process group must call it. FSDP2 (two linears,
    ``fully_shard``-ed one by one and together, as a decoder's layers and root are): a grad
    step alone, then an inference-mode forward followed by grad steps. Tensor parallelism (one
    column-wise linear without bias, as the decoder's are): an inference-mode forward.

    Raises:
        RuntimeError: torch.distributed has no default process group.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if not dist.is_initialized():
        raise RuntimeError(
            "probe_distributed_inference_mode needs torch.distributed: call "
            "torch.distributed.init_process_group() on every rank first, then the probe on every rank"
        )
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fully_shard = fsdp_api().fully_shard
    x = torch.ones(2, 3, 8, device=device)  # (b, s, e); the same on every rank
    errors = []

    def fsdp_grad_step(inference_first: bool) -> bool:
        model = nn.Sequential(nn.Linear(8, 8, device=device), nn.Linear(8, 8, device=device))
        for module in (*model, model):  # the root keeps its parameters unsharded after a forward
            fully_shard(module, mesh=mesh)
        try:
            if inference_first:
                with torch.inference_mode():
                    model(x)
            for _ in range(2):
                model(x).sum().backward()
        except Exception as error:
            errors.append(first_line(error))
            return False
        return True

    fsdp_runs = fsdp_grad_step(inference_first=False)
    fsdp_inference_mode = fsdp_runs and fsdp_grad_step(inference_first=True)
    linear = parallelize_module(nn.Linear(8, 8, bias=False, device=device), mesh, ColwiseParallel())
    try:
        with torch.inference_mode():
            linear(x)
        tensor_parallel_inference_mode = True
    except Exception as error:
        errors.append(first_line(error))
        tensor_parallel_inference_mode = False
    return DistributedProbeResult(fsdp_runs, fsdp_inference_mode, tensor_parallel_inference_mode, tuple(errors))
