"""attn/parity.py: the invariant kernels against naive references, and parity mode's promise:
generation's log-probs equal the training forward's, bit for bit."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter

import attn
import attn.parity
from attn.parity import ROWS, exact_attention, invariant_linear

from .conftest import GEMMA_OPTIONS, assert_cache_unchanged, cache_state, tiny_model

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


@given(
    rows=st.integers(1, 3 * ROWS + 5),
    inner=st.integers(1, 80),
    outer=st.integers(1, 70),
    dtype=DTYPES,
    bias=st.booleans(),
    native=st.booleans(),
    data=st.data(),
)
def test_invariant_linear_rows_do_not_depend_on_the_batch(rows, inner, outer, dtype, bias, native, data) -> None:
    """Both of its products: attn::invariant_linear where the CPU runs it, and the ROWS-row BLAS
    products it falls back to (``native`` False, or a CPU without the kernel)."""
    torch.manual_seed(rows * 1000 + inner)
    x = torch.randn(rows, inner).to(dtype)
    weight = torch.randn(outer, inner).to(dtype)
    b = torch.randn(outer).to(dtype) if bias else None
    fallback = mock.patch.object(attn.parity, "invariant_linear_available", return_value=False)
    with contextlib.nullcontext() if native else fallback:
        out = invariant_linear(x, weight, b)  # (rows, outer)
        row = data.draw(st.integers(0, rows - 1))
        alone = invariant_linear(x[row : row + 1], weight, b)
        shuffled = torch.randperm(rows)
        again = invariant_linear(x[shuffled], weight, b)
    torch.testing.assert_close(
        out.float(),
        F.linear(x.double(), weight.double(), None if b is None else b.double()).float(),
        **_tol(dtype, inner),
    )
    assert torch.equal(out[row : row + 1], alone)
    assert torch.equal(again, out[shuffled])


def _tol(dtype: torch.dtype, inner: int) -> dict[str, float]:
    return {"atol": 1e-4 * inner, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2 * inner**0.5, "rtol": 2e-2}


def test_invariant_linear_gradients_match_f_linear() -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(37, 11, dtype=torch.float64)
    ours = torch.autograd.grad(invariant_linear(x, weight, bias), (x, weight, bias), grad)
    theirs = torch.autograd.grad(F.linear(x, weight, bias), (x, weight, bias), grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)


def naive_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d)) v in float64, key heads repeated for each query head."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@given(
    b=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    s=st.integers(1, 9),
    extra=st.integers(0, 9),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
    block=st.integers(1, 10),
    causal=st.booleans(),
)
def test_exact_attention_matches_naive_and_ignores_key_order_and_masked_keys(
    b, kv_heads, group, s, extra, dtype, seed, block, causal
) -> None:
    """Also in query blocks (``QUERY_BLOCK`` drawn; s > block takes them): each block reads the
    keys up to its last visible one, and gives the bits of the pass in one block."""
    torch.manual_seed(seed)
    L, h, d = s + extra, kv_heads * group, 8
    q = torch.randn(b, h, s, d).to(dtype)
    k, v = torch.randn(b, kv_heads, L, d).to(dtype), torch.randn(b, kv_heads, L, d).to(dtype)
    allowed = torch.rand(b, 1, s, L) < 0.7
    if causal:  # the keys past a block's last query are skipped
        allowed &= torch.ones(s, L, dtype=torch.bool).tril(extra)
    allowed[..., 0] = True  # every query sees a key
    with mock.patch.object(attn.parity, "QUERY_BLOCK", block):
        out = exact_attention(q, k, v, allowed)
    assert torch.equal(exact_attention(q, k, v, allowed), out)  # QUERY_BLOCK 128: one block
    torch.testing.assert_close(
        out.double(),
        naive_attention(q, k, v, allowed),
        **({} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}),
    )
    order = torch.randperm(L)  # the same keys in another order, and two masked keys more
    junk = torch.randn(b, kv_heads, 2, d).to(dtype)
    k2, v2 = torch.cat((k[:, :, order], junk), 2), torch.cat((v[:, :, order], junk), 2)
    allowed2 = torch.cat((allowed[..., order], torch.zeros(b, 1, s, 2, dtype=torch.bool)), -1)
    assert torch.equal(exact_attention(q, k2, v2, allowed2), out)


@pytest.mark.parametrize("block", [2, 128])
def test_exact_attention_causal_gradients_and_a_query_with_no_key(block) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    with mock.patch.object(attn.parity, "QUERY_BLOCK", block):
        out = exact_attention(q, k, v, None)  # causal
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        torch.testing.assert_close(out, naive_attention(q, k, v, causal))
        grad = torch.randn_like(out)
        ours = torch.autograd.grad(out, (q, k, v), grad)
        theirs = torch.autograd.grad(naive_attention(q, k, v, causal), (q, k, v), grad)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b)
        nothing = torch.zeros(2, 1, 5, 5, dtype=torch.bool)
        blind = exact_attention(q, k, v, nothing)
        assert torch.equal(blind, torch.zeros_like(q))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in torch.autograd.grad(blind, (q, k, v), grad))


@given(
    b=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    s=st.integers(1, 9),
    extra=st.integers(0, 6),
    seed=st.integers(0, 2**16),
    block=st.integers(1, 10),
    causal=st.booleans(),
)
def test_exact_attention_gradients_in_query_blocks_match_naive(
    b, kv_heads, group, s, extra, seed, block, causal
) -> None:
    """A pass with grad runs its forward and backward in query blocks (``QUERY_BLOCK`` drawn):
    each block's keys end at its last visible one, and the keys' and values' gradients sum
    over the blocks. The forward is the no-grad pass's bits."""
    torch.manual_seed(seed)
    L, h, d = s + extra, kv_heads * group, 8
    q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, L, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    allowed = torch.rand(b, 1, s, L) < 0.7
    if causal:
        allowed &= torch.ones(s, L, dtype=torch.bool).tril(extra)
    allowed[..., 0] = True  # every query sees a key
    with mock.patch.object(attn.parity, "QUERY_BLOCK", block):
        out = exact_attention(q, k, v, allowed)
        with torch.no_grad():
            assert torch.equal(exact_attention(q, k, v, allowed), out)
    grad = torch.randn_like(out)  # the backward recomputes the forward's blocks, whatever QUERY_BLOCK is now
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(naive_attention(q, k, v, allowed), (q, k, v), grad)
    for mine, naive in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, naive)


