"""Sharded models on a CUDA device (NCCL): what tests/test_distributed.py checks on CPU with gloo.

Run on a machine with a CUDA GPU, from the repository root::

    python compat/cuda_distributed_check.py [--json out.json] [--device cuda|cpu]

One process, a process group of one rank (NCCL on CUDA; gloo with ``--device cpu``, to try the
script where there is no GPU). A one-rank mesh still runs FSDP2's unshard/reshard and DTensor's
dispatch, which is where inference mode goes wrong; it does not check that ranks agree (the
CPU tests do, with 2 processes). It measures, against this release's row of
``attn.compat.RELEASES``:

1. ``attn.distributed.probe_distributed_inference_mode`` on the device;
2. FSDP2 sharded by hand (``fully_shard`` on each layer and the root, nothing prepared), then a
   decode loop under plain ``torch.inference_mode()`` and a grad step after it: does the grad
   step fail with "Inplace update to inference tensor outside InferenceMode"?
3. three PPO cycles (``attn.generate``, no_grad scores, a multi-tensor SGD step, hand-written
   decode loops) on ``attn.distributed.shard_fsdp`` and on ``parallelize_tensor`` models (and a
   tied, q/k-normed, biased one for the latter) against the
   unsharded model on the same device (tests/distributed_worker.py's ``run_cycles`` and
   ``compare_cycles``): the same tokens, close scores, loss and weights, caches untouched.

Exit status 0 when every check held.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attn
import attn.distributed
from attn import compat
from tests import distributed_worker as worker


def on(device: str, model: attn.TransformerDecoder) -> attn.TransformerDecoder:
    return model.to(device)


def cycles(device: str, shard: Any, inference_mode_works: bool, config: attn.DecoderConfig) -> dict[str, Any]:
    """PPO cycles of a model sharded by ``shard`` against the unsharded one, on ``device``."""
    model, reference = on(device, worker.build_model(config)), on(device, worker.build_model(config))
    model = shard(model)
    outcome = worker.run_cycles(
        model, reference, [worker.PROMPTS[0]], 0, False, worker.user_loops(inference_mode_works)
    )
    outcome["initial_weights"] = {k: v.to(device) for k, v in outcome["initial_weights"].items()}
    try:
        worker.compare_cycles(outcome, compiled=False)
        return {"equal_to_unsharded": True}
    except AssertionError as error:
        return {"equal_to_unsharded": False, "error": str(error)[:500]}


def by_hand_inference_then_grad(device: str) -> dict[str, Any]:
    """fully_shard as a new user would, a plain inference-mode decode loop, then a grad pass."""
    fsdp = attn.distributed.fsdp_api()
    model = on(device, worker.build_model())
    for layer in model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    prompt = torch.tensor([worker.PROMPTS[0][1]], device=device)
    try:
        worker.decode_loop(model, prompt, torch.inference_mode)
        model(prompt).float().logsumexp(-1).mean().backward()
        return {"grad_step_after_inference_mode": "ran"}
    except Exception as error:
        return {"grad_step_after_inference_mode": f"failed: {type(error).__name__}: {str(error)[:200]}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(0)
    store = tempfile.mkdtemp()
    dist.init_process_group(
        backend, init_method=f"file://{store}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120)
    )
    row = compat.release_support()
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "table": {
            "fsdp_inference_mode": row.fsdp_inference_mode,
            "tensor_parallel_inference_mode": row.tensor_parallel_inference_mode,
        },
        "problems": [],
    }
    problems = results["problems"]
    tensor_parallel, tp_inference_mode = attn.distributed.parallelize_tensor, row.tensor_parallel_inference_mode
    steps = {
        "probe": lambda: attn.distributed.probe_distributed_inference_mode(args.device)._asdict(),
        "fsdp_by_hand": lambda: by_hand_inference_then_grad(args.device),
        "fsdp_shard_fsdp_cycles": lambda: cycles(args.device, attn.distributed.shard_fsdp, True, worker.CONFIG),
        "tensor_parallel_cycles": lambda: cycles(args.device, tensor_parallel, tp_inference_mode, worker.CONFIG),
        "tensor_parallel_qwen_cycles": lambda: cycles(
            args.device, tensor_parallel, tp_inference_mode, worker.QWEN_CONFIG
        ),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", attn.CompatWarning)
        for name, step in steps.items():
            try:
                results[name] = step()
            except Exception as error:
                failure = f"{type(error).__name__}: {error}"
                results[name] = {"error": failure, "traceback": traceback.format_exc()[-1500:]}
                problems.append(f"{name}: {type(error).__name__}: {str(error)[:200]}")
            print(f"{name}: {json.dumps(results[name], default=str)[:600]}")
    results["warnings"] = sorted({str(w.message)[:200] for w in caught})
    for field, expected in results["table"].items():
        measured = results["probe"].get(field)
        if measured is not None and measured != expected:
            problems.append(f"the probe measured {field}={measured}, the table says {expected}")
    for name in ("fsdp_shard_fsdp_cycles", "tensor_parallel_cycles", "tensor_parallel_qwen_cycles"):
        if not results[name].get("equal_to_unsharded"):
            problems.append(f"{name}: not equal to the unsharded model: {results[name]}")
    print("warnings:", results["warnings"])
    print("problems:", problems or "none")
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2, default=str)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
