"""What each of the 2 processes of tests/test_distributed.py and test_distributed_compile.py
runs: PPO cycles on a sharded model and on an unsharded copy of it, side by side, results
saved for the test to compare.

Shapes: b = rows on this rank, P = padded prompt width, N = new tokens, v = vocab.

Each scenario builds a sharded model (FSDP2 or tensor parallel) and, in the same process,
the unsharded reference with the same weights, then runs PPO cycles on both: generation,
no_grad scoring, one SGD step on a clipped PPO loss. The FSDP2 reference trains on every
rank's rows (FSDP2 averages the ranks' gradients); the tensor-parallel one on the rows all
ranks share. Results go to ``{out}/rank{r}.pt``; the test process compares them
(``compare_cycles``), so a failure shows the values. Run by hand to see one release's
results (all scenarios, or the ones named)::

    PYTHONPATH=. ~/.cache/attn-matrix/2.8.0/bin/python tests/distributed_worker.py fsdp tensor_parallel
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import attn
import attn.distributed
from attn import compat

WORLD_SIZE = 2
CYCLES = 3
NEW_TOKENS = 4
LR = 0.5
# torch.compile backend of the compiled scenarios, with dynamic=False: aot_eager fails on the
# tensor-parallel model on 2.6, 2.7 and 2.15, and DTensor fails on symbolic shapes on 2.5.
BACKEND = "eager"
CONFIG = attn.DecoderConfig(
    vocab_size=61, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=48, max_seq_len=32
)
# Left-padded prompts of several lengths: FSDP2 ranks each take their own, tensor-parallel
# ranks all take the first.
PROMPTS = ([[5, 9, 3], [7, 2, 11, 4, 8]], [[13, 1, 6, 6], [21, 30]])


# The same with what Qwen checkpoints switch on: tied embeddings (the output layer multiplies
# by the embedding's weight), q/k/v biases and per-head q/k norms.
QWEN_CONFIG = dataclasses.replace(CONFIG, tie_embeddings=True, qkv_bias=True, qk_norm=True)


def build_model(config: attn.DecoderConfig = CONFIG) -> attn.TransformerDecoder:
    """The tiny decoder of tests/conftest.py: weights scaled up, far from uniform outputs."""
    torch.manual_seed(0)
    model = attn.TransformerDecoder(config)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    return model


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective for sharded ones: all ranks call it alike)."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def token_logprobs(model: nn.Module, out: attn.GenerationOutput) -> torch.Tensor:
    """(b, N) log-probabilities of the generated tokens, one uncached pass."""
    mask = attn.padded_causal_mask(out.padding_mask)
    logits = model(out.tokens, input_pos=out.positions, mask=mask)  # (b, P + N, v)
    logprobs = logits[:, out.prompt_length - 1 : -1].float().log_softmax(-1)  # (b, N, v)
    return logprobs.gather(-1, out.generated[..., None]).squeeze(-1)


def ppo_loss(model: nn.Module, out: attn.GenerationOutput, old: torch.Tensor) -> torch.Tensor:
    """Clipped PPO loss; the reward is the share of even generated tokens."""
    counted = out.generated_mask.float()  # (b, N)
    reward = ((out.generated % 2 == 0).float() * counted).sum(-1) / counted.sum(-1)  # (b,)
    advantages = (reward - 0.5)[:, None]  # (b, 1)
    ratio = (token_logprobs(model, out) - old).exp()
    objective = torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    return -(objective * counted).sum() / counted.sum()


def decode_loop(model: attn.TransformerDecoder, prompt: torch.Tensor, mode: Callable[[], Any]) -> torch.Tensor:
    """A hand-written greedy loop over unpadded prompts (b, s), in ``mode``, on caches of its
    own: (b, s + N) tokens."""
    tokens = [prompt]
    with attn.local_kv_cache(model, batch_size=prompt.shape[0], max_seq_len=prompt.shape[1] + NEW_TOKENS), mode():
        logits = model(prompt)
        for _ in range(NEW_TOKENS):
            tokens.append(logits[:, -1:].argmax(-1))
            logits = model(tokens[-1])
    return torch.cat(tokens, dim=1).clone()


def cache_snapshot(model: attn.TransformerDecoder) -> list[torch.Tensor]:
    return [t.clone() for cache in model.kv_caches() for t in (cache.k_cache, cache.v_cache, cache.cache_pos)]


def run_cycles(
    model: attn.TransformerDecoder,
    reference: attn.TransformerDecoder,
    rank_prompts: list[list[list[int]]],
    rank: int,
    compiled: bool,
    loops: list[tuple[str, Callable[[nn.Module], Any]]],
) -> dict[str, Any]:
    """PPO cycles on the sharded ``model`` (this rank's rows) and on ``reference`` (every
    rank's rows); everything the test compares, per cycle."""
    runner = torch.compile(model, backend=BACKEND, dynamic=False) if compiled else model
    graphs = torch._dynamo.utils.counters["stats"]
    # foreach: the multi-tensor step CUDA takes by default, on every device (it refuses a mix
    # of DTensor and ordinary parameters).
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, foreach=True)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    prompts = rank_prompts[rank]
    rows, width = len(prompts), max(map(len, prompts))
    cycles = []
    for cycle in range(CYCLES):
        start = time.perf_counter()
        result: dict[str, Any] = {}
        # Generation on caches the caller set up: they outlive the call, to check the passes after.
        model.setup_caches(rows, width + NEW_TOKENS)
        out = attn.generate(runner, prompts, max_new_tokens=NEW_TOKENS)
        ref_outs = [attn.generate(reference, p, max_new_tokens=NEW_TOKENS) for p in rank_prompts]
        result["tokens"], result["ref_tokens"] = out.tokens, ref_outs[rank].tokens
        cache = model.kv_caches()[0]
        result["cache_shape"] = (cache.batch_size, cache.num_kv_heads, cache.max_seq_len, cache.head_dim)
        before = cache_snapshot(model)
        with torch.no_grad():  # scoring: old log-probabilities, the cache untouched
            old = token_logprobs(runner, out)
            ref_olds = [token_logprobs(reference, o) for o in ref_outs]
        result["scores"], result["ref_scores"] = old, ref_olds[rank]
        loss = ppo_loss(runner, out, old)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        after = cache_snapshot(model)
        result["cache_untouched"] = all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
        model.teardown_caches()
        ref_losses = [ppo_loss(reference, o, r) for o, r in zip(ref_outs, ref_olds, strict=True)]
        (sum(ref_losses) / len(ref_losses)).backward()  # the mean of the ranks' losses, as FSDP2 averages
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        result["loss"], result["ref_loss"] = loss.detach(), ref_losses[rank].detach()
        result["weights"], result["ref_weights"] = full_weights(model), full_weights(reference)
        result["graphs"] = graphs["unique_graphs"]  # compiled so far
        if loops:  # a hand-written decode loop of this cycle's kind, then a grad pass after it
            name, mode = loops[cycle % len(loops)]
            # Each row repeated to the padded width: the shapes of generate's passes (new shapes
            # cost tensor-parallel linears seconds each under inference mode, in DTensor's first dispatch).
            padded = [[row[i % len(row)] for i in range(width)] for row in prompts]
            prompt = torch.tensor(padded, device=out.tokens.device)  # (b, P)
            result["loop"] = name
            result["loop_tokens"] = decode_loop(model, prompt, lambda mode=mode: mode(model))
            result["ref_loop_tokens"] = decode_loop(reference, prompt, lambda: attn.cached_inference(reference))
            model(result["loop_tokens"]).float().logsumexp(-1).mean().backward()
            optimizer.zero_grad()
        result["seconds"] = time.perf_counter() - start
        cycles.append(result)
    return {"cycles": cycles, "initial_weights": full_weights(build_model(reference.config))}


