"""attn/logprobs.py against a full forward over every prompt + completion, written here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn.demo.lora import adapters_enabled, add_lora

from .conftest import GEMMA_OPTIONS, assert_cache_unchanged, cache_state, tiny_model


def full_forward_logprobs(model, prompts, groups, temperature=1.0):
    """Each prompt + completion as its own row of one left-padded batch: (R, N) log-probs, mask."""
    pairs = [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]
    P, N = max(len(p) for p in prompts), max(len(c) for _, c in pairs)
    tokens = torch.zeros(len(pairs), P + N, dtype=torch.long)
    real = torch.zeros(len(pairs), P + N, dtype=torch.bool)
    for i, (p, c) in enumerate(pairs):
        tokens[i, P - len(p) : P + len(c)] = torch.tensor([*p, *c])
        real[i, P - len(p) : P + len(c)] = True
    logits = model(tokens, input_pos=attn.padding_positions(real), mask=attn.padded_causal_mask(real))
    logprobs = (logits[:, P - 1 : -1].float() / temperature).log_softmax(-1)
    chosen = logprobs.gather(-1, tokens[:, P:, None]).squeeze(-1)
    return torch.where(real[:, P:], chosen, 0.0), real[:, P:]


ids = st.integers(0, 60)
groups_strategy = st.lists(
    st.tuples(
        st.lists(ids, min_size=1, max_size=8), st.lists(st.lists(ids, min_size=1, max_size=6), min_size=1, max_size=3)
    ),
    min_size=1,
    max_size=3,
)


@given(
    batch=groups_strategy,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    parity=st.booleans(),
    kv_heads=st.sampled_from([1, 4]),
    window=st.sampled_from([None, 4]),
    temperature=st.sampled_from([1.0, 0.7]),
    family=st.sampled_from([None, "gemma2", "gemma3"]),
)
def test_equals_a_full_forward_bitwise_in_parity_mode(
    batch, dtype, parity, kv_heads, window, temperature, family
) -> None:
    prompts, groups = [p for p, _ in batch], [g for _, g in batch]
    options = GEMMA_OPTIONS[family] if family else {"sliding_window": window}
    model = tiny_model(2, num_kv_heads=kv_heads, **options).to(dtype)
    parity = parity and family != "gemma2"  # parity mode refuses soft-capped attention
    attn.set_parity_mode(model, parity)
    with torch.no_grad():
        ours = attn.completion_logprobs(model, prompts, groups, temperature=temperature)
        theirs, real = full_forward_logprobs(model, prompts, groups, temperature)
    assert torch.equal(ours.mask, real)
    if parity:
        assert torch.equal(ours.logprobs, theirs)
    else:
        tolerance = {} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
        torch.testing.assert_close(ours.logprobs, theirs, **tolerance)


@given(batch=groups_strategy, parity=st.booleans())
def test_gradients_equal_the_full_forwards(batch, parity) -> None:
    prompts, groups = [p for p, _ in batch], [g for _, g in batch]
    model = tiny_model(3).train()
    attn.set_parity_mode(model, parity)
    weights = torch.randn(sum(map(len, groups)), max(len(c) for g in groups for c in g))

    def gradients(logprobs: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad((logprobs * weights).sum(), list(model.parameters())))

    ours = gradients(attn.completion_logprobs(model, prompts, groups).logprobs)
    theirs = gradients(full_forward_logprobs(model, prompts, groups)[0])
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_old_policy_logprobs_of_a_generation_are_exact_with_lora_on_and_off() -> None:
    model = tiny_model(4).to(torch.bfloat16)
    add_lora(model, rank=2, alpha=4.0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))  # adapters that change the output
    attn.set_parity_mode(model)
    prompts, G = [[5, 6, 7], [9, 10, 11, 12, 13]], 3
    out = attn.generate(
        model, prompts, max_new_tokens=6, temperature=1.0, num_samples=G, generator=torch.Generator().manual_seed(1)
    )
    groups = [
        [
            row[real].tolist()
            for row, real in zip(
                out.generated[i * G : (i + 1) * G], out.generated_mask[i * G : (i + 1) * G], strict=True
            )
        ]
        for i in range(2)
    ]
    assert out.groups(G) == (prompts, groups)
    new = attn.completion_logprobs(model, *out.groups(G), width=6)  # with grad: the policy's step
    assert new.logprobs.requires_grad
    assert torch.equal(new.mask, out.generated_mask)
    assert torch.equal(new.logprobs, out.logprobs)  # 0 past each completion in both
    with torch.no_grad(), adapters_enabled(model, False):
        reference = attn.completion_logprobs(model, prompts, groups)
        full, _ = full_forward_logprobs(model, prompts, groups)
    assert torch.equal(reference.logprobs, full)
    assert not torch.equal(reference.logprobs, new.logprobs.detach())


def test_never_touches_a_cache() -> None:
    model = tiny_model(5)
    model.setup_caches(2, 32)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    before = cache_state(model)
    with torch.inference_mode():
        attn.completion_logprobs(model, [[1, 2]], [[[3, 4], [5]]])
    with attn.cached_inference(model):
        attn.completion_logprobs(model, [[1, 2]], [[[3, 4], [5]]])
    attn.completion_logprobs(model, [[1, 2]], [[[3, 4], [5]]]).logprobs.sum().backward()
    assert_cache_unchanged(model, before)


@pytest.mark.parametrize(
    ("prompts", "groups", "kwargs", "match"),
    [
        ([[1]], [[[2]], [[3]]], {}, "1 prompts and 2 groups"),
        ([[]], [[[2]]], {}, "prompt 0 is empty"),
        ([[1]], [[]], {}, "group 0 holds no completions"),
        ([[1]], [[[2], []]], {}, "completion 1 of group 0 is empty"),
        ([[1, 99]], [[[2]]], {}, r"ids must be ints in \[0, 61\), got \[99\]"),
        ([[1]], [[[2.0]]], {}, r"got \[2.0\]"),
        ([[1] * 60], [[[2] * 5]], {}, r"exceed the model's max_seq_len \(64\)"),
        ([[1]], [[[2]]], {"temperature": 0.0}, "temperature must be a positive number, got 0.0"),
        ([[1]], [[[2, 3, 4]]], {"width": 2}, "width must be an int >= the longest completion \\(3 tokens\\), got 2"),
    ],
)
def test_bad_input_is_refused_with_the_values(prompts, groups, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        attn.completion_logprobs(tiny_model(0), prompts, groups, **kwargs)


def test_numpy_and_tensor_element_ids_are_ids() -> None:
    np = pytest.importorskip("numpy")
    model = tiny_model(6)
    with torch.no_grad():
        plain = attn.completion_logprobs(model, [[1, 2]], [[[3, 4]]]).logprobs
        other = attn.completion_logprobs(model, [np.array([1, 2])], [[torch.tensor([3, 4]).tolist()]]).logprobs
    assert torch.equal(plain, other)


def test_width_pads_with_masked_zeros() -> None:
    model = tiny_model(7)
    with torch.no_grad():
        narrow = attn.completion_logprobs(model, [[1, 2]], [[[3, 4], [5]]])
        wide = attn.completion_logprobs(model, [[1, 2]], [[[3, 4], [5]]], width=5)
    assert wide.logprobs.shape == wide.mask.shape == (2, 5) and wide.mask.dtype == torch.bool
    assert torch.equal(wide.logprobs[:, :2], narrow.logprobs) and torch.equal(wide.mask[:, :2], narrow.mask)
    assert not wide.mask[:, 2:].any() and not wide.logprobs[:, 2:].any()
