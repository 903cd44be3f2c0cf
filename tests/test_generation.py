"""attn/generation.py against a decode loop that recomputes the whole sequence each step."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attn
import attn.native
from attn import generate, padded_causal_mask
from attn.generation import _Buffers, _draw, _sample
from attn.policy import CachePolicy

from .conftest import (
    HostSyncCounter,
    OperatorCalls,
    assert_cache_unchanged,
    cache_state,
    examples,
    needs_avx2,
    poison_on_reset,
    tiny_model,
)


def naive_greedy(model: attn.TransformerDecoder, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding with no cache: a full forward over the sequence for every token."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


prompts_strategy = st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=7), min_size=1, max_size=4)


@given(prompts=prompts_strategy, steps=st.integers(1, 6))
def test_batched_greedy_equals_each_prompt_alone_and_naive_loop(prompts: list[list[int]], steps: int) -> None:
    model = tiny_model(5)
    out = generate(model, prompts, max_new_tokens=steps)
    for i, prompt in enumerate(prompts):
        alone = generate(model, [prompt], max_new_tokens=steps)
        assert out.generated[i].tolist() == alone.generated[0].tolist()
        assert out.generated[i].tolist() == naive_greedy(model, prompt, steps)


def test_generates_under_both_policies(policy: CachePolicy) -> None:
    model = tiny_model(6)
    out = generate(model, [[3, 4, 5], [7]], max_new_tokens=5)
    assert out.generated[0].tolist() == naive_greedy(model, [3, 4, 5], 5)
    assert out.generated[1].tolist() == naive_greedy(model, [7], 5)


def test_output_layout_and_logprobs_match_an_uncached_rescore() -> None:
    model = tiny_model(7)
    out = generate(model, [[3, 4, 5, 6], [8, 9]], max_new_tokens=4, return_logits=True)
    assert out.prompt_length == 4 and out.tokens.shape == (2, 8)
    assert out.tokens[1, :2].tolist() == [0, 0] and out.padding_mask[1].tolist() == [False, False] + [True] * 6
    assert out.positions[1].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]
    with torch.no_grad():
        logits = model(out.tokens, input_pos=out.positions, mask=padded_causal_mask(out.padding_mask))
    predicting = logits[:, out.prompt_length - 1 : -1]  # (b, N, v): the logits that chose each new token
    torch.testing.assert_close(out.logits, predicting, rtol=1e-4, atol=1e-4)
    expected = predicting.log_softmax(-1).gather(-1, out.generated[..., None]).squeeze(-1)
    torch.testing.assert_close(out.logprobs, expected, rtol=1e-4, atol=1e-4)


def test_results_are_ordinary_tensors_that_feed_a_training_step() -> None:
    model = tiny_model(8)
    out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=3, return_logits=True)
    for tensor in (out.tokens, out.padding_mask, out.positions, out.logprobs, out.logits):
        assert not tensor.is_inference()
    model.train()
    logits = model(out.tokens, input_pos=out.positions, mask=padded_causal_mask(out.padding_mask))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), out.tokens[:, 1:].flatten())
    loss.backward()  # "Inference tensors cannot be saved for backward" would raise here
    assert model.tok_embeddings.weight.grad is not None


def test_stop_tokens_end_each_row_on_its_own() -> None:
    model = tiny_model(9)
    free = generate(model, [[1, 2, 3], [4, 5, 6]], max_new_tokens=6)
    stop = int(free.generated[0, 2])
    rows_hit = [row.index(stop) if stop in row else None for row in free.generated.tolist()]
    out = generate(model, [[1, 2, 3], [4, 5, 6]], max_new_tokens=6, stop_tokens=[stop], pad_id=60)
    for i, hit in enumerate(rows_hit):
        generated, mask = out.generated[i].tolist(), out.generated_mask[i].tolist()
        if hit is None:
            assert generated == free.generated[i].tolist() and all(mask)
        else:
            assert generated[: hit + 1] == free.generated[i, : hit + 1].tolist()
            assert generated[hit + 1 :] == [60] * (5 - hit)
            assert mask == [True] * (hit + 1) + [False] * (5 - hit)
            assert (out.logprobs[i, hit + 1 :] == 0).all()


def test_sampling_is_reproducible_and_respects_top_k() -> None:
    model = tiny_model(10)
    draws = [
        generate(
            model, [[1, 2]], max_new_tokens=8, temperature=1.5, top_k=3, generator=torch.Generator().manual_seed(s)
        )
        for s in (0, 0, 1)
    ]
    assert torch.equal(draws[0].tokens, draws[1].tokens)
    with torch.no_grad():
        logits = model(draws[2].tokens)[0, 1:-1]  # the logits behind each drawn token
    allowed = logits.topk(3, dim=-1).indices
    assert all(t in a for t, a in zip(draws[2].generated[0].tolist(), allowed.tolist(), strict=True))
    greedy = generate(model, [[1, 2]], max_new_tokens=8)
    top1 = generate(
        model, [[1, 2]], max_new_tokens=8, temperature=0.7, top_k=1, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(greedy.tokens, top1.tokens)


def test_sets_up_its_own_cache_and_tears_it_down() -> None:
    model = tiny_model()
    generate(model, [[1, 2, 3]], max_new_tokens=4)
    assert not model.caches_are_setup()


def test_uses_and_resets_existing_caches() -> None:
    model = tiny_model(11)
    model.setup_caches(2, 20)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 9)))  # stale content: generate must reset it
    out = generate(model, [[1, 2, 3], [4]], max_new_tokens=4)
    assert model.caches_are_setup() and model.kv_caches()[0].size == 3 + 4 - 1
    assert out.generated[0].tolist() == naive_greedy(model, [1, 2, 3], 4)


def test_compiled_model_generates_the_same_tokens() -> None:
    model = tiny_model(12)
    compiled = torch.compile(model, backend="eager")
    eager = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=5)
    assert torch.equal(generate(compiled, [[1, 2, 3], [4, 5]], max_new_tokens=5).tokens, eager.tokens)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "message"),
    [
        (
            [[1] * 60],
            dict(max_new_tokens=5),
            r"longest prompt \(60 tokens\) plus max_new_tokens \(5\) is 65, more than the model's max_seq_len \(64\)",
        ),
        ([[1, 2], []], dict(max_new_tokens=2), r"rows \[1\] are empty"),
        ([], dict(max_new_tokens=2), r"at least one row"),
        ([[1, 2]], dict(max_new_tokens=0), r"max_new_tokens must be a positive int, got 0"),
        ([[1, 2]], dict(max_new_tokens=2, temperature=-1.0), r"temperature must be a finite number >= 0 .*got -1.0"),
        ([[1, 2]], dict(max_new_tokens=2, top_k=0), r"top_k must be None or an int in \[1, 61\], got 0"),
        (
            [[1, 2]],
            dict(max_new_tokens=2, stop_tokens=[61]),
            r"stop_tokens and pad_id must be ids in \[0, 61\), got \[61\]",
        ),
        ([[1, 2]], dict(max_new_tokens=2, pad_id=-1), r"got \[-1\]"),
        ([[1, 99]], dict(max_new_tokens=2), r"prompt token ids must be in \[0, 61\), got min 1 and max 99"),
        (torch.ones(3, dtype=torch.long), dict(max_new_tokens=2), r"must be \(batch, seq_len\)"),
        ([[1, 2]], dict(max_new_tokens=2, temperature="1"), r"temperature must be a finite number >= 0 .*got '1'"),
        ([[1, 2]], dict(max_new_tokens=2, temperature=True), r"temperature must be a finite number >= 0 .*got True"),
        ([[1, 2]], dict(max_new_tokens=2, temperature=float("inf")), r"got inf"),
        ([[1, 2]], dict(max_new_tokens=2, temperature=1e-300), r"temperature 1e-300 is below 1e-06.*temperature=0"),
        ([[1, 2]], dict(max_new_tokens=2, top_k=True), r"top_k must be None or an int in \[1, 61\], got True"),
        ([[1, 2]], dict(max_new_tokens=2, stop_tokens=[2.5]), r"stop_tokens and pad_id must be ids .*got \[2\.5\]"),
        ([[1.5, 2.0]], dict(max_new_tokens=2), r"row 0 holds torch.float32 values, not integer ids: \[1\.5, 2\.0\]"),
        ([[True, False]], dict(max_new_tokens=2), r"row 0 holds torch.bool values"),
        ([torch.ones(2, 3, dtype=torch.long)], dict(max_new_tokens=2), r"row 0 must be one sequence of ids \(1-d\)"),
        (torch.ones(2, 3), dict(max_new_tokens=2), r"row 0 holds torch.float32 values"),
    ],
)
def test_bad_arguments(prompts: object, kwargs: dict, message: str) -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, **kwargs)
    assert not model.caches_are_setup()


def test_existing_cache_too_small_is_refused_before_reset() -> None:
    model = tiny_model()
    model.setup_caches(2, 6)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 2)))
    before = cache_state(model)
    with pytest.raises(
        ValueError,
        match=r"need a cache of batch_size 2 and max_seq_len >= 8, but the model's cache has "
        r"batch_size 2 and max_seq_len 6",
    ):
        generate(model, [[1, 2, 3], [4]], max_new_tokens=5)
    with pytest.raises(ValueError, match=r"batch_size 1 and max_seq_len >= 4, but the model's cache has batch_size 2"):
        generate(model, [[1, 2]], max_new_tokens=2)
    assert_cache_unchanged(model, before)


@pytest.mark.parametrize(("with_stop_token", "per_step"), [(True, 1), (False, 0)])
def test_a_decode_step_makes_at_most_one_host_sync(
    monkeypatch: pytest.MonkeyPatch, with_stop_token: bool, per_step: int
) -> None:
    """One read a step, the stop check, and none without stop tokens; the capacity and the
    token ids are checked once per generate, not per step or per layer (6 layers here)."""
    model = tiny_model(12, num_layers=6)
    model.setup_caches(2, 64)
    counter = HostSyncCounter(monkeypatch)
    with torch.inference_mode():
        model(torch.randint(0, 61, (2, 3)))
    # The counter sees a direct prefill's reads: token ids, the fill position (capacity), and
    # the cache's last write (the scoring-after-generation check of a multi-token pass).
    assert counter.count == 3, counter.count
    produced = attn.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=24).generated.unique().tolist()
    stop_tokens = [min(set(range(61)) - set(produced))] if with_stop_token else None  # one never produced
    counts = []
    for new_tokens in (8, 24):
        counter.count = 0
        out = attn.generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=new_tokens, stop_tokens=stop_tokens)
        assert out.generated_mask.all()  # no row stopped early: every step ran
        counts.append(counter.count)
    assert (counts[1] - counts[0]) == per_step * 16, counts


def test_on_tokens_sees_the_tokens_of_the_output_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's (b,) tokens after stop handling (pad after a row's stop), and no call for
    the steps skipped once every row stopped; the callback adds no host read of its own."""
    model = tiny_model(7)
    prompts = [[1, 2, 3], [4, 5]]
    free = generate(model, prompts, max_new_tokens=8)
    stops = [int(free.generated[0, 1]), int(free.generated[1, 4])]  # row 0 stops by step 1, row 1 by step 4
    seen: list[torch.Tensor] = []
    out = generate(model, prompts, max_new_tokens=8, stop_tokens=stops, pad_id=60, on_tokens=seen.append)
    steps = torch.stack(seen, dim=1)  # (b, steps run)
    last = int(out.generated_mask.any(0).nonzero().max())  # the step at which the last row stopped
    assert steps.shape == (2, last + 1) and last < 7
    assert torch.equal(steps, out.generated[:, : last + 1])
    assert (out.generated[:, last + 1 :] == 60).all() and not out.generated_mask[:, last + 1 :].any()
    assert (steps[0][~out.generated_mask[0, : last + 1]] == 60).all()  # row 0's pad after its stop, as output

    counter = HostSyncCounter(monkeypatch)
    generate(model, prompts, max_new_tokens=8, stop_tokens=stops)
    without, counter.count = counter.count, 0
    generate(model, prompts, max_new_tokens=8, stop_tokens=stops, on_tokens=seen.append)
    assert counter.count == without


