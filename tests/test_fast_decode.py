"""attn/fast_decode.py: the compiled decode step gives eager's answers, keeps the KV-cache
mutable state (never a compiled-in constant), and compiles once for a whole generation.

One inductor compile is shared by the module (tens of seconds on two cores); the other
tests are eager or fail before compiling.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn import compat
from attn.fast_decode import (
    DecodeCompiled,
    _precision_casts_emulated,
    compile_for_decode,
    decode_attention,
    rowwise_linear,
)
from attn.kv_cache import SLOT_STEP

from .conftest import (
    GEMMA_OPTIONS,
    assert_cache_unchanged,
    cache_state,
    naive_attention,
    needs_amx,
    needs_bf16_matvec,
    needs_native_products,
    poison_on_reset,
    tiny_model,
)

PROMPTS = [[1, 2, 3, 4], [5, 6]]
OTHER_PROMPTS = [[7, 8], [9, 10, 11, 12]]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def fast() -> Iterator[DecodeCompiled]:
    """A tiny model with caches set up once, behind a compiled decode step (compiled here);
    heads of 16, so that its attention calls ``attn::decode_attention`` where the CPU has AVX-512."""
    model = tiny_model(11, head_dim=16)
    model.setup_caches(2, 32)
    wrapped = compile_for_decode(model, native_layers=False)
    attn.generate(wrapped, PROMPTS, max_new_tokens=NEW_TOKENS)  # compiles the decode step
    yield wrapped


def _layers_compiled(model: attn.TransformerDecoder) -> int:
    """Decoder layers the step compiles: one for all of them where the release reuses it."""
    return 1 if compat.compile_regions_supported() else model.config.num_layers


def test_rowwise_linear_equals_linear() -> None:
    x, weight = torch.randn(3, 2, 16), torch.randn(24, 16)
    torch.testing.assert_close(rowwise_linear(x, weight), F.linear(x, weight))
    xb, wb = x.bfloat16(), weight.bfloat16()
    got = rowwise_linear(xb, wb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(xb.float(), wb.float()), rtol=2e-2, atol=2e-2)
    bias = torch.randn(24)
    torch.testing.assert_close(rowwise_linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.slow
def test_checkpoint_features_compile_and_equal_eager() -> None:
    """q/k/v biases (Qwen2), q/k norms (Qwen3) and a sliding window (Mistral) through the
    compiled step: the same tokens as eager, every linear rewritten, biased ones included."""
    model = tiny_model(13, qkv_bias=True, qk_norm=True, sliding_window=3)
    expected = attn.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    model.setup_caches(2, 32)
    fast = compile_for_decode(model, native_layers=False)
    got = attn.generate(fast, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-4)
    assert fast.stats.graphs == 1, fast.stats
    assert fast.stats.linears_rewritten == 7 * _layers_compiled(model) + 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_compiles_and_equals_eager(family: str) -> None:
    """Gemma's options through the compiled step: windowed and global layers take their parts
    of one plan outside the layer region, which still compiles once for every layer."""
    model = tiny_model(13, num_layers=4, **GEMMA_OPTIONS[family])
    expected = attn.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    model.setup_caches(2, 32)
    fast = compile_for_decode(model, native_layers=False)
    got = attn.generate(fast, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-4)
    assert fast.stats.graphs == 1, fast.stats
    assert fast.stats.linears_rewritten == 7 * _layers_compiled(model) + 1


@given(
    batch=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    queries=st.integers(1, 2),
    length=st.integers(1, 9),
    mask_rank=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_equals_sdpa_and_a_naive_loop(
    batch: int, kv_heads: int, group: int, queries: int, length: int, mask_rank: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads, d = kv_heads * group, 8
    q = torch.randn(batch, heads, queries, d, generator=gen)
    k, v = (torch.randn(batch, kv_heads, length, d, generator=gen) for _ in range(2))
    shape = (queries, length) if mask_rank == 2 else (batch, 1, queries, length)
    mask = torch.rand(shape, generator=gen) < 0.7  # some rows may allow nothing
    got = decode_attention(q, k, v, attn_mask=mask, enable_gqa=group > 1)
    torch.testing.assert_close(got.double(), naive_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)
    if bool(mask.any(-1).all()):  # the stock kernel's answer for a fully masked row varies by release
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=group > 1)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    low = decode_attention(qb, kb, vb, attn_mask=mask, enable_gqa=group > 1)
    assert low.dtype == torch.bfloat16  # computed in fp32, rounded once
    torch.testing.assert_close(low.double(), naive_attention(qb, kb, vb, mask), rtol=1e-2, atol=1e-2)


def test_greedy_tokens_equal_eager_and_one_graph_for_the_generation(fast: DecodeCompiled) -> None:
    model = fast.model
    got = attn.generate(fast, PROMPTS, max_new_tokens=NEW_TOKENS)
    expected = attn.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-4)
    assert fast.stats.graphs == 1, fast.stats  # every position of both generations: one graph
    # q, k, v, o, gate, up, down per layer compiled, and the output head: all rewritten for decode
    assert fast.stats.linears_rewritten == 7 * _layers_compiled(model) + 1
    assert fast.stats.attention_rewritten == _layers_compiled(model)  # one decode_attention per layer
    native = attn.native.decode_attention_available()
    assert fast.stats.attention_native == (_layers_compiled(model) if native else 0)
    assert fast.stats.regions == (1 if compat.compile_regions_supported() else 0)


def test_cache_is_mutable_state_not_a_constant(fast: DecodeCompiled) -> None:
    """A second generation from other prompts must read the cache as it is now."""
    model = fast.model
    got = attn.generate(fast, OTHER_PROMPTS, max_new_tokens=NEW_TOKENS)
    fast_caches = [(c.k_cache.clone(), c.v_cache.clone(), c.cache_pos.clone()) for c in model.kv_caches()]
    expected = attn.generate(model, OTHER_PROMPTS, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got.tokens, expected.tokens)
    for (k, v, pos), cache in zip(fast_caches, model.kv_caches(), strict=True):
        assert torch.equal(pos, cache.cache_pos)  # the compiled step advanced the fill position
        torch.testing.assert_close(k, cache.k_cache, rtol=1e-5, atol=1e-5)  # and wrote every slot
        torch.testing.assert_close(v, cache.v_cache, rtol=1e-5, atol=1e-5)
    assert fast.stats.graphs == 1


def test_weights_stay_live_inputs(fast: DecodeCompiled) -> None:
    """No freezing: a weight changed after compiling is used by the next step."""
    model = fast.model
    weight = model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-3.0)
        got = attn.generate(fast, PROMPTS, max_new_tokens=NEW_TOKENS, return_logits=True)
        expected = attn.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, return_logits=True)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
    assert fast.stats.graphs == 1


def test_multi_token_passes_run_eager_and_compile_nothing(fast: DecodeCompiled) -> None:
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), fast.model(tokens))
    assert fast.stats.graphs == 1
    assert fast.config is fast.model.config and fast.kv_caches() == fast.model.kv_caches()


def test_overflow_gets_the_eager_error_and_leaves_the_cache_unchanged(fast: DecodeCompiled) -> None:
    model = fast.model
    capacity = model.kv_caches()[0].max_seq_len
    with attn.cached_inference(model):
        # Made in inference mode, like generate's: a normal tensor would compile a second graph.
        step = dict(input_pos=torch.full((2, 1), capacity - 1), mask=torch.ones(2, 1, capacity, dtype=torch.bool))
        model.reset_caches()
        model(torch.randint(0, 61, (2, capacity - 1)))
        fast(torch.randint(0, 61, (2, 1)), **step)  # the last slot, through the compiled step
        before = cache_state(model)
        with pytest.raises(RuntimeError, match=rf"holds {capacity} tokens, 1 more do not fit in its capacity"):
            fast(torch.randint(0, 61, (2, 1)), **step)
    assert_cache_unchanged(model, before)
    assert fast.stats.graphs == 1  # the step generate compiled, reused


def test_a_mask_short_of_the_step_gets_the_eager_error_and_leaves_the_cache_unchanged(fast: DecodeCompiled) -> None:
    """The step's own checks run in eager code first: a mask that does not reach the slot the
    token goes to is refused before the compiled step writes anything."""
    model = fast.model
    with attn.cached_inference(model):
        model.reset_caches()
        model(torch.randint(0, 61, (2, 5)))
        before = cache_state(model)
        with pytest.raises(ValueError, match=r"covers the first 5 cache slots, .* at least 6 slots"):
            fast(torch.randint(0, 61, (2, 1)), mask=torch.ones(2, 1, 5, dtype=torch.bool))
    assert_cache_unchanged(model, before)


@pytest.mark.parametrize("policy_value", [None, "flag"])
def test_plain_inference_mode_decode_loop_runs_the_compiled_step(
    fast: DecodeCompiled, policy_value: str | None, restore_policy: None
) -> None:
    """The step decides in eager code: inference mode drives it as it drives the model, with
    generate's tokens; under FLAG inference mode alone leaves the cache alone (eager's rule)."""
    attn.policy.set_cache_policy(policy_value)
    model = fast.model
    expected = attn.generate(model, PROMPTS[:1] * 2, max_new_tokens=6).generated
    model.reset_caches()
    graphs = fast.stats.graphs
    tokens = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)
        with torch.inference_mode():
            logits = fast(torch.tensor(PROMPTS[:1] * 2))
            for _ in range(6):
                token = logits[:, -1:].argmax(-1)  # (2, 1)
                tokens.append(token)
                logits = fast(token)
    if policy_value is None:
        assert torch.equal(torch.cat(tokens, 1), expected)
        assert model.kv_caches()[0].size == len(PROMPTS[0]) + 6
        assert fast.stats.graphs == graphs + 1  # no positions or masks passed: one more step, compiled once
    else:
        assert model.kv_caches()[0].size == 0


@pytest.mark.slow  # a bf16 graph of its own
@pytest.mark.parametrize(
    ("native", "batch_size"),
    [
        (False, 1),
        pytest.param(True, 1, marks=needs_bf16_matvec),
        pytest.param(True, 3, marks=needs_bf16_matvec),
        pytest.param(True, 16, marks=needs_amx),
    ],
)
def test_bf16_step_rounds_where_eager_rounds(native: bool, batch_size: int) -> None:
    """bf16: the compiled step rounds each bf16 intermediate as eager does (inductor would keep
    some in fp32), so its logits, teacher-forced on the same tokens, stay within a few bf16
    steps of eager's, not only its argmax; with inductor's code and with the native kernels
    (``attn::bf16_matvec`` for every linear at one row and at three, ``attn::amx_linear`` at 16,
    ``attn::decode_attention``)."""
    model = tiny_model(14, head_dim=16, hidden_dim=64).to(torch.bfloat16)  # features: multiples of 32
    fast = compile_for_decode(model, native_layers=False, native=native)
    tokens = torch.randint(0, 61, (batch_size, 14), generator=torch.Generator().manual_seed(3))
    model.setup_caches(batch_size, 16)

    def logits_of(step: torch.nn.Module) -> torch.Tensor:
        model.reset_caches()
        with torch.inference_mode():
            out = [model(tokens[:, :4])[:, -1]]  # prefill in eager code for both
            out += [step(tokens[:, i : i + 1])[:, -1] for i in range(4, 14)]
        return torch.stack(out).float()  # (11, b, v)

    expected, got = logits_of(model), logits_of(fast)
    assert fast.stats.graphs == 1 and fast.stats.linears_rewritten == 7 * _layers_compiled(model) + 1
    assert fast.stats.linears_native == (fast.stats.linears_rewritten if native else 0), fast.stats
    assert fast.stats.attention_native == (_layers_compiled(model) if native else 0), fast.stats
    scale = expected.abs().max().item()
    worst = (got - expected).abs().max().item()
    # Without the option (torch <= 2.8) a norm's output reaches the next linear unrounded:
    # 0.074-0.078 against 4.16 measured, where rounding as eager does gives 0.055.
    bound = 2**-6 if _precision_casts_emulated() else 2**-5
    assert worst <= bound * scale, f"largest logit difference {worst:.4f} against {scale:.2f} the largest logit"


@needs_bf16_matvec
def test_steps_the_eager_model_runs_natively_run_so_and_compile_nothing() -> None:
    """A cached step whose layers the eager model runs as attn::decode_layer calls runs the
    eager step (faster than a compiled one, and no compile); native_layers=False compiles it.
    Inductor's probes start in a thread with the first compiled step only: none runs beside
    the caller's code where nothing compiles."""
    model = tiny_model(head_dim=16, hidden_dim=64).to(torch.bfloat16)
    expected = attn.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    setup = attn.fast_decode._start_inductor_setup
    with mock.patch.object(attn.fast_decode, "_start_inductor_setup", wraps=setup) as started:
        fast = compile_for_decode(model)
        got = attn.generate(fast, PROMPTS, max_new_tokens=NEW_TOKENS)
        assert started.call_count == 0
        compiled = compile_for_decode(model, native_layers=False)
        again = attn.generate(compiled, PROMPTS, max_new_tokens=NEW_TOKENS)
        assert started.call_count == 1  # once, before the first compiled step
    assert torch.equal(got.tokens, expected.tokens)
    assert fast.stats.graphs == 0 and fast.stats.native_steps == NEW_TOKENS - 1, fast.stats
    assert compiled.stats.graphs == 1 and compiled.stats.native_steps == 0, compiled.stats
    assert compiled._inductor_setup is None  # joined by the compile
    torch.testing.assert_close(again.logprobs, expected.logprobs, rtol=2**-4, atol=2**-4)


