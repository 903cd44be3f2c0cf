"""attn.distributed compiled: the PPO loop on a ``torch.compile``-d sharded model.

One launch of 2 CPU processes (gloo) runs three PPO cycles on each compiled model and on
the unsharded eager model (``tests/distributed_worker.py``): FSDP2 applied by hand with
``fully_shard`` on every layer and the root, as a new user would (so only ``attn.generate``'s
fallback stands between generation and the grad step), and tensor parallelism. The backend
is "eager" with ``dynamic=False``: "aot_eager" fails on tensor-parallel models on torch 2.6,
2.7 and 2.15, and symbolic shapes fail in DTensor on 2.5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attn.distributed
from tests.distributed_worker import compare_cycles, launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = str(tmp_path_factory.mktemp("distributed_compile"))
    return launch(directory, ["fsdp_by_hand_compiled", "tensor_parallel_compiled"])


@pytest.mark.parametrize("rank", [0, 1])
def test_compiled_fsdp_ppo_cycles_equal_the_unsharded_model(ranks: list[dict[str, Any]], rank: int) -> None:
    """Generation, no_grad scores, loss and updated weights as unsharded, three cycles; every
    graph compiled in the first cycle."""
    if not attn.distributed.fsdp_runs_on("cpu"):
        pytest.skip(f"FSDP2 does not run on CPU on torch {torch.__version__}")
    compare_cycles(ranks[rank]["fsdp_by_hand_compiled"], compiled=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_compiled_tensor_parallel_ppo_cycles_equal_the_unsharded_model(ranks: list[dict[str, Any]], rank: int) -> None:
    compare_cycles(ranks[rank]["tensor_parallel_compiled"], compiled=True)
