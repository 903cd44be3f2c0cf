"""attn/decoder.py: the reference decoder, its caches, and its bad-input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn import DecoderConfig, TransformerDecoder, padded_causal_mask, padding_positions

from .conftest import (
    GEMMA_OPTIONS,
    HostSyncCounter,
    assert_cache_unchanged,
    cache_state,
    tiny_config,
    tiny_model,
)
from .reference import reference_decoder


@st.composite
def decoder_setups(draw: st.DrawFn) -> dict:
    """The decoder's options: Llama's, Qwen's and Mistral's at random, or a tiny Gemma's."""
    num_kv_heads = draw(st.sampled_from([1, 2, 4]))
    gemma = draw(st.sampled_from([None, None, "gemma2", "gemma3"]))
    setup = dict(
        num_kv_heads=num_kv_heads,
        num_heads=num_kv_heads * draw(st.sampled_from([1, 2, 4])),
        head_dim=draw(st.sampled_from([4, 8, 16])),
        tie_embeddings=draw(st.booleans()),
        rope_base=draw(st.sampled_from([10_000.0, 500_000.0])),
        qkv_bias=draw(st.booleans()),
        out_bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        sliding_window=draw(st.sampled_from([None, 2, 5])),
    )
    if gemma is None:
        return setup
    every_layer = draw(st.booleans())  # the window (and Gemma 3's RoPE base) on every layer
    return setup | GEMMA_OPTIONS[gemma] | ({"window_layers": None} if every_layer else {})


@given(decoder_setups(), st.integers(1, 3), st.integers(1, 12))
def test_matches_naive_reference(setup: dict, batch: int, seq_len: int) -> None:
    model = tiny_model(**setup)
    tokens = torch.randint(0, 61, (batch, seq_len))
    torch.testing.assert_close(model(tokens), reference_decoder(model, tokens).float(), rtol=1e-4, atol=1e-4)


@given(
    setup=decoder_setups(),
    batch=st.integers(1, 3),
    prompt_len=st.integers(1, 12),
    decode_steps=st.integers(0, 8),
    seed=st.integers(0, 2**16),
)
def test_cached_prefill_and_decode_equal_one_uncached_forward(
    setup: dict, batch: int, prompt_len: int, decode_steps: int, seed: int
) -> None:
    model = tiny_model(seed, **setup)
    total = prompt_len + decode_steps
    tokens = torch.randint(0, 61, (batch, total))
    with torch.no_grad():
        expected = model(tokens)
    model.setup_caches(batch, total + 3)
    with attn.cached_inference(model):
        pieces = [model(tokens[:, :prompt_len])]
        pieces += [model(tokens[:, i : i + 1]) for i in range(prompt_len, total)]
    assert model.kv_caches()[0].size == total
    torch.testing.assert_close(torch.cat(pieces, 1), expected, rtol=1e-5, atol=1e-5)


@given(setup=decoder_setups(), batch=st.integers(1, 3), seq_len=st.integers(1, 10), seed=st.integers(0, 2**16))
def test_last_only_is_the_last_position_of_a_full_pass_and_fills_the_cache_alike(
    setup: dict, batch: int, seq_len: int, seed: int
) -> None:
    model = tiny_model(seed, **setup)
    tokens = torch.randint(0, 61, (batch, seq_len))
    with torch.no_grad():
        full = model(tokens)  # (b, s, v)
        last = model(tokens, last_only=True)  # (b, 1, v)
    assert last.shape == (batch, 1, 61)
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-5)
    states = []
    for last_only in (False, True):
        model.setup_caches(batch, seq_len + 2)
        with attn.cached_inference(model):
            out = model(tokens, last_only=last_only)
        torch.testing.assert_close(out[:, -1:], full[:, -1:], rtol=1e-5, atol=1e-5)
        states.append(cache_state(model))
    assert_cache_unchanged(model, states[0])  # the same keys and values, whichever way


def test_last_only_must_be_a_bool_and_a_bad_one_changes_nothing() -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    before = cache_state(model)
    with pytest.raises(TypeError, match=r"last_only must be a bool, got 'yes'"), attn.cached_inference(model):
        model(torch.randint(0, 61, (1, 3)), last_only="yes")
    assert_cache_unchanged(model, before)


