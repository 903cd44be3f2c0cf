"""attn.distributed: the PPO loop on a model sharded with FSDP2 or split by tensor parallelism.

The slow tests launch 2 processes on the CPU (gloo) once per file (``tests/distributed_worker.py``
runs in them): each runs three PPO cycles (generation, no_grad scoring, one SGD step) on a
sharded model and on the unsharded model in the same process, and the tests here compare
them. Compiled runs are in tests/test_distributed_compile.py. The other tests need no
process group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import attn
import attn.distributed
from attn import compat
from tests import distributed_worker
from tests.conftest import tiny_model
from tests.distributed_worker import CONFIG, NEW_TOKENS, PROMPTS, compare_cycles, launch

RANKS = [0, 1]
ROW = compat.release_support()


@pytest.mark.parametrize(
    ("version", "fsdp", "tensor_parallel"),
    [
        ("2.5.1", False, False),
        ("2.6.0", False, True),
        ("2.7.1", False, True),
        ("2.8.0", False, True),
        ("2.13.0+cpu", False, True),
        ("2.16.0.dev20261101", False, True),
    ],
)
def test_release_table_says_where_sharded_models_take_inference_mode(
    version: str, fsdp: bool, tensor_parallel: bool
) -> None:
    row = compat.release_support(version)
    assert (row.fsdp_inference_mode, row.tensor_parallel_inference_mode) == (fsdp, tensor_parallel)


def test_an_unsharded_model_generates_under_inference_mode() -> None:
    assert attn.context.generation_fallback(tiny_model()) is None


@pytest.mark.parametrize("name", ["shard_fsdp", "parallelize_tensor"])
def test_sharding_needs_a_process_group(name: str) -> None:
    import attn.distributed

    model = tiny_model()
    with pytest.raises(RuntimeError, match="init_process_group"):
        getattr(attn.distributed, name)(model)
    assert not any(hasattr(p, "full_tensor") for p in model.parameters())


# -- 2 processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's results: the probe, the refusals, FSDP2 and tensor-parallel PPO cycles."""
    names = [
        "probe",
        "refusals",
        "fsdp",
        "fsdp_by_hand",
        "fsdp_scoring_first",
        "fsdp_by_hand_scoring_first",
        "tensor_parallel",
        "tensor_parallel_qwen",
    ]
    return launch(str(tmp_path_factory.mktemp("distributed")), names)