def test_bad_arguments() -> None:
    model = tiny_model(12)
    with pytest.raises(ValueError, match="max_rows must be a non-negative int"):
        compile_for_decode(model, max_rows=-1)
    with pytest.raises(ValueError, match="vector_bits must be None, 128, 256 or 512"):
        compile_for_decode(model, vector_bits=300)
    with pytest.raises(ValueError, match="native must be None, True or False"):
        compile_for_decode(model, native=1)
    with pytest.raises(ValueError, match="rewrite_linears=False turns off"):
        compile_for_decode(model, native=True, rewrite_linears=False)
    with pytest.raises(ValueError, match="native_layers must be True or False, got 1"):
        compile_for_decode(model, native_layers=1)
    with pytest.raises(ValueError, match=r"call model\.eval"):
        compile_for_decode(model.train())


def test_a_new_batch_size_compiles_its_own_graph_with_every_linear_rewritten() -> None:
    """Static shapes: the second batch size gets a graph of its own, rewritten for its rows
    (not a graph with a symbolic batch, which would keep the BLAS kernel), same tokens as eager."""
    model = tiny_model(17)
    fast = compile_for_decode(model, native_layers=False)
    for prompts in ([[1, 2, 3]], [[1, 2, 3], [4, 5]]):
        got = attn.generate(fast, prompts, max_new_tokens=5)
        assert torch.equal(got.tokens, attn.generate(model, prompts, max_new_tokens=5).tokens)
    assert fast.stats.graphs == 2, fast.stats
    assert fast.stats.linears_rewritten == 2 * (7 * _layers_compiled(model) + 1)


