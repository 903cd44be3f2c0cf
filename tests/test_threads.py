"""attn/threads.py: one model used from two threads never mixes their caches silently.

Deterministic: the second thread runs to completion inside a callback of the first (no sleeps).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

import attn

from .conftest import assert_cache_unchanged, cache_state, tiny_model

BUSY = r"in use by another thread .*copy\.deepcopy\(model\).*lock"


def run_in_thread(fn: Callable[[], object]) -> BaseException | None:
    """Runs ``fn`` in a new thread to its end; returns what it raised, if anything."""
    raised: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return raised[0] if raised else None


def second_thread_calls(model: attn.TransformerDecoder) -> dict[str, Callable[[], object]]:
    tokens = torch.tensor([[4, 5, 6]])
    return {
        "generate": lambda: attn.generate(model, [[4, 5, 6]], max_new_tokens=8),
        "no_grad scoring": lambda: torch.no_grad().__enter__() or model(tokens),
        "grad step": lambda: model(tokens).sum().backward(),
        "inference-mode pass": lambda: torch.inference_mode().__enter__() or model(tokens),
        "disable_kv_cache": lambda: attn.disable_kv_cache(model).__enter__(),
        "reset_caches": model.reset_caches,
        "setup_caches": lambda: model.setup_caches(1, 8),
        "score_continuations": lambda: attn.score_continuations(model, [1, 2], [[3], [4]]),
    }


@pytest.mark.parametrize("call", list(second_thread_calls(tiny_model())))
def test_a_second_thread_inside_a_generation_is_refused_and_the_first_is_unharmed(call: str) -> None:
    model = tiny_model(13)
    alone = attn.generate(model, [[1, 2, 3]], max_new_tokens=8)
    errors: list[BaseException | None] = []

    def on_tokens(_: torch.Tensor) -> None:
        if not errors:  # after the first token: the other thread's call, run to its end
            before = cache_state(model)
            errors.append(run_in_thread(second_thread_calls(model)[call]))
            assert_cache_unchanged(model, before)

    out = attn.generate(model, [[1, 2, 3]], max_new_tokens=8, on_tokens=on_tokens)
    assert isinstance(errors[0], RuntimeError) and errors[0] is not None
    assert "in use by another thread" in str(errors[0]) and "copy.deepcopy(model)" in str(errors[0])
    assert torch.equal(out.tokens, alone.tokens)
    assert run_in_thread(second_thread_calls(model)["generate"]) is None  # free again afterwards


def test_a_held_block_in_one_thread_refuses_a_decode_step_in_another() -> None:
    model = tiny_model(14)
    model.setup_caches(1, 16)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2]]))
        before = cache_state(model)
        error = run_in_thread(lambda: attn.cached_inference(model).__enter__())
        assert isinstance(error, RuntimeError)
        assert_cache_unchanged(model, before)
        model(torch.tensor([[3]]))  # the holder itself goes on, nested blocks included
        with attn.kv_cache_mode(model):
            model(torch.tensor([[4]]))
    assert int(model.kv_caches()[0].cache_pos) == 4
    assert run_in_thread(lambda: attn.generate(model, [[1]], max_new_tokens=2)) is None


def test_completion_logprobs_from_another_thread_runs_beside_a_generation() -> None:
    """It reads no cache and no flag: a reference pass may run while another thread generates."""
    model = tiny_model(15)
    with torch.no_grad():
        expected = attn.completion_logprobs(model, [[1, 2]], [[[3, 4]]]).logprobs
    got: list[torch.Tensor] = []

    def on_tokens(_: torch.Tensor) -> None:
        if not got:

            def score() -> None:
                with torch.no_grad():
                    got.append(attn.completion_logprobs(model, [[1, 2]], [[[3, 4]]]).logprobs)

            assert run_in_thread(score) is None

    attn.generate(model, [[5, 6]], max_new_tokens=3, on_tokens=on_tokens)
    assert torch.equal(got[0], expected)