@pytest.mark.parametrize("kernel", ["aten.max.dim", pytest.param("attn.first_argmax.default", marks=needs_avx2)])
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 300),
    levels=st.integers(1, 4),  # few distinct values: ties everywhere
    specials=st.lists(st.sampled_from(["nan", "inf", "-inf", "-0.0"]), max_size=3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(60), deadline=None)
def test_greedy_picks_argmax_token_ties_and_nans_included(kernel, rows, vocab, levels, specials, dtype, seed):
    """Greedy sampling takes max's indices, or attn::first_argmax's where the native kernels are
    loaded, for speed: the token is argmax's (the first of tied largest logits, a NaN before
    all), and its logprob is log_softmax's at that token."""
    native = kernel.startswith("attn.")
    if native:
        attn.native.build_native()
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).to(dtype)
    for i, special in enumerate(specials):
        logits[i % rows, int(torch.randint(0, vocab, (1,), generator=gen))] = float(special)
    with mock.patch.object(attn.native, "loaded", lambda: native), OperatorCalls() as calls:
        tokens, logprobs = _sample(logits, 0.0, None, None)
    assert kernel in calls.names
    expected = logits.float().argmax(-1)
    assert torch.equal(tokens, expected)
    reference = logits.float().log_softmax(-1).gather(-1, expected[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs, reference, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_avx2)])
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    temperature=st.sampled_from([0.0, 0.5, 1.0]),
    top_k=st.sampled_from([None, 1, 5, 257]),  # 257: past attn::keep_top_k's, topk's
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(40), deadline=None)
def test_sampling_into_reused_buffers_equals_fresh_tensors(native, rows, vocab, dtype, temperature, top_k, steps, seed):
    """The decode loop samples into buffers it reuses every step: tokens and logprobs equal
    those of the sampler written here with fresh tensors, bit for bit, step after step (the
    buffers hold the last step's values), from the same generator state, and the logits given
    are left as they were; with ATen's calls, and with attn's native kernels where they are
    loaded (``attn::first_argmax``, ``attn::keep_top_k`` up to its largest k,
    ``attn::running_sums``)."""
    if native:
        attn.native.build_native()

    def fresh(logits, generator):
        x = logits.float()
        if temperature == 0.0:
            tokens = x.argmax(-1)
        else:
            x = x / temperature
            if k is not None:
                x = x.masked_fill(x < x.topk(k, dim=-1).values[:, -1:], float("-inf"))
            cumulative = x.softmax(-1).double().cumsum(-1)  # (b, v)
            draw = torch.rand(rows, 1, dtype=torch.float64, generator=generator) * cumulative[:, -1:]
            tokens = torch.searchsorted(cumulative, draw, right=True).clamp(max=vocab - 1).squeeze(-1)
        return tokens, x.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)

    buffers = _Buffers(torch.zeros(rows, vocab))
    fresh_gen, reused_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    k = None if top_k is None else min(top_k, vocab)
    for step in range(steps):
        logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed + step)) * 3).to(dtype)
        before = logits.clone()
        expected = fresh(logits, fresh_gen)
        with mock.patch.object(attn.native, "loaded", lambda: native), OperatorCalls() as calls:
            got = _sample(logits, temperature, k, reused_gen, buffers)
        if temperature == 0.0:
            assert ("attn.first_argmax.default" in calls.names) == native
        else:
            assert ("attn.running_sums.default" in calls.names) == native
        if temperature != 0.0 and k is not None:
            assert ("attn.keep_top_k.default" in calls.names) == (native and k <= attn.native.KEEP_TOP_K_MOST)
        assert torch.equal(got[0], expected[0])
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0, equal_nan=True)
        assert torch.equal(logits, before)


