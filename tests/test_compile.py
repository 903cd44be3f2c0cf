"""Compile hygiene: zero graph breaks where every decision is explicit, one break per forward
where inference mode decides, one decode graph for every position, no recompiles when passes
alternate, and compiled results equal eager ones.

Counted with ``torch._dynamo.testing.CompileCounter`` and ``torch._dynamo.utils.counters``
(``torch._dynamo.explain`` can under-report). Cheap backends except where noted.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import attn
from attn import compat
from attn.policy import CachePolicy

from .conftest import assert_cache_unchanged, cache_state, tiny_model


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def run_all_passes(model: torch.nn.Module, tokens: torch.Tensor, steps: int = 6) -> dict[str, torch.Tensor]:
    """Cached prefill and decode, then scoring with the cache off, then a training forward+backward.

    Every pass states its decision explicitly (flag on, flag off, grad): none needs the
    inference-mode test, so all of them compile with ``fullgraph=True``.
    """
    out = {}
    base = model._orig_mod if hasattr(model, "_orig_mod") else model
    base.reset_caches()
    with attn.cached_inference(model):
        pieces = [model(tokens[:, :4])]
        pieces += [model(tokens[:, i : i + 1].clone()) for i in range(4, 4 + steps)]
    out["cached"] = torch.cat(pieces, 1).clone()
    before = cache_state(base)
    with torch.no_grad(), attn.disable_kv_cache(model):
        out["no_grad"] = model(tokens)
    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    out["grad"] = logits.detach()
    assert_cache_unchanged(base, before)
    return out


# Every decision here is explicit, so the policy cannot change a graph: the eager backend
# counts the graphs under both policies; aot_eager (the costly compile, 10-25 s a matrix leg)
# checks the functionalized results under the default one.
@pytest.mark.parametrize(
    ("policy", "backend"),
    [
        (CachePolicy.INFERENCE, "eager"),
        (CachePolicy.FLAG, "eager"),
        pytest.param(CachePolicy.INFERENCE, "aot_eager", marks=pytest.mark.slow),
    ],
    indirect=["policy"],
    ids=["inference-eager", "flag-eager", "inference-aot_eager"],
)
def test_explicit_decisions_compile_fullgraph_once_per_kind_of_pass(backend: str, policy: CachePolicy) -> None:
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


def test_decode_step_compiles_once_for_a_whole_generation() -> None:
    model = tiny_model(2)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    out = attn.generate(compiled, [[1, 2, 3], [4, 5]], max_new_tokens=20)
    assert counter.frame_count == 2, counter.frame_count  # prefill + one decode graph
    assert graph_breaks() == 0
    again = attn.generate(compiled, [[1, 2, 3], [4, 5]], max_new_tokens=20)
    assert counter.frame_count == 2 and torch.equal(out.tokens, again.tokens)
    assert torch.equal(out.tokens, attn.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=20).tokens)


def no_cache_greedy(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """The reference: recompute the whole sequence for every token, no cache anywhere."""
    tokens = prompt.clone()
    with torch.no_grad(), attn.disable_kv_cache(model):
        for _ in range(new_tokens):
            tokens = torch.cat((tokens, model(tokens)[:, -1:].argmax(-1)), 1)
    return tokens[0, prompt.shape[1] :].tolist()


def inference_mode_loop(call: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """The README's loop: plain torch.inference_mode(), no flag, no policy set."""
    out = []
    with torch.inference_mode():
        logits = call(prompt)
        for _ in range(new_tokens):
            token = logits[:, -1:].argmax(-1)  # (1, 1)
            out.append(int(token))
            logits = call(token)
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_plain_inference_mode_loop_uses_the_cache_compiled(backend: str, restore_policy: None) -> None:
    """The default policy, compiled without fullgraph: one graph break per forward (the
    table's count), the no-cache loop's tokens, and one warning that points at this file."""
    model = tiny_model(7)
    prompt = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(0))
    expected = no_cache_greedy(model, prompt, 8)
    model.setup_caches(1, 32)
    assert inference_mode_loop(model, prompt, 8) == expected  # eager
    model.reset_caches()
    attn.policy._reset_warnings()
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.inference_mode():
            compiled(prompt)
        assert graph_breaks() == compat.release_support().graph_breaks_per_forward
        model.reset_caches()
        assert inference_mode_loop(compiled, prompt, 8) == expected
    notes = [w for w in caught if issubclass(w.category, attn.CompatWarning)]
    assert len(notes) == 1, [str(w.message) for w in notes]
    assert "1 graph break per forward" in str(notes[0].message) and "cached_inference" in str(notes[0].message)
    assert notes[0].filename == __file__, notes[0].filename


