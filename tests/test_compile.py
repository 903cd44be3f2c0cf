"""Compile hygiene: zero graph breaks, one decode graph for every position, no recompiles
when passes alternate, and compiled results equal eager ones.

Counted with ``torch._dynamo.testing.CompileCounter`` and ``torch._dynamo.utils.counters``
(``torch._dynamo.explain`` can under-report). Cheap backends except where noted.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import attn

from .conftest import assert_cache_unchanged, cache_state, tiny_model


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def run_all_passes(model: torch.nn.Module, tokens: torch.Tensor, steps: int = 6) -> dict[str, torch.Tensor]:
    """Cached prefill and decode, then no-grad scoring, then a training forward+backward."""
    out = {}
    base = model._orig_mod if hasattr(model, "_orig_mod") else model
    base.reset_caches()
    with attn.cached_inference(model):
        pieces = [model(tokens[:, :4])]
        pieces += [model(tokens[:, i : i + 1].clone()) for i in range(4, 4 + steps)]
    out["cached"] = torch.cat(pieces, 1).clone()
    before = cache_state(base)
    with torch.no_grad():
        out["no_grad"] = model(tokens)
    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    out["grad"] = logits.detach()
    assert_cache_unchanged(base, before)
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_flag_policy_fullgraph_compiles_each_kind_of_pass_once(backend: str, restore_policy: None) -> None:
    attn.compat.set_cache_policy("flag")
    model = tiny_model(1)
    model.setup_caches(2, 32)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter if backend == "eager" else backend)
    tokens = torch.randint(0, 61, (2, 10))
    got = run_all_passes(compiled, tokens)
    assert graph_breaks() == 0
    if backend == "eager":
        # prefill, one decode graph for all 6 positions, no_grad scoring, grad training
        assert counter.frame_count == 4, counter.frame_count
        for _ in range(3):  # every kind of pass again, interleaved: no further compiles
            run_all_passes(compiled, tokens)
        assert counter.frame_count == 4, counter.frame_count
    expected = run_all_passes(model, tokens)
    for kind in expected:
        torch.testing.assert_close(got[kind], expected[kind], rtol=1e-5, atol=1e-5, msg=kind)


def test_decode_step_compiles_once_for_a_whole_generation(restore_policy: None) -> None:
    attn.compat.set_cache_policy("flag")
    model = tiny_model(2)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    out = attn.generate(compiled, [[1, 2, 3], [4, 5]], max_new_tokens=20)
    assert counter.frame_count == 2, counter.frame_count  # prefill + one decode graph
    assert graph_breaks() == 0
    again = attn.generate(compiled, [[1, 2, 3], [4, 5]], max_new_tokens=20)
    assert counter.frame_count == 2 and torch.equal(out.tokens, again.tokens)
    assert torch.equal(out.tokens, attn.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=20).tokens)


@pytest.mark.requires_is_inference_trace
def test_inference_policy_fullgraph_where_is_inference_traces(restore_policy: None) -> None:
    attn.compat.set_cache_policy("inference")
    model = tiny_model(3)
    model.setup_caches(2, 32)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    tokens = torch.randint(0, 61, (2, 10))
    got = run_all_passes(compiled, tokens)
    expected = run_all_passes(model, tokens)
    for kind in expected:
        torch.testing.assert_close(got[kind], expected[kind], rtol=1e-5, atol=1e-5, msg=kind)


@pytest.mark.requires_no_is_inference_trace
def test_inference_policy_graph_breaks_but_stays_correct_where_is_inference_cannot_trace(
    restore_policy: None,
) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)
        attn.compat.set_cache_policy("inference")
    model = tiny_model(3)
    model.setup_caches(2, 32)
    compiled = torch.compile(model, backend="eager")
    tokens = torch.randint(0, 61, (2, 10))
    got = run_all_passes(compiled, tokens)
    assert graph_breaks() > 0  # what the CompatWarning promised
    expected = run_all_passes(model, tokens)
    for kind in expected:
        torch.testing.assert_close(got[kind], expected[kind], rtol=1e-5, atol=1e-5, msg=kind)
    torch._dynamo.reset()  # compiled code is cached per code object, not per compile call
    with pytest.raises(torch._dynamo.exc.Unsupported, match="is_inference"), torch.inference_mode():
        torch.compile(model, fullgraph=True, backend="eager")(tokens)


def test_grad_pass_with_flag_on_fails_compiled_too(restore_policy: None) -> None:
    attn.compat.set_cache_policy("flag")
    model = tiny_model(4)
    model.setup_caches(1, 8)
    tokens = torch.randint(0, 61, (1, 3))
    message = "grad-enabled forward pass ran with the KV-cache flag on"
    with attn.kv_cache_mode(model), pytest.raises(RuntimeError, match=message):
        torch.compile(model, backend="eager")(tokens)
    torch._dynamo.reset()
    # fullgraph: torch >= 2.9 re-raises the RuntimeError; 2.5-2.8 wrap it in an "Observed
    # exception" that names the line that raised but not the message.
    wrapped = rf"{message}|Observed exception[\s\S]*uses_cache\(h\)"
    with attn.kv_cache_mode(model), pytest.raises(Exception, match=wrapped):
        torch.compile(model, fullgraph=True, backend="eager")(tokens)
    assert model.kv_caches()[0].size == 0


@pytest.mark.slow
def test_inductor_keeps_the_cache_mutable(restore_policy: None) -> None:
    """Generated code must write the cache in place, not bake it in as a constant."""
    attn.compat.set_cache_policy("flag")
    model = tiny_model(5)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    prompts = [[1, 2, 3], [4, 5]]
    first = attn.generate(compiled, prompts, max_new_tokens=6)
    second = attn.generate(compiled, [[7, 8], [9, 10, 11]], max_new_tokens=6)
    assert torch.equal(first.tokens, attn.generate(model, prompts, max_new_tokens=6).tokens)
    assert torch.equal(second.tokens, attn.generate(model, [[7, 8], [9, 10, 11]], max_new_tokens=6).tokens)


# Before torch 2.6, inductor's generated bounds check aborts the whole process on a bad
# index instead of raising (measured on 2.5.1 in the version matrix: "Fatal Python error:
# Aborted"); 2.6.0 and later raise a RuntimeError.
INDUCTOR_ABORTS_ON_BAD_INDEX = attn.compat.torch_version()[:3] < (2, 6, 0)


@pytest.mark.parametrize(
    ("backend", "error"),
    [
        ("aot_eager", IndexError),
        pytest.param(
            "inductor",
            RuntimeError,
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(
                    INDUCTOR_ABORTS_ON_BAD_INDEX,
                    reason=f"torch {torch.__version__}: inductor's bounds check aborts the process before 2.6",
                ),
            ],
        ),
    ],
)
def test_compiled_overflow_is_refused_and_leaves_the_cache_unchanged(
    backend: str, error: type, restore_policy: None
) -> None:
    """Compiled code cannot read the fill position for the friendly check; the write itself
    is bounds-checked before anything lands (index_copy_'s IndexError; inductor's generated
    bounds assertion, a RuntimeError)."""
    attn.compat.set_cache_policy("flag")
    model = tiny_model(6)
    model.setup_caches(1, 8)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with attn.cached_inference(model):
        compiled(torch.randint(0, 61, (1, 6)))
        before = cache_state(model)
        with pytest.raises(error, match="out of bounds"):
            compiled(torch.randint(0, 61, (1, 3)))
    assert_cache_unchanged(model, before)