# ---------------------------------------------------------------------------- num_samples


@given(prompts=prompts_strategy, steps=st.integers(1, 5), samples=st.integers(1, 3))
def test_greedy_samples_equal_independent_runs(prompts: list[list[int]], steps: int, samples: int) -> None:
    """Greedy with G samples: each prompt's G rows equal one greedy run of that prompt."""
    model = tiny_model(5)
    out = generate(model, prompts, max_new_tokens=steps, num_samples=samples)
    alone = generate(model, prompts, max_new_tokens=steps)
    assert out.tokens.shape == (len(prompts) * samples, alone.tokens.shape[1])
    for name in ("tokens", "padding_mask", "positions"):
        assert torch.equal(getattr(out, name), getattr(alone, name).repeat_interleave(samples, 0)), name
    torch.testing.assert_close(out.logprobs, alone.logprobs.repeat_interleave(samples, 0), rtol=1e-5, atol=1e-5)
    assert not model.caches_are_setup()


def test_sampled_groups_are_reproducible_and_their_logprobs_rescore() -> None:
    model = tiny_model(12)
    prompts = [[3, 4, 5, 6], [8, 9]]

    def draw(seed: int) -> attn.GenerationOutput:
        g = torch.Generator().manual_seed(seed)
        return generate(model, prompts, max_new_tokens=6, temperature=1.5, num_samples=4, generator=g)

    first, again, other = draw(0), draw(0), draw(1)
    assert torch.equal(first.tokens, again.tokens) and not torch.equal(first.tokens, other.tokens)
    assert len({tuple(row) for row in first.generated[:4].tolist()}) > 1, "the 4 samples of a prompt all agree"
    with torch.no_grad():
        logits = model(first.tokens, input_pos=first.positions, mask=padded_causal_mask(first.padding_mask))
    predicting = logits[:, first.prompt_length - 1 : -1].float() / 1.5
    expected = predicting.log_softmax(-1).gather(-1, first.generated[..., None]).squeeze(-1)
    torch.testing.assert_close(first.logprobs, expected, rtol=1e-4, atol=1e-4)