def training_logprobs(model, tokens, positions, mask, prompt_length, targets, temperature=1.0):
    """The policy's training forward: train mode, grad on, logits of every position."""
    model.train()
    try:
        logits = model(tokens, input_pos=positions, mask=mask)
    finally:
        model.eval()
    assert logits.requires_grad
    shifted = logits[:, prompt_length - 1 : -1].float() / temperature
    return shifted.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


@given(
    prompts=st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=9), min_size=1, max_size=3),
    samples=st.integers(1, 3),
    steps=st.integers(1, 7),
    dtype=DTYPES,
    kv_heads=st.sampled_from([1, 2, 4]),
    window=st.sampled_from([None, 3]),
    seed=st.integers(0, 1000),
    gemma3=st.booleans(),
    block=st.sampled_from([2, 3, 128]),
)
def test_generation_logprobs_equal_the_training_forward_bit_for_bit(
    prompts, samples, steps, dtype, kv_heads, window, seed, gemma3, block
) -> None:
    """Generation's prefill runs its attention in query blocks of the drawn ``QUERY_BLOCK``, the
    training forward (grad) in blocks of 128."""
    options = GEMMA_OPTIONS["gemma3"] if gemma3 else {"sliding_window": window}
    model = tiny_model(seed % 7, num_kv_heads=kv_heads, **options).to(dtype)
    attn.set_parity_mode(model)
    generator = torch.Generator().manual_seed(seed)
    with mock.patch.object(attn.parity, "QUERY_BLOCK", block):
        out = attn.generate(
            model,
            prompts,
            max_new_tokens=steps,
            temperature=1.0,
            num_samples=samples,
            generator=generator,
            return_logits=True,
        )
    P, valid = out.prompt_length, out.generated_mask
    trained = training_logprobs(
        model, out.tokens, out.positions, attn.padded_causal_mask(out.padding_mask), P, out.generated
    )
    sampled = out.logits.log_softmax(-1).gather(-1, out.generated[..., None]).squeeze(-1)
    assert torch.equal(trained[valid], sampled[valid])
    assert torch.equal(trained[valid], out.logprobs[valid])
    # Each row alone, unpadded and in a batch of one: another padding, another batch.
    row = seed % out.tokens.shape[0]
    alone = out.tokens[row][out.padding_mask[row]][None]  # (1, real tokens)
    prompt_len = len(prompts[row // samples])
    targets = alone[:, prompt_len:]
    trained_alone = training_logprobs(model, alone, None, None, prompt_len, targets)
    assert torch.equal(trained_alone[0], trained[row, : targets.shape[1]])


def test_a_prefill_in_chunks_gives_the_full_forwards_logits() -> None:
    model = tiny_model(3).to(torch.bfloat16)
    attn.set_parity_mode(model)
    tokens = torch.randint(1, 60, (2, 12))
    full = model(tokens)
    model.setup_caches(2, 32)
    with attn.cached_inference(model):
        chunks = [model(tokens[:, :5]), model(tokens[:, 5:6]), model(tokens[:, 6:])]
    assert torch.equal(torch.cat(chunks, 1), full)


def test_parity_mode_keeps_the_cache_contract() -> None:
    model = tiny_model(4)
    attn.set_parity_mode(model)
    model.setup_caches(1, 32)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))
    before = cache_state(model)
    with torch.no_grad():
        model(torch.tensor([[4, 5, 6, 7]]))
    model(torch.tensor([[4, 5, 6, 7]])).sum().backward()
    assert_cache_unchanged(model, before)