def user_loops(inference_mode_works: bool) -> list[tuple[str, Callable[[nn.Module], Any]]]:
    """The decode loops a user may write: plain inference mode (the default policy),
    cached_inference, and no_grad with the flag; the last alone where the model cannot take
    inference mode."""
    grad_free = ("no_grad + kv_cache_mode", lambda m: _no_grad_flag(m))
    if not inference_mode_works:
        return [grad_free]
    return [
        ("torch.inference_mode()", lambda m: torch.inference_mode()),
        ("attn.cached_inference", lambda m: attn.cached_inference(m)),
        grad_free,
    ]


@contextlib.contextmanager
def _no_grad_flag(model: nn.Module) -> Iterator[None]:
    with torch.no_grad(), attn.kv_cache_mode(model):
        yield


def _fully_shard_by_hand(model: attn.TransformerDecoder) -> None:
    fsdp = attn.distributed.fsdp_api()
    # Where gloo sums when asked to average, FSDP2 must reduce in another dtype to average.
    averages = attn.distributed.gloo_reduce_scatter_averages(dist.group.WORLD)
    mp_policy = fsdp.MixedPrecisionPolicy(reduce_dtype=None if averages else torch.float64)
    for layer in model.layers:
        fsdp.fully_shard(layer, mp_policy=mp_policy)
    fsdp.fully_shard(model, mp_policy=mp_policy)