def test_caches_set_up_but_unused_equal_no_caches_at_all() -> None:
    plain, cached = tiny_model(3), tiny_model(3)
    cached.setup_caches(2, 32)
    with attn.cached_inference(cached):
        cached(torch.randint(0, 61, (2, 5)))  # leave something in the cache
    tokens = torch.randint(0, 61, (2, 9))
    assert torch.equal(plain(tokens), cached(tokens))  # grad-enabled
    with torch.no_grad():
        assert torch.equal(plain(tokens), cached(tokens))
    with torch.inference_mode(), attn.disable_kv_cache(cached):
        assert torch.equal(plain(tokens), cached(tokens))


def test_padded_batch_scores_like_each_row_alone() -> None:
    model = tiny_model(4)
    rows = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    width = max(map(len, rows))
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    padding = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    with torch.no_grad():
        batched = model(tokens, input_pos=padding_positions(padding), mask=padded_causal_mask(padding))
        for i, row in enumerate(rows):
            alone = model(torch.tensor([row]))
            torch.testing.assert_close(batched[i, width - len(row) :], alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batched, reference_decoder(model, tokens, padding).float(), rtol=1e-4, atol=1e-4)


def test_setup_again_replaces_caches_and_state_dict_has_none() -> None:
    model = tiny_model()
    keys = set(model.state_dict())
    model.setup_caches(2, 16)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 4)))
    model.setup_caches(3, 24)
    caches = model.kv_caches()
    assert len(caches) == model.config.num_layers
    assert all((c.batch_size, c.max_seq_len, c.size) == (3, 24, 0) for c in caches)
    assert set(model.state_dict()) == keys


def test_cache_dtype_defaults_to_model_dtype_and_can_be_chosen() -> None:
    model = tiny_model().to(torch.bfloat16)
    model.setup_caches(1, 8)
    assert model.kv_caches()[0].k_cache.dtype == torch.bfloat16
    model.setup_caches(1, 8, dtype=torch.float32)
    assert model.kv_caches()[0].k_cache.dtype == torch.float32