def test_torch_compile_runs_parity_mode_eagerly_and_keeps_the_equality() -> None:
    model = tiny_model(5).to(torch.bfloat16)
    attn.set_parity_mode(model)
    tokens = torch.randint(1, 60, (2, 7))
    eager = model(tokens)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    assert torch.equal(compiled(tokens), eager)
    assert counter.op_count <= 2  # the checks before the parity forward: no layer was compiled


def test_compile_for_decode_refuses_parity_mode() -> None:
    model = tiny_model(6)
    attn.set_parity_mode(model)
    with pytest.raises(RuntimeError, match=r"parity mode.*set_parity_mode\(model, False\)"):
        attn.compile_for_decode(model)
    attn.set_parity_mode(model, False)
    fast = attn.compile_for_decode(model)
    attn.set_parity_mode(model)  # turned on after compiling: the step refuses too
    model.setup_caches(1, 16)
    with attn.cached_inference(model), pytest.raises(RuntimeError, match="parity mode"):
        fast(torch.tensor([[3]]))
    assert int(model.kv_caches()[0].cache_pos) == 0


def test_set_parity_mode_rejects_what_it_cannot_set() -> None:
    model = tiny_model(0)
    with pytest.raises(ValueError, match="must be a bool, got 1"):
        attn.set_parity_mode(model, 1)
    with pytest.raises(ValueError, match="got a Linear"):
        attn.set_parity_mode(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="got a DecodeCompiled; attn\\.compile_for_decode refuses"):
        attn.set_parity_mode(attn.compile_for_decode(model))
    assert model.parity is False
    attn.set_parity_mode(torch.compile(model, backend="eager"))  # sets it on the model itself
    assert model.parity is True
    capped = tiny_model(0, **GEMMA_OPTIONS["gemma2"])
    with pytest.raises(ValueError, match=r"soft-caps its attention scores \(attn_softcap=5.0, Gemma 2\)"):
        attn.set_parity_mode(capped)
    assert capped.parity is False


@given(
    groups=st.integers(1, 3),
    group=st.integers(2, 4),
    kv_heads=st.integers(1, 2),
    heads_per_kv=st.integers(1, 3),
    length=st.integers(1, 24),
    shared_percent=st.integers(0, 100),  # not a float draw: a torch leg's flush-to-zero breaks hypothesis' floats
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_exact_attention_reads_shared_slots_once_for_each_group(
    groups: int,
    group: int,
    kv_heads: int,
    heads_per_kv: int,
    length: int,
    shared_percent: int,
    dtype: torch.dtype,
    seed: int,
) -> None:
    """Rows whose first slots copy their group's first row (a fork): parity mode's attention of a
    cached step that reads those slots from that row once for the group (``shared``) gives the
    bits of the one that reads every row's own copy, and keeps them with other values in the
    copies."""
    gen = torch.Generator().manual_seed(seed)
    batch, slots = groups * group, max(1, shared_percent * length // 100)
    q = torch.randn(batch, kv_heads * heads_per_kv, 1, 16, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, length, 16, generator=gen).to(dtype) for _ in "kv")
    for cache in (k, v):
        cache[:, :, :slots] = cache[::group, :, :slots].repeat_interleave(group, 0)
    mask = torch.rand(batch, 1, 1, length, generator=gen) < 0.8
    expected = exact_attention(q, k, v, mask)
    copies = torch.arange(batch) % group != 0
    for cache in (k, v):
        cache[copies, :, :slots] = torch.randn(cache[copies, :, :slots].shape, generator=gen).to(dtype)
    assert torch.equal(exact_attention(q, k, v, mask, shared=(group, slots)), expected)
    if bool(mask[copies, ..., :slots].any()):  # the poisoned copies, read: other values
        assert not torch.equal(exact_attention(q, k, v, mask), expected)


def test_a_parity_mode_generation_reads_each_groups_prompt_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate(num_samples=3)`` in parity mode: its decode steps read the forked prompt's
    slots once for each group (the shared kernel runs in every layer of every step after the
    first), and its log-probabilities stay the training forward's, bit for bit."""
    model = tiny_model(11).to(torch.bfloat16)
    attn.set_parity_mode(model)
    calls: list[tuple[int, int]] = []
    shared_attention = attn.parity._shared_attention

    def counted(q, k, v, mask, scale, group, slots):  # type: ignore[no-untyped-def]
        calls.append((group, slots))
        return shared_attention(q, k, v, mask, scale, group, slots)

    monkeypatch.setattr(attn.parity, "_shared_attention", counted)
    prompts = [[1, 2, 3, 4], [5, 6]]
    with torch.inference_mode():
        out = attn.generate(model, prompts, max_new_tokens=4, temperature=1.0, num_samples=3)
    assert calls == [(3, 4)] * (model.config.num_layers * 3)  # steps 1 to 3: the prompt's 4 slots
    prompts_, groups = out.groups(3)
    trained = attn.completion_logprobs(model, prompts_, groups, width=4).logprobs
    assert torch.equal(trained[out.generated_mask], out.logprobs[out.generated_mask])