def fsdp_scenario(rank: int, compiled: bool, by_hand: bool) -> dict[str, Any]:
    """FSDP2 on every layer and the root: with attn.distributed.shard_fsdp, or ``by_hand``
    with fully_shard as a new user would (no preparation: only attn.generate's fallback).
    Eager runs add hand-written decode loops, one kind a cycle."""
    import attn.distributed

    model, reference = build_model(), build_model()
    if by_hand:
        _fully_shard_by_hand(model)
    else:
        attn.distributed.shard_fsdp(model)
    loops = [] if compiled else user_loops(not by_hand or compat.release_support().fsdp_inference_mode)
    return run_cycles(model, reference, list(PROMPTS), rank, compiled, loops)


def fsdp_scoring_first(rank: int, by_hand: bool) -> dict[str, Any]:
    """attn's grad-free passes (the lm-eval adapter's uncached ones, shared-context scoring)
    as the first passes of a freshly sharded model, then a grad pass (it fails where they
    left FSDP2's unsharded parameters as inference tensors)."""
    import attn.distributed

    model, reference = build_model(), build_model()
    _fully_shard_by_hand(model) if by_hand else attn.distributed.shard_fsdp(model)
    context, continuations = PROMPTS[rank][1], [[3, 8], [40], [2, 2, 9]]
    ids = torch.tensor([context])  # (1, C)
    with attn.context.uncached_passes(model):  # the lm-eval adapter's full passes
        full = model(ids)
    scores = attn.score_continuations(model, context, continuations)
    model(ids).float().logsumexp(-1).mean().backward()
    with torch.no_grad():
        ref_full = reference(ids)
    return {
        "scores": scores,
        "ref_scores": attn.score_continuations(reference, context, continuations),
        "full": full.clone(),
        "ref_full": ref_full,
    }


def tensor_parallel_scenario(rank: int, compiled: bool, config: attn.DecoderConfig = CONFIG) -> dict[str, Any]:
    import attn.distributed

    model, reference = attn.distributed.parallelize_tensor(build_model(config)), build_model(config)
    loops = [] if compiled else user_loops(compat.release_support().tensor_parallel_inference_mode)
    return run_cycles(model, reference, [PROMPTS[0]] * WORLD_SIZE, rank, compiled, loops)


def refusals(rank: int) -> dict[str, Any]:
    """The errors attn.distributed gives before it changes anything, as (type, message)."""
    import attn.distributed

    def refusal(call: Callable[[], Any]) -> tuple[str, str] | None:
        try:
            call()
        except Exception as error:
            return type(error).__name__, str(error)
        return None

    with_caches = build_model()
    with_caches.setup_caches(1, 8)
    mqa = attn.TransformerDecoder(attn.DecoderConfig(**{**vars(CONFIG), "num_kv_heads": 1}))
    return {
        "tensor_parallel_mqa": refusal(lambda: attn.distributed.parallelize_tensor(mqa)),
        "mqa_unchanged": [layer.attn.num_kv_heads for layer in mqa.layers],
        "tensor_parallel_with_caches": refusal(lambda: attn.distributed.parallelize_tensor(with_caches)),
        "tensor_parallel_twice": refusal(
            lambda: attn.distributed.parallelize_tensor(attn.distributed.parallelize_tensor(build_model()))
        ),
    }


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "probe": lambda rank: attn.distributed.probe_distributed_inference_mode()._asdict(),
    "refusals": refusals,
    "fsdp": lambda rank: fsdp_scenario(rank, compiled=False, by_hand=False),
    "fsdp_by_hand": lambda rank: fsdp_scenario(rank, compiled=False, by_hand=True),
    "fsdp_scoring_first": lambda rank: fsdp_scoring_first(rank, by_hand=False),
    "fsdp_by_hand_scoring_first": lambda rank: fsdp_scoring_first(rank, by_hand=True),
    "tensor_parallel": lambda rank: tensor_parallel_scenario(rank, compiled=False),
    "tensor_parallel_qwen": lambda rank: tensor_parallel_scenario(rank, compiled=False, config=QWEN_CONFIG),
    "fsdp_by_hand_compiled": lambda rank: fsdp_scenario(rank, compiled=True, by_hand=True),
    "tensor_parallel_compiled": lambda rank: tensor_parallel_scenario(rank, compiled=True),
}