def test_samples_with_user_caches_of_every_row() -> None:
    model = tiny_model(13)
    model.setup_caches(4, 12)
    out = generate(model, [[1, 2, 3], [4]], max_new_tokens=5, num_samples=2)
    expected = generate(tiny_model(13), [[1, 2, 3], [4]], max_new_tokens=5)
    assert torch.equal(out.tokens, expected.tokens.repeat_interleave(2, 0))
    assert {c.batch_size for c in model.kv_caches()} == {4}  # as the caller set them up
    with pytest.raises(ValueError, match=r"2 prompts x 3 samples .* need a cache of batch_size 6"):
        generate(model, [[1, 2, 3], [4]], max_new_tokens=5, num_samples=3)
    for bad in (0, 1.0, True):
        with pytest.raises(ValueError, match=r"num_samples must be a positive int"):
            generate(model, [[1]], max_new_tokens=2, num_samples=bad)  # type: ignore[arg-type]


def test_compiled_samples_compile_a_prefill_and_one_decode_graph() -> None:
    from torch._dynamo.testing import CompileCounter

    model = tiny_model(14)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    out = generate(compiled, [[1, 2, 3], [4, 5]], max_new_tokens=6, num_samples=3)
    assert counter.frame_count == 2, counter.frame_count  # prefill (2 rows) + decode (6 rows)
    assert torch.equal(out.tokens, generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=6, num_samples=3).tokens)