@pytest.mark.parametrize(
    ("model_dtype", "cache_dtype"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
def test_a_cache_in_another_dtype_than_the_model_decodes_like_a_full_pass(
    model_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """Keys and values are stored in the cache's dtype; the queries follow them, and the
    layer's output comes back in the model's dtype."""
    model = tiny_model(8).to(model_dtype)
    tokens = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        expected = model(tokens).float()
    model.setup_caches(2, 16, dtype=cache_dtype)
    with attn.cached_inference(model):
        pieces = [model(tokens[:, :5])] + [model(tokens[:, i : i + 1]) for i in range(5, 9)]
    logits = torch.cat(pieces, 1)
    assert logits.dtype == model_dtype and model.kv_caches()[0].k_cache.dtype == cache_dtype
    torch.testing.assert_close(logits.float(), expected, rtol=0.05, atol=0.05)  # one bf16 rounding apart


def test_caches_set_up_in_inference_mode_are_normal_tensors() -> None:
    model = tiny_model()
    with torch.inference_mode():
        model.setup_caches(1, 8)
        with attn.kv_cache_mode(model):
            model(torch.randint(0, 61, (1, 3)))
    assert not any(c.k_cache.is_inference() for c in model.kv_caches())
    model.reset_caches()  # outside inference mode: must not raise
    assert all(c.size == 0 for c in model.kv_caches())
    with torch.inference_mode():
        model.reset_caches()


def test_teardown() -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    old = model.kv_caches()[0]
    model.teardown_caches()
    assert not model.caches_are_setup() and model.kv_caches() == []
    with pytest.raises(RuntimeError, match="torn down"):
        old.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(RuntimeError, match="caches are not set up"):
        model.reset_caches()
    with torch.inference_mode():
        model(torch.randint(0, 61, (1, 3)))  # plain causal attention


# -- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a positive multiple of num_kv_heads \(3\)"),
        (dict(embed_dim=30, num_heads=4), r"embed_dim \(30\) is not divisible by num_heads \(4\)"),
        (dict(vocab_size=0), r"DecoderConfig.vocab_size must be a positive int, got 0"),
        (dict(max_seq_len=-2), r"DecoderConfig.max_seq_len must be a positive int, got -2"),
        (dict(head_dim=5), r"head_dim must be a positive even int"),
        (dict(norm_eps=0.0), r"DecoderConfig.norm_eps must be a finite positive number, got 0.0"),
        (dict(activation="gelu"), r"DecoderConfig.activation must be one of \('silu', 'gelu_tanh'\), got 'gelu'"),
        (dict(attn_softcap=0.0), r"DecoderConfig.attn_softcap must be a finite positive number or None, got 0.0"),
        (dict(window_layers=(0,)), r"describe windowed layers, but sliding_window is None; set sliding_window"),
        (
            dict(local_rope_base=1e4),
            r"local_rope_base \(10000.0\) describe windowed layers, but sliding_window is None",
        ),
        (
            dict(sliding_window=4, window_layers=(1, 0)),
            r"a tuple of distinct layer indices in increasing order, each in \[0, 2\), got \(1, 0\)",
        ),
        (dict(sliding_window=4, window_layers=[0]), r"window_layers must be a tuple .* got \[0\]"),
        (dict(sliding_window=4, window_layers=(2,)), r"each in \[0, 2\), got \(2,\)"),
    ],
)
def test_bad_config(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [
        (torch.tensor([[1, 2, 61]]), ValueError, r"token ids must be in \[0, 61\), got min 1 and max 61"),
        (torch.tensor([[-1, 2]]), ValueError, r"got min -1"),
        (torch.tensor([[1.0, 2.0]]), ValueError, r"integer ids \(torch.long\), got dtype torch.float32"),
        (torch.tensor([1, 2]), ValueError, r"shape \(batch, seq_len\), got \(2,\); use tokens\[None\]"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, r"no positions"),
        ([[1, 2]], TypeError, r"must be a torch.Tensor"),
    ],
)
def test_bad_tokens_change_nothing(tokens: object, error: type, message: str) -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    before = cache_state(model)
    with pytest.raises(error, match=message), attn.cached_inference(model):
        model(tokens)
    assert_cache_unchanged(model, before)


def test_batch_mismatch_with_cache() -> None:
    model = tiny_model()
    model.setup_caches(2, 8)
    before = cache_state(model)
    with (
        pytest.raises(ValueError, match=r"batch size 3 does not match the KV-cache batch size 2"),
        attn.cached_inference(model),
    ):
        model(torch.randint(0, 61, (3, 2)))
    assert_cache_unchanged(model, before)


def test_overflow_leaves_every_layer_unchanged() -> None:
    model = tiny_model()
    model.setup_caches(1, 8)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (1, 6)))
        before = cache_state(model)
        with pytest.raises(RuntimeError, match=r"holds 6 tokens, 3 more do not fit in its capacity of 8"):
            model(torch.randint(0, 61, (1, 3)))
    assert_cache_unchanged(model, before)


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.ones(1, 2, 7, dtype=torch.bool), r"covers the first 7 cache slots, .* after the 6 .* at least 8"),
        (torch.ones(1, 2, 9, dtype=torch.bool), r"\(1, 2, n\) or \(2, n\) .* 1 <= n <= 8 .* got \(1, 2, 9\)"),
        (torch.ones(1, 3, 8, dtype=torch.bool), r"\(1, 2, n\) or \(2, n\) .* got \(1, 3, 8\)"),
        (torch.ones(2, 8), r"mask must be a bool tensor"),
    ],
)
def test_a_bad_mask_over_cache_slots_leaves_every_layer_unchanged(mask: torch.Tensor, message: str) -> None:
    """A mask over the cache's first n slots must hold the pass's tokens and fit the cache;
    one that does not is refused before any layer writes."""
    model = tiny_model()
    model.setup_caches(1, 8)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (1, 6)))
        before = cache_state(model)
        with pytest.raises(ValueError, match=message):
            model(torch.randint(0, 61, (1, 2)), mask=mask)
    assert_cache_unchanged(model, before)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 8), r"batch_size must be a positive int, got 0"),
        ((1, 0), r"max_seq_len must be a positive int, got 0"),
        ((1.5, 8), r"batch_size must be a positive int, got 1.5"),
        ((1, 65), r"max_seq_len \(65\) exceeds the model's max_seq_len \(64"),
    ],
)
def test_bad_setup_sizes_keep_old_caches(args: tuple, message: str) -> None:
    model = tiny_model()
    model.setup_caches(2, 8)
    old = model.kv_caches()
    with pytest.raises(ValueError, match=message):
        model.setup_caches(*args)
    assert model.kv_caches() == old