def fsdp_outcome(results: dict[str, Any], name: str = "fsdp") -> dict[str, Any]:
    if not attn.distributed.fsdp_runs_on("cpu"):
        pytest.skip(f"FSDP2 does not run on CPU on torch {torch.__version__}: shard_fsdp refuses (tested)")
    return results[name]


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_probe_agrees_with_the_release_table(ranks: list[dict[str, Any]], rank: int) -> None:
    probe = ranks[rank]["probe"]
    assert "error" not in probe, probe.get("traceback")
    assert probe["fsdp_runs"] is attn.distributed.fsdp_runs_on("cpu"), probe["errors"]
    if probe["fsdp_runs"]:
        assert probe["fsdp_inference_mode"] is ROW.fsdp_inference_mode, probe["errors"]
        if not ROW.fsdp_inference_mode:
            assert any("Inplace update to inference tensor" in e for e in probe["errors"]), probe["errors"]
    assert probe["tensor_parallel_inference_mode"] is ROW.tensor_parallel_inference_mode, probe["errors"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_fsdp_ppo_cycles_equal_the_unsharded_model(ranks: list[dict[str, Any]], rank: int) -> None:
    """shard_fsdp: the same greedy tokens, close scores, loss and updated weights, three
    cycles; after each, a hand-written decode loop (plain inference mode, cached_inference,
    no_grad with the flag in turn) gives the unsharded tokens and a grad pass after it runs."""
    outcome = fsdp_outcome(ranks[rank])
    compare_cycles(outcome, compiled=False)
    assert [c["loop"] for c in outcome["cycles"]] == [
        "torch.inference_mode()",
        "attn.cached_inference",
        "no_grad + kv_cache_mode",
    ]


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_fsdp_by_hand_ppo_cycles_equal_the_unsharded_model(ranks: list[dict[str, Any]], rank: int) -> None:
    """The issue's new user: fully_shard on every layer and the root, then attn.generate and
    the grad step; generate's fallback alone keeps the grad step working. Their own decode
    loops run under no_grad with the flag (the warning says so)."""
    outcome = fsdp_outcome(ranks[rank], "fsdp_by_hand")
    compare_cycles(outcome, compiled=False)
    assert {c["loop"] for c in outcome["cycles"]} == {"no_grad + kv_cache_mode"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp_scoring_first", "fsdp_by_hand_scoring_first"])
@pytest.mark.parametrize("rank", RANKS)
def test_fsdp_grad_free_passes_equal_the_unsharded_model(ranks: list[dict[str, Any]], rank: int, name: str) -> None:
    """attn.context.uncached_passes (the lm-eval adapter's) and attn.score_continuations as the
    first passes of a sharded model, then a grad pass (the worker runs it: it failed with
    "Inplace update to inference tensor outside InferenceMode" while scoring ran under
    inference mode on a model sharded by hand)."""
    outcome = fsdp_outcome(ranks[rank], name)
    assert "error" not in outcome, outcome.get("traceback")
    torch.testing.assert_close(
        torch.tensor([score.logprob for score in outcome["scores"]]),
        torch.tensor([score.logprob for score in outcome["ref_scores"]]),
    )
    assert [s.greedy for s in outcome["scores"]] == [s.greedy for s in outcome["ref_scores"]]
    torch.testing.assert_close(outcome["full"], outcome["ref_full"])


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_fsdp_cache_holds_every_head_of_the_rank_rows(ranks: list[dict[str, Any]], rank: int) -> None:
    rows, width = len(PROMPTS[rank]), max(map(len, PROMPTS[rank]))
    for cycle in fsdp_outcome(ranks[rank])["cycles"]:
        assert cycle["cache_shape"] == (rows, CONFIG.num_kv_heads, width + NEW_TOKENS, CONFIG.head_dim)


@pytest.mark.slow
def test_shard_fsdp_refuses_cpu_where_fsdp2_cannot_run(ranks: list[dict[str, Any]]) -> None:
    if attn.distributed.fsdp_runs_on("cpu"):
        pytest.skip(f"FSDP2 runs on CPU on torch {torch.__version__}")
    assert ranks[0]["fsdp"]["error"].startswith("RuntimeError: FSDP2 does not run on cpu on torch")
    assert not ranks[0]["probe"]["fsdp_runs"]


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_generation_falls_back_with_one_warning(ranks: list[dict[str, Any]], rank: int) -> None:
    """One warning per kind of sharded model that generates under no_grad with the flag (where
    FSDP2 cannot run on CPU, the model sharded by hand warns before torch's error)."""
    warned = [w for w in ranks[rank]["warnings"] if "attn.score_continuations run it under torch.no_grad()" in w]
    expected = []
    if not ROW.fsdp_inference_mode:
        expected.append("a model sharded with FSDP2")
    if not ROW.tensor_parallel_inference_mode:
        expected.append("a model with tensor-parallel (DTensor) parameters")
    assert [w.split(", ", 1)[1].split(" cannot ")[0] for w in warned] == expected, warned
    assert set(ranks[rank]["warned_at"]) <= {distributed_worker.__file__}, "warnings point at the caller's line"


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_tensor_parallel_ppo_cycles_equal_the_unsharded_model(ranks: list[dict[str, Any]], rank: int) -> None:
    """parallelize_tensor: both ranks run the same rows; the same checks as FSDP2's, the
    hand-written loops limited to no_grad with the flag where inference mode fails (torch < 2.6)."""
    outcome = ranks[rank]["tensor_parallel"]
    compare_cycles(outcome, compiled=False)
    loops = {c["loop"] for c in outcome["cycles"]}
    assert ("torch.inference_mode()" in loops) is ROW.tensor_parallel_inference_mode


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_tensor_parallel_qwen_features_equal_the_unsharded_model(ranks: list[dict[str, Any]], rank: int) -> None:
    """Tied embeddings, q/k/v biases and q/k norms under tensor parallelism: the q/k norms see
    each rank's heads only, so their weights' gradients must be summed over the ranks (without
    it the updated q_norm weights were 0.02 off after one step); the optimizer's multi-tensor
    step takes every parameter at once (it refused the embedding and norms as plain tensors)."""
    compare_cycles(ranks[rank]["tensor_parallel_qwen"], compiled=False)


@pytest.mark.slow
@pytest.mark.parametrize("rank", RANKS)
def test_tensor_parallel_cache_holds_the_rank_kv_heads(ranks: list[dict[str, Any]], rank: int) -> None:
    rows, width = len(PROMPTS[0]), max(map(len, PROMPTS[0]))
    for cycle in ranks[rank]["tensor_parallel"]["cycles"]:
        assert cycle["cache_shape"] == (rows, CONFIG.num_kv_heads // 2, width + NEW_TOKENS, CONFIG.head_dim)


@pytest.mark.slow
def test_refusals_name_the_values_and_change_nothing(ranks: list[dict[str, Any]]) -> None:
    refusals = ranks[0]["refusals"]
    assert refusals["tensor_parallel_mqa"] == (
        "ValueError",
        "tensor parallelism over 2 ranks needs num_kv_heads (1) and hidden_dim (48) divisible by 2; "
        "use a mesh of a divisor of both",
    )
    assert refusals["mqa_unchanged"] == [1] * CONFIG.num_layers
    kind, message = refusals["tensor_parallel_with_caches"]
    assert kind == "RuntimeError" and "teardown_caches()" in message
    assert refusals["tensor_parallel_twice"] == (
        "RuntimeError",
        "parallelize_tensor: the model's parameters are split across ranks already (DTensor)",
    )


def test_worker_model_is_the_conftest_tiny_model() -> None:
    """The worker builds its model without importing conftest (a spawned process imports
    less); it must stay the same model."""
    from tests.distributed_worker import build_model

    ours, theirs = build_model(), tiny_model(max_seq_len=CONFIG.max_seq_len)
    assert ours.config == theirs.config
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert isinstance(ours, attn.TransformerDecoder)