def worker(rank: int, out_dir: str, names: list[str]) -> None:
    """One rank: the scenarios ``names``, each error caught and recorded; results to rank{rank}.pt."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/store",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=120),
    )
    results: dict[str, Any] = {"torch": torch.__version__}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", attn.CompatWarning)
            for name in names:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                start = time.perf_counter()
                try:
                    results[name] = SCENARIOS[name](rank)
                except Exception as error:
                    results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                results[f"{name} seconds"] = time.perf_counter() - start
        results["warnings"] = [str(w.message) for w in caught if issubclass(w.category, attn.CompatWarning)]
        results["warned_at"] = [w.filename for w in caught if issubclass(w.category, attn.CompatWarning)]
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def launch(out_dir: str, names: list[str], timeout: float = 600.0) -> list[dict[str, Any]]:
    """Runs the scenarios ``names`` in 2 spawned processes; returns each rank's results."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(out_dir, names), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {WORLD_SIZE} processes did not finish within {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD_SIZE)]


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """fp32 closeness (assert_close's float32 tolerances), naming what differs."""
    torch.testing.assert_close(actual, expected, msg=lambda message: f"{what}: {message}")


def compare_cycles(outcome: dict[str, Any], compiled: bool) -> None:
    """Asserts a scenario's sharded results equal the unsharded reference's, cycle by cycle:
    the same greedy tokens, close fp32 scores, loss and updated weights (which moved), caches
    untouched by scoring and the grad step, and a compiled run compiling in its first cycle only."""
    assert "error" not in outcome, outcome.get("traceback", outcome.get("error"))
    cycles = outcome["cycles"]
    assert len(cycles) == CYCLES
    for i, cycle in enumerate(cycles):
        where = f"cycle {i}"
        assert torch.equal(cycle["tokens"], cycle["ref_tokens"]), f"{where}: generated tokens differ"
        _close(cycle["scores"], cycle["ref_scores"], f"{where}, no_grad scores")
        _close(cycle["loss"], cycle["ref_loss"], f"{where}, PPO loss")
        for name, weight in cycle["weights"].items():
            _close(weight, cycle["ref_weights"][name], f"{where}, updated {name}")
        assert cycle["cache_untouched"], f"{where}: no_grad scoring or the grad step changed the cache"
        if "loop" in cycle:
            assert torch.equal(cycle["loop_tokens"], cycle["ref_loop_tokens"]), f"{where}: {cycle['loop']} loop"
    moved = [n for n, w in cycles[-1]["weights"].items() if not torch.equal(w, outcome["initial_weights"][n])]
    assert len(moved) == len(cycles[-1]["weights"]), "some weights never moved: the comparison is vacuous there"
    if compiled:
        graphs = [cycle["graphs"] for cycle in cycles]
        assert graphs[0] > 0 and len(set(graphs)) == 1, f"graphs compiled by the end of each cycle: {graphs}"


if __name__ == "__main__":
    names = sys.argv[1:] or list(SCENARIOS)
    with tempfile.TemporaryDirectory() as directory:
        for rank, results in enumerate(launch(directory, names)):
            print(f"rank {rank}: torch {results['torch']}")
            for name in names:
                outcome = results[name]
                seconds = results[f"{name} seconds"]
                if "cycles" not in outcome:
                    print(f"  {name} ({seconds:.1f} s): {outcome}"[:400])
                    continue
                try:
                    compare_cycles(outcome, compiled=name.endswith("compiled"))
                    verdict = "== unsharded"
                except AssertionError as error:
                    verdict = f"DIFFERS: {str(error)[:300]}"
                print(f"  {name} ({seconds:.1f} s): {verdict}")
            for message in results["warnings"]:
                print(f"  warning: {message[:160]}...")