def test_config_is_frozen_and_derives_head_dim() -> None:
    config = DecoderConfig(vocab_size=10, embed_dim=32, num_layers=1, num_heads=4, hidden_dim=8, max_seq_len=8)
    assert (config.head_dim, config.num_kv_heads) == (8, 4)
    with pytest.raises(AttributeError):
        config.embed_dim = 64  # type: ignore[misc]
    assert isinstance(TransformerDecoder(config).layers[0].attn, attn.MultiHeadAttention)


def test_a_decision_passed_in_cannot_write_the_cache_under_grad() -> None:
    model = tiny_model(3)
    model.setup_caches(1, 8)
    tokens = torch.randint(0, 61, (1, 3))
    with pytest.raises(RuntimeError, match=r"use_cache=True in a grad-enabled forward pass"):
        model(tokens, use_cache=True)
    assert model.kv_caches()[0].size == 0
    with torch.no_grad():
        assert model(tokens, use_cache=model.uses_cache(3)).shape == (1, 3, 61)
    assert model.kv_caches()[0].size == 0  # no_grad without the flag: the decision was False
    with torch.inference_mode():
        model(tokens, use_cache=model.uses_cache(3))
    assert model.kv_caches()[0].size == 3


@given(
    setup=decoder_setups(),
    prompt_len=st.integers(1, 6),
    decode_steps=st.integers(1, 6),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_rewind_and_continue_equals_never_having_gone_past(
    setup: dict, prompt_len: int, decode_steps: int, data: st.DataObject, seed: int
) -> None:
    """Run to n tokens, rewind to r, feed other tokens: the logits are those of one uncached
    pass over the first r tokens and the new ones (a rejected draft, rolled back)."""
    model = tiny_model(seed, **setup)
    n = prompt_len + decode_steps
    to = data.draw(st.integers(0, n), label="to")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 61, (2, n), generator=g)
    other = torch.randint(0, 61, (2, 3), generator=g)
    model.setup_caches(2, n + 3)
    with attn.cached_inference(model):
        model(tokens[:, :prompt_len])
        for i in range(prompt_len, n):
            model(tokens[:, i : i + 1])
        model.rewind_caches(to)
        assert {c.size for c in model.kv_caches()} == {to}
        got = model(other)
    with torch.no_grad():
        expected = model(torch.cat((tokens[:, :to], other), 1))[:, to:]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@given(setup=decoder_setups(), copies=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_fork_equals_prefilling_every_copy(setup: dict, copies: int, seed: int) -> None:
    """A fork repeats each row's cache bit for bit, and equals prefilling every copy up to
    rounding (a batch of other rows runs other BLAS blocking: not always the same bits)."""
    model = tiny_model(seed, **setup)
    prompts = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(seed))
    expanded = prompts.repeat_interleave(copies, 0)  # (2 * copies, 5)
    model.setup_caches(2 * copies, 8)
    with attn.cached_inference(model):
        model(expanded)
    prefilled = cache_state(model)
    model.setup_caches(2, 8)
    with attn.cached_inference(model):
        model(prompts)
    repeated = [tuple(t.repeat_interleave(copies, 0) if t.dim() else t for t in state) for state in cache_state(model)]
    model.fork_caches(copies)
    assert {c.batch_size for c in model.kv_caches()} == {2 * copies}
    assert_cache_unchanged(model, repeated)
    for (k, v, pos), (k_all, v_all, pos_all) in zip(cache_state(model), prefilled, strict=True):
        assert torch.equal(pos, pos_all)
        torch.testing.assert_close(k, k_all, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_all, rtol=1e-5, atol=1e-5)