@needs_native_products
def test_fp32_rows_past_max_rows_call_the_native_product_and_equal_eager() -> None:
    """A GRPO-sized fp32 batch (16 rows, past ``max_rows``): every linear calls attn's product
    (``attn::fp32_linear``, or ``attn::avx2_linear`` without AVX-512) instead of the BLAS
    kernel, and the greedy tokens equal eager's."""
    model = tiny_model(19, head_dim=16)
    fast = compile_for_decode(model, native_layers=False)
    prompts = [[1 + i % 7, 2 + i % 5, 3] for i in range(16)]
    got = attn.generate(fast, prompts, max_new_tokens=6)
    expected = attn.generate(model, prompts, max_new_tokens=6)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-4, atol=1e-4)
    assert fast.stats.linears_native == fast.stats.linears_rewritten == 7 * _layers_compiled(model) + 1, fast.stats


@pytest.mark.slow  # two graphs of its own
@pytest.mark.parametrize("callers_cache", [False, True])
def test_a_second_cache_length_compiles_one_graph_for_every_later_length(callers_cache: bool) -> None:
    """generate attends over each generation's slots rounded up to 64, in caches of its own
    sized so or in a caller's 256-slot cache: the first length compiles a static graph, the
    second one graph with the length as a symbol, and no later length, longer or shorter,
    compiles anything; the slots past the length are not read (poisoned in the caller's
    cache), and tokens equal eager's throughout."""
    model = tiny_model(18, max_seq_len=256)
    fast = compile_for_decode(model, native_layers=False)
    lengths = []
    for new_tokens in (10, 70, 130, 40, 10):
        lengths.append(-(-(len(PROMPTS[0]) + new_tokens) // SLOT_STEP) * SLOT_STEP)
        expected = attn.generate(model, PROMPTS, max_new_tokens=new_tokens).tokens  # caches of its own
        if callers_cache:
            model.setup_caches(len(PROMPTS), 256)
            poison_on_reset(model, lengths[-1])
        got = attn.generate(fast, PROMPTS, max_new_tokens=new_tokens)
        if callers_cache:
            model.teardown_caches()
            del model.reset_caches
        assert torch.equal(got.tokens, expected)
        assert fast.stats.graphs == (1 if len(set(lengths)) == 1 else 2), (lengths, fast.stats)
    assert lengths == [64, 128, 192, 64, 64] and fast.stats.dynamic_cache_length
    assert fast.stats.linears_rewritten == 2 * (7 * _layers_compiled(model) + 1)  # symbolic length: rewritten too
    assert fast.stats.attention_rewritten == 2 * _layers_compiled(model)


@pytest.mark.slow  # a graph of its own
def test_a_plain_decode_loop_in_a_large_cache_reads_the_filled_slots_rounded_up() -> None:
    """With no mask passed, the step attends over the filled slots rounded up to 64, as the
    eager model does: the slots past them are not read (poisoned), and the tokens are
    generate's."""
    model = tiny_model(20, max_seq_len=256)
    fast = compile_for_decode(model, native_layers=False)
    expected = attn.generate(model, PROMPTS[:1] * 2, max_new_tokens=8).generated
    model.setup_caches(2, 256)
    poison_on_reset(model, 64)
    model.reset_caches()
    tokens = []
    with attn.cached_inference(model):
        logits = fast(torch.tensor(PROMPTS[:1] * 2))
        for _ in range(8):
            tokens.append(logits[:, -1:].argmax(-1))  # (2, 1)
            logits = fast(tokens[-1])
    assert torch.equal(torch.cat(tokens, 1), expected)
    assert fast.stats.graphs == 1


@pytest.mark.slow  # a graph of its own
def test_the_step_is_cacheable_on_disk_where_the_release_allows() -> None:
    """AOTAutograd's cache refuses a graph that calls unknown functions (the rewrite's), so
    every warm compile would trace it again; ``unsafe_marked_cacheable_functions`` (from
    torch 2.8) admits them, keyed by a hash of fast_decode.py."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    before = dict(counters["aot_autograd"])
    model = tiny_model(19)
    fast = compile_for_decode(model, native_layers=False)
    attn.generate(fast, PROMPTS, max_new_tokens=3)
    delta = {key: counters["aot_autograd"][key] - before.get(key, 0) for key in counters["aot_autograd"]}
    assert fast.stats.graphs == 1
    if hasattr(inductor_config, "unsafe_marked_cacheable_functions"):
        assert delta.get("autograd_cache_bypass", 0) == 0, delta
        assert delta.get("autograd_cache_hit", 0) + delta.get("autograd_cache_miss", 0) == 1, delta
    else:  # the release cannot be told: a warm compile traces the graph again
        assert delta.get("autograd_cache_hit", 0) == 0, delta


@pytest.mark.slow  # nine small graphs
def test_more_models_than_dynamos_recompile_limit_each_compile_their_step() -> None:
    """Every model's step is another graph of one function, and dynamo refuses a ninth
    (``fullgraph``: an error, not a slow fallback) unless the step raises its limit."""
    for seed in range(9):
        model = tiny_model(seed)
        fast = compile_for_decode(model, native_layers=False)
        got = attn.generate(fast, PROMPTS, max_new_tokens=3)
        assert torch.equal(got.tokens, attn.generate(model, PROMPTS, max_new_tokens=3).tokens)
        assert fast.stats.graphs == 1
    assert DecodeCompiled.graphs_in_process >= 9


def test_the_step_is_handed_the_filled_slots_rounded_up_not_every_slot() -> None:
    """Without a mask, the compiled step gets the eager model's default span (the filled slots
    rounded up to SLOT_STEP); its compiled function is replaced by the eager model here, so
    slots poisoned past that span would show as NaN, with no inductor compile."""
    model = tiny_model(21, max_seq_len=256)
    expected = attn.generate(model, PROMPTS[:1] * 2, max_new_tokens=6).generated
    fast = compile_for_decode(model, native_layers=False)
    spans = []

    def eager_step(tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
        spans.append(kwargs["mask"].shape[-1])
        return model(tokens, **kwargs)

    object.__setattr__(fast, "_step", eager_step)
    model.setup_caches(2, 256)
    poison_on_reset(model, SLOT_STEP)
    model.reset_caches()
    tokens = []
    with attn.cached_inference(model):
        logits = fast(torch.tensor(PROMPTS[:1] * 2))
        for _ in range(6):
            tokens.append(logits[:, -1:].argmax(-1))  # (2, 1)
            logits = fast(tokens[-1])
    assert spans == [SLOT_STEP] * 6
    assert torch.equal(torch.cat(tokens, 1), expected)


@pytest.mark.parametrize("bad_id", [-1, 61])
def test_an_out_of_vocab_step_gets_the_eager_error_before_the_compiled_step(bad_id: int) -> None:
    model = tiny_model(22)
    model.setup_caches(2, 16)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2], [3, 4]]))
    before = cache_state(model)
    fast = compile_for_decode(model, native_layers=False)

    def never(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the compiled step ran with an out-of-vocab id")

    object.__setattr__(fast, "_step", never)
    with attn.cached_inference(model), pytest.raises(ValueError, match=r"token ids must be in \[0, 61\)"):
        fast(torch.tensor([[5], [bad_id]]))
    assert_cache_unchanged(model, before)


def test_save_pretrained_takes_the_compiled_wrapper(tmp_path: Path) -> None:
    model = tiny_model(23)
    attn.checkpoint.save_pretrained(compile_for_decode(model, native_layers=False), tmp_path)
    loaded = attn.load_pretrained(tmp_path)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(ours, theirs), name


def test_a_step_that_fails_after_writing_some_layers_leaves_every_layer_as_it_was() -> None:
    """A compiled step cannot roll back what it wrote; the eager wrapper around it does."""
    model = tiny_model(24)
    model.setup_caches(2, 16)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    before = cache_state(model)
    fast = compile_for_decode(model, native_layers=False)

    def half_a_step(tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
        cache = model.layers[0].attn.kv_cache
        cache.update(*[torch.ones(2, cache.num_kv_heads, 1, cache.head_dim)] * 2)
        raise RuntimeError("out of memory in layer 1, say")

    object.__setattr__(fast, "_step", half_a_step)
    with attn.cached_inference(model), pytest.raises(RuntimeError, match="out of memory in layer 1"):
        fast(torch.tensor([[7], [8]]))
    assert_cache_unchanged(model, before)


def test_with_packed_decode_the_step_reads_packed_weights_for_its_matrix_products() -> None:
    """Linears over more rows than ``max_rows`` call ``attn::packed_linear``: the same tokens
    as eager, a weight changed after compiling is packed again, and turning packed decode
    off compiles another graph (dynamo guards the switch)."""
    model = tiny_model(23)
    attn.set_packed_decode(model)
    fast = compile_for_decode(model, native_layers=False, max_rows=1)
    prompts = [[1, 2, 3], [4, 5]]  # two rows: more than max_rows

    def both() -> tuple[attn.GenerationOutput, attn.GenerationOutput]:
        model.packed_decode = False
        expected = attn.generate(model, prompts, max_new_tokens=6, return_logits=True)
        model.packed_decode = True
        return attn.generate(fast, prompts, max_new_tokens=6, return_logits=True), expected

    got, expected = both()
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
    assert fast.stats.linears_packed == 7 * _layers_compiled(model) + 1 and fast.stats.linears_rewritten == 0
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(-3.0)
    got, expected = both()
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-4)
    assert fast.stats.graphs == 1
    model.packed_decode = False
    attn.generate(fast, prompts, max_new_tokens=3)
    assert fast.stats.graphs == 2 and fast.stats.linears_packed == 7 * _layers_compiled(model) + 1