def test_fullgraph_with_inference_mode_fails_naming_the_fix() -> None:
    model = tiny_model(3)
    model.setup_caches(1, 16)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.Unsupported) as error, torch.inference_mode():
        compiled(torch.randint(0, 61, (1, 4)))
    assert model.kv_caches()[0].size == 0
    if "reason" in inspect.signature(torch.compiler.disable).parameters:  # torch >= 2.8 shows it
        assert "attn.cached_inference(model)" in str(error.value)


def test_grad_pass_with_flag_on_fails_compiled_too() -> None:
    model = tiny_model(4)
    model.setup_caches(1, 8)
    tokens = torch.randint(0, 61, (1, 3))
    message = "grad-enabled forward pass ran with the KV-cache flag on"
    with attn.kv_cache_mode(model), pytest.raises(RuntimeError, match=message):
        torch.compile(model, backend="eager")(tokens)
    torch._dynamo.reset()
    # fullgraph: torch >= 2.9 re-raises the RuntimeError; 2.5-2.8 wrap it in an "Observed
    # exception" that names the line that raised but not the message.
    wrapped = rf"{message}|Observed exception[\s\S]*explicit_decision"
    with attn.kv_cache_mode(model), pytest.raises(Exception, match=wrapped):
        torch.compile(model, fullgraph=True, backend="eager")(tokens)
    assert model.kv_caches()[0].size == 0


@pytest.mark.slow
def test_inductor_keeps_the_cache_mutable() -> None:
    """Generated code must write the cache in place, not bake it in as a constant."""
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
def test_compiled_overflow_is_refused_and_leaves_the_cache_unchanged(backend: str, error: type) -> None:
    """Compiled code cannot read the fill position for the friendly check; the write itself
    is bounds-checked before anything lands (index_copy_'s IndexError; inductor's generated
    bounds assertion, a RuntimeError)."""
    model = tiny_model(6)
    model.setup_caches(1, 8)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with attn.cached_inference(model):
        compiled(torch.randint(0, 61, (1, 6)))
        before = cache_state(model)
        with pytest.raises(error, match="out of bounds"):
            compiled(torch.randint(0, 61, (1, 3)))
    assert_cache_unchanged(model, before)


@pytest.mark.parametrize("backend", ["eager", pytest.param("aot_eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("entry", ["model", "model with positions", "cached model", "generate"])
def test_fullgraph_entry_points_after_several_lengths(backend: str, entry: str) -> None:
    """After a second length dynamo traces the length as a symbol: the shape checks must
    still hold (they once raised 'input_pos must have shape (6,) or (2, 6), got (2, 6)')."""
    model = tiny_model(8)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    if entry == "generate":
        for prompts in ([[1, 2, 3], [4, 5]], [[1, 2, 3, 4, 5, 6], [7]], [[9] * 7, [1] * 7]):
            want = attn.generate(model, prompts, max_new_tokens=5).tokens
            assert torch.equal(attn.generate(compiled, prompts, max_new_tokens=5).tokens, want)
        return
    if entry == "cached model":
        model.setup_caches(2, 32)
    for s in (3, 6, 7, 5):
        ids = torch.randint(0, 61, (2, s))
        kwargs = {}
        if entry == "model with positions":
            mask = attn.padded_causal_mask(torch.ones(2, s, dtype=torch.bool))  # (b, s, s)
            kwargs = {"input_pos": torch.arange(s).expand(2, s), "mask": mask}
        with attn.cached_inference(model) if entry == "cached model" else torch.no_grad():
            if entry == "cached model":
                model.reset_caches()
            want = model(ids, **kwargs)
            if entry == "cached model":
                model.reset_caches()
            got = compiled(ids, **kwargs)
        torch.testing.assert_close(got, want, msg=f"s={s}")