def test_cache_operations_check_before_changing_any_layer() -> None:
    model = tiny_model(4)
    with pytest.raises(RuntimeError, match=r"caches are not set up: call setup_caches\(\) first"):
        model.rewind_caches(0)
    model.setup_caches(2, 8)
    with attn.cached_inference(model):
        model(torch.randint(0, 61, (2, 3)))
    before = cache_state(model)
    with pytest.raises(ValueError, match=r"cannot rewind to 5: the cache holds 3 tokens"):
        model.rewind_caches(5)
    with pytest.raises(ValueError, match=r"rows must be in \[0, 2\)"):
        model.select_caches([0, 2])
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match=r"num_copies must be a positive int"):
            model.fork_caches(bad)  # type: ignore[arg-type]
    assert_cache_unchanged(model, before)
    assert {c.batch_size for c in model.kv_caches()} == {2}


def test_decode_after_rewinds_compiles_nothing_new() -> None:
    from torch._dynamo.testing import CompileCounter

    model = tiny_model(5)
    model.setup_caches(1, 16)
    counter = CompileCounter()
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    step = torch.tensor([[3]])
    with attn.cached_inference(model):
        compiled(torch.tensor([[1, 2, 3, 4]]))
        first = compiled(step)
        for to in (2, 3, 1, 2):  # the fill goes 5 -> 2 -> 3 -> 3 -> 4 -> 1 -> 2 -> 2 -> 3
            model.rewind_caches(to)
            compiled(step)
        model.rewind_caches(torch.tensor(0))
        compiled(torch.tensor([[1, 2, 3, 4]]))
        again = compiled(step)
    assert counter.frame_count == 2, counter.frame_count  # the prefill and one decode graph
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("num_layers", [1, 6])
def test_cache_operations_check_once_for_every_layer(monkeypatch: pytest.MonkeyPatch, num_layers: int) -> None:
    """rewind_caches and select_caches read their argument's bounds once (one host sync), not
    once per layer; fork_caches reads the fill once on the CPU (the slots its copies share) and
    nothing on other devices."""
    model = tiny_model(3, num_layers=num_layers)
    model.setup_caches(2, 16)
    with torch.inference_mode():
        model(torch.randint(0, 61, (2, 5)))
    counter = HostSyncCounter(monkeypatch)
    model.rewind_caches(3)
    model.select_caches([1, 0, 1])
    counts = [counter.count]
    model.fork_caches(2)
    counts.append(counter.count)
    assert counts == [2, 3], counts
    assert model.cache_state.shared_slots == (2, 3)
    assert [c.batch_size for c in model.kv_caches()] == [6] * num_layers
    assert all(int(c.size) == 3 for c in model.kv_caches())