@pytest.mark.parametrize("num_samples", [1, 3])
def test_a_large_cache_of_the_callers_is_read_as_far_as_a_cache_of_its_own(num_samples: int) -> None:
    """generate attends over the prompt and new tokens rounded up (attended_slots), not over a
    caller's whole cache: the slots past that are never read (poisoned here), and the tokens
    and log-probs equal those of generate's own, smaller cache."""
    model = tiny_model(16, max_seq_len=200)
    prompts = [[1, 2, 3], [4, 5]]
    expected = generate(model, prompts, max_new_tokens=20, num_samples=num_samples, temperature=0.0)
    model.setup_caches(2 * num_samples, 200)
    poison_on_reset(model, attn.attended_slots(3 + 20, 200))  # 64 slots
    got = generate(model, prompts, max_new_tokens=20, num_samples=num_samples, temperature=0.0)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("callers_cache", [False, True])
def test_compiled_generate_compiles_once_for_lengths_within_a_step(callers_cache: bool) -> None:
    """generate attends over multiples of SLOT_STEP slots, in caches of its own sized so or in
    a caller's 200-slot cache: a compiled model with static shapes reuses its graphs for every
    length within one step (here 9 to 64 tokens) and compiles once more past it, with the
    tokens of eager generation each time."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()  # dynamo keeps 8 graphs of TransformerDecoder.forward a process
    assert attn.kv_cache.SLOT_STEP == 64
    model = tiny_model(15, max_seq_len=200)
    if callers_cache:
        model.setup_caches(2, 200)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter, dynamic=False)
    prompts = [[1, 2, 3], [4, 5]]
    frames = []
    for new_tokens in (6, 30, 61, 70):  # 3 + new: 9, 33, 64 (one step of slots), 73 (the next)
        out = generate(compiled, prompts, max_new_tokens=new_tokens)
        assert torch.equal(out.tokens, generate(model, prompts, max_new_tokens=new_tokens).tokens)
        frames.append(counter.frame_count)
    # Prefill and decode, then the decode again for 128 slots; the prefill's mask covers the
    # prompt's slots alone, so in the caller's cache its graph serves every length, while
    # generate's own caches are buffers of another size, which it writes too.
    assert frames == [2, 2, 2, 3 if callers_cache else 4], frames


@settings(deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.0, 8.0]), min_size=2, max_size=12).filter(any),
    seed=st.integers(0, 2**31 - 1),
)
def test_sampling_draws_each_token_at_its_probability(weights: list[float], seed: int) -> None:
    """The sampler against the distribution it is given: token frequencies over 20,000 draws
    within 5 standard deviations of the probabilities, never a token of probability 0, and
    the same draws again from the same generator."""
    probs = torch.tensor(weights) / sum(weights)  # (v,)
    rows = probs.expand(20_000, -1)  # (n, v)
    drawn = _draw(rows, torch.Generator().manual_seed(seed))  # (n,)
    assert torch.equal(drawn, _draw(rows, torch.Generator().manual_seed(seed)))
    assert (probs[drawn] > 0).all()
    frequencies = torch.bincount(drawn, minlength=len(weights)).double() / len(drawn)
    spread = (probs.double() * (1 - probs.double()) / len(drawn)).sqrt()
    assert ((frequencies - probs.double()).abs() <= 5 * spread + 1e-12).all(), (frequencies, probs)


def test_groups_split_rows_into_prompts_and_completions() -> None:
    model = tiny_model(9)
    prompts = [[3, 4, 5], [7]]
    out = generate(model, prompts, max_new_tokens=4, temperature=1.0, num_samples=2, stop_tokens=[11, 12, 13])
    got_prompts, groups = out.groups(2)
    assert got_prompts == prompts and [len(g) for g in groups] == [2, 2]
    for row in range(4):  # each completion: the real generated tokens of its row, up to its stop
        assert groups[row // 2][row % 2] == out.generated[row][out.generated_mask[row]].tolist()
    with pytest.raises(ValueError, match="num_samples must be a positive int dividing the 4 rows, got 3"):
        out.groups(3)
    with pytest.raises(ValueError, match=r"rows 0\.\.3 hold different prompts"):
        out.groups(4)


def test_stop_tokens_may_be_a_tensor() -> None:
    model = tiny_model(10)
    as_list = generate(model, [[3, 4]], max_new_tokens=6, stop_tokens=[5, 9])
    as_tensor = generate(model, [[3, 4]], max_new_tokens=6, stop_tokens=torch.tensor([5, 9]))
    assert torch.equal(as_list.tokens, as_tensor.tokens)


def test_outputs_are_ordinary_tensors_under_the_callers_inference_mode() -> None:
    model = tiny_model(11)
    with torch.inference_mode():
        out = generate(model, [[3, 4], [5]], max_new_tokens=3, return_logits=True)
    tensors = (out.tokens, out.padding_mask, out.positions, out.logprobs, out.logits)
    assert not any(t.is_inference() for t in tensors)
    model(out.tokens, input_pos=out.positions, mask=padded_causal_mask(out.padding_mask)).sum().backward()


class _Interrupt(Exception):
    pass


@pytest.mark.parametrize("fail_in", ["prefill", "decode"])
def test_a_failed_generate_leaves_the_callers_caches_set_up_as_it_found_them(fail_in: str) -> None:
    model = tiny_model(12)
    model.setup_caches(6, 32)
    prompts = [[3, 4, 5], [6, 7]]

    def fail(*_: object) -> None:
        raise _Interrupt

    if fail_in == "prefill":
        hook = model.layers[1].register_forward_hook(fail)
        with pytest.raises(_Interrupt):
            generate(model, prompts, max_new_tokens=4, num_samples=3)
        hook.remove()
    else:
        with pytest.raises(_Interrupt):
            generate(model, prompts, max_new_tokens=4, num_samples=3, on_tokens=fail)
    assert [(c.batch_size, c.max_seq_len, c.size) for c in model.kv_caches()] == [(6, 32, 0)] * 2
    again = generate(model, prompts, max_new_tokens=4, num_samples=3)  # the identical call now runs
    model.teardown_caches()
    assert torch.equal(again.tokens, generate(model, prompts, max_new_tokens=4, num_samples=3).tokens)


def test_passes_checked_up_front_make_no_host_reads_and_the_block_ends_cleanly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cache_state.checked_up_front()`` is how a loop skips the per-pass checks (it replaced
    the ``checked=`` argument): inside, a prefill makes no host read of its own; after it, even
    one left by an error, the checks are back."""
    model = tiny_model(12, num_layers=2)
    model.setup_caches(1, 64)
    counter = HostSyncCounter(monkeypatch)
    state = model.cache_state
    with torch.inference_mode(), state.checked_up_front():
        model(torch.randint(0, 61, (1, 3)), mask=torch.ones(3, 64, dtype=torch.bool).tril(2))
    assert counter.count == 1  # the chunked-prefill trap's one read; no id range, no capacity
    with pytest.raises(RuntimeError, match="boom"), state.checked_up_front():
        raise RuntimeError("boom")
    assert state.prechecked is False
    with (
        torch.inference_mode(),
        pytest.raises(ValueError, match=r"token ids must be in \[0, 61\), got min 0 and max 61"),
    ):
        model(torch.tensor([[0, 61]]))


@pytest.mark.parametrize("checked", [True, False])
def test_the_checked_argument_is_deprecated_and_still_honoured(checked: bool) -> None:
    model = tiny_model(12, num_layers=2)
    tokens = torch.tensor([[1, 2, 3]])
    with pytest.warns(DeprecationWarning, match=r"checked=\.\.\.\) is deprecated: .*checked_up_front"):
        logits = model(tokens, checked=checked)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)
    assert model.cache_state.prechecked is False
    fast = attn.compile_for_decode(model)
    with pytest.warns(DeprecationWarning, match=r"DecodeCompiled.forward\(checked=\.\.\.\) is deprecated"):
        fast(tokens, checked=checked)  # a multi-token pass: the model's, eager