def test_a_fork_records_the_slots_its_copies_share_until_they_may_change() -> None:
    """``shared_slots`` after ``fork_caches(G)``: (G, the fill); none for one copy or an empty
    cache; dropped by every operation that moves rows or slots below the fill (a pass writes
    from the fill on, so it keeps it)."""
    model = tiny_model(7)
    model.setup_caches(2, 16)
    model.fork_caches(2)
    assert model.cache_state.shared_slots is None  # nothing written yet
    prompt = torch.randint(0, 61, (4, 3), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(prompt)
    model.fork_caches(1)
    assert model.cache_state.shared_slots is None
    operations = {
        "select": lambda: model.select_caches([0, 1, 2, 3]),
        "rewind": lambda: model.rewind_caches(3),
        "reset": model.reset_caches,
        "setup": lambda: model.setup_caches(4, 16),
        "teardown": model.teardown_caches,
    }
    for name, operation in operations.items():
        model.setup_caches(2, 16)
        with torch.inference_mode():
            model(prompt[:2])
        model.fork_caches(2)
        assert model.cache_state.shared_slots == (2, 3), name
        with torch.inference_mode():
            model(prompt[:, :1])  # writes slot 3: the shared slots stay
        assert model.cache_state.shared_slots == (2, 3), name
        operation()
        assert model.cache_state.shared_slots is None, name


def test_every_layer_shares_the_models_cache_state() -> None:
    model = tiny_model(6)
    states = {id(layer.attn.cache_state) for layer in model.layers}
    assert states == {id(model.cache_state)}
    model.setup_caches(2, 8)
    assert all(cache.state is model.cache_state for cache in model.kv_caches())
    assert [m for m in model.modules() if isinstance(m, attn.kv_cache.CacheState)] == [model.cache_state]
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert model.cache_state.size == 3  # advanced once for the pass, not once per layer
    model.fork_caches(2)  # new buffers, same state
    assert model.cache_state.batch_size == 4 and all(c.batch_size == 4 for c in model.kv_caches())
    model.teardown_caches()
    assert model.kv_caches() == [] and not model.caches_are_setup()


@pytest.mark.parametrize(
    ("field", "value"),
    [("norm_eps", float("nan")), ("norm_eps", float("inf")), ("rope_base", float("inf")), ("rope_base", True)],
)
def test_config_refuses_a_non_finite_eps_or_base(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"DecoderConfig.{field} must be a finite positive number, got {value!r}"):
        tiny_config(**{field: value})


def _layer_failing(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, fail_at: int) -> None:
    """Makes ``cls.name`` raise MemoryError on its ``fail_at``-th call (0-based): out of memory halfway."""
    original, calls = getattr(cls, name), []

    def failing(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == fail_at + 1:
            raise MemoryError("simulated: out of memory")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, failing)


@pytest.mark.parametrize("operation", ["fork", "select"])
def test_a_row_operation_that_runs_out_of_memory_halfway_changes_no_layer(
    monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    model = tiny_model(3, num_layers=4)
    model.setup_caches(2, 16)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    before = cache_state(model)
    _layer_failing(monkeypatch, attn.KVCache, "gather", fail_at=2)
    with pytest.raises(MemoryError):
        model.fork_caches(3) if operation == "fork" else model.select_caches([1, 0, 1])
    assert [c.batch_size for c in model.kv_caches()] == [2, 2, 2, 2]
    assert_cache_unchanged(model, before)


def test_setup_caches_that_runs_out_of_memory_halfway_keeps_the_old_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model(3, num_layers=4)
    model.setup_caches(2, 16)
    old = model.kv_caches()
    _layer_failing(monkeypatch, attn.MultiHeadAttention, "new_cache", fail_at=2)
    with pytest.raises(MemoryError):
        model.setup_caches(5, 32)
    assert model.kv_caches() == old and not any(c.torn_down for c in old)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32"])
def test_setup_caches_refuses_a_dtype_that_cannot_hold_keys(dtype: object) -> None:
    model = tiny_model(3)
    model.setup_caches(1, 8)
    old = model.kv_caches()
    with pytest.raises(ValueError, match=r"setup_caches dtype .* cannot hold keys and values; pass a floating dtype"):
        model.setup_caches(1, 8, dtype=dtype)  # type: ignore[arg-type]
    assert model.kv_caches() == old


@given(
    failing_layer=st.integers(0, 3),
    prompt_len=st.integers(1, 5),
    num_tokens=st.integers(1, 4),
    interrupt=st.booleans(),
    parity=st.booleans(),
)
def test_a_pass_that_fails_in_a_later_layer_leaves_every_layer_as_it_was(
    failing_layer: int, prompt_len: int, num_tokens: int, interrupt: bool, parity: bool
) -> None:
    """Layers before the failing one have written their keys; they are rolled back, so the
    layers never disagree, and the next pass continues as if the failed one never ran."""
    model = tiny_model(9, num_layers=4)
    attn.set_parity_mode(model, parity)
    model.setup_caches(2, 16)
    prompt, step = torch.randint(0, 61, (2, prompt_len)), torch.randint(0, 61, (2, num_tokens))
    with attn.cached_inference(model):
        model(prompt)
    before = cache_state(model)
    error = KeyboardInterrupt if interrupt else RuntimeError

    def fail(module: torch.nn.Module, args: object) -> None:
        raise error("out of memory, say")

    hook = model.layers[failing_layer].mlp.register_forward_pre_hook(fail)
    with pytest.raises(error), attn.cached_inference(model):
        model(step)
    hook.remove()
    assert_cache_unchanged(model, before)
    with attn.cached_inference(model):
        continued = model(step)
    with torch.no_grad():
        expected = model(torch.cat((prompt, step), 1))[:, prompt_len:]
    torch.testing.assert_close(continued, expected, rtol=1e-5, atol=1e-5)


def test_first_kv_cache_is_deprecated_for_cache_state() -> None:
    model = tiny_model(6)
    with pytest.warns(DeprecationWarning, match=r"read model.cache_state"):
        assert model.first_kv_cache() is None
    model.setup_caches(2, 8)
    with pytest.warns(DeprecationWarning):
        assert model.first_kv_cache() is model.kv_caches()[0]
