"""attn/native_loop.py and attn::decode_loop: attn.generate's decode steps in C++, against the
Python loop they replace (bit for bit: tokens, log-probabilities, logits, generator draws, the
caches) and a pass without the cache; the Python loop wherever the model's steps are not what the
op computes, or stop being so partway."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attn
from attn import TransformerDecoder
from attn.native_loop import CHUNK_STEPS, NativeLoop

from .conftest import GEMMA_OPTIONS, avx2_only, examples, needs_avx2, needs_native_products, tiny_model

pytestmark = needs_native_products  # attn::decode_loop runs its AVX-512 build or its AVX2 one

_FAMILIES = {
    "llama": {},
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
    "mistral": dict(sliding_window=256),  # wider than the slots generate attends: no slot falls out
    "untied": dict(tie_embeddings=False),
}


def _model(dtype: torch.dtype, family: str = "llama", seed: int = 0) -> TransformerDecoder:
    """A tiny decoder whose widths attn::decode_layers takes (heads of 16, widths of 32)."""
    return tiny_model(seed, head_dim=16, hidden_dim=64, **_FAMILIES[family]).to(dtype)


def _loop_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The model passes each ``attn::decode_loop`` call ran: one element a call."""
    calls: list[int] = []
    op = torch.ops.attn.decode_loop

    def counted(*args: object) -> int:
        ran = op(*args)
        calls.append(ran)
        return ran

    monkeypatch.setattr(torch.ops.attn, "decode_loop", counted)
    return calls


def _in_python(model: torch.nn.Module, prompts: object, **options: object) -> attn.GenerationOutput:
    """``attn.generate`` with every step in the Python loop: a callback keeps it there."""
    return attn.generate(model, prompts, on_tokens=lambda tokens: None, **options)


def _assert_same(got: attn.GenerationOutput, expected: attn.GenerationOutput) -> None:
    assert torch.equal(got.tokens, expected.tokens)
    assert torch.equal(got.padding_mask, expected.padding_mask)
    assert torch.equal(got.logprobs, expected.logprobs)  # bit for bit: the sampler's calls, in its order
    assert (got.logits is None) == (expected.logits is None)
    if got.logits is not None:
        assert torch.equal(got.logits, expected.logits)


@settings(max_examples=examples(12), deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    family=st.sampled_from(sorted(_FAMILIES)),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3),
    num_samples=st.integers(1, 2),
    max_new_tokens=st.integers(1, 2 * CHUNK_STEPS + 3),
    sampling=st.sampled_from([(0.0, None), (0.7, None), (1.3, 4), (1.0, 1)]),
    stops=st.lists(st.integers(0, 60), max_size=3),
    return_logits=st.booleans(),
    own_caches=st.booleans(),
    avx2=st.booleans(),  # as on a CPU with AVX2 and no AVX-512: the ops' AVX2 build on both sides
    seed=st.integers(0, 2**16),
)
def test_the_loop_generates_what_the_python_loop_does(
    dtype: torch.dtype,
    family: str,
    lengths: list[int],
    num_samples: int,
    max_new_tokens: int,
    sampling: tuple[float, int | None],
    stops: list[int],
    return_logits: bool,
    own_caches: bool,
    avx2: bool,
    seed: int,
) -> None:
    """Same tokens, masks, log-probabilities and logits as the Python loop, the same draws from the
    generator, and, in the caller's caches, the same keys, values and fill after; the op ran every
    model pass of the generation, in calls of at most CHUNK_STEPS."""
    with pytest.MonkeyPatch.context() as cpu:
        if avx2:
            avx2_only(cpu)
        model = _model(dtype, family)
        prompts = [[(seed + 7 * i + j) % 61 for j in range(n)] for i, n in enumerate(lengths)]
        temperature, top_k = sampling
        options = dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, stop_tokens=stops,
            return_logits=return_logits, num_samples=num_samples,
        )  # fmt: skip
        rows = len(prompts) * num_samples
        outputs, caches = [], []
        for python in (False, True):
            if not own_caches:
                model.setup_caches(rows, max(lengths) + max_new_tokens)
            with pytest.MonkeyPatch.context() as patch:
                calls = _loop_calls(patch)
                generator = torch.Generator().manual_seed(seed)
                run = _in_python if python else attn.generate
                outputs.append(run(model, prompts, generator=generator, **options))
            after = torch.rand(1, generator=generator)  # the generator's state: the same draws taken
            if not own_caches:
                state = model.cache_state
                caches.append([int(state.fill), *(t.clone() for c in state.caches for t in (c.k_cache, c.v_cache))])
                model.teardown_caches()
            caches.append(after)
            if python:
                assert calls == []
            else:
                passes = int(outputs[0].generated_mask.sum(1).max()) - 1  # every row stops by its last token
                assert sum(calls) == passes and all(ran <= CHUNK_STEPS for ran in calls), calls
        _assert_same(*outputs)
        half = len(caches) // 2
        for got, expected in zip(caches[:half], caches[half:], strict=True):
            if isinstance(got, list):
                assert got[0] == expected[0] and all(map(torch.equal, got[1:], expected[1:]))
            else:
                assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loops_logits_are_those_of_a_pass_without_the_cache(dtype: torch.dtype) -> None:
    """The logits the loop reports for each token against one pass over the whole sequence
    without the cache (SDPA and torch's products: another computation)."""
    model = _model(dtype, "qwen2")
    prompts = [[3, 9, 27, 17], [5, 1]]
    out = attn.generate(model, prompts, max_new_tokens=2 * CHUNK_STEPS + 5, return_logits=True)
    P = out.prompt_length
    with torch.no_grad():
        full = model(out.tokens, input_pos=out.positions, mask=attn.padded_causal_mask(out.padding_mask))
    expected = full[:, P - 1 : -1].float()  # (b, N, v): the logits before each generated token
    scale = float(expected.abs().max())
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2**-5}[dtype]
    torch.testing.assert_close(out.logits, expected, rtol=tolerance, atol=tolerance * scale)


def _hook_model(model: TransformerDecoder) -> None:
    model.register_forward_hook(lambda *args: None)


def _hook_embedding(model: TransformerDecoder) -> None:
    model.tok_embeddings.register_forward_pre_hook(lambda *args: None)


def _hook_output(model: TransformerDecoder) -> None:
    model.output.register_forward_hook(lambda *args: None)


def _hook_layer(model: TransformerDecoder) -> None:
    model.layers[1].mlp.register_forward_hook(lambda *args: None)


def _patch_forward(model: TransformerDecoder) -> None:
    forward = model.forward
    model.forward = lambda *args, **kwargs: forward(*args, **kwargs)


def _biased_output(model: TransformerDecoder) -> None:
    model.output.bias = torch.nn.Parameter(torch.full_like(model.output.weight[:, 0], 0.25))


def _narrow_window(model: TransformerDecoder) -> None:
    model._plan_window = 4  # what sliding_window=4 plans: inside the slots attended


def _packed(model: TransformerDecoder) -> None:
    attn.set_packed_decode(model)


def _parity(model: TransformerDecoder) -> None:
    attn.set_parity_mode(model)


class _Subclass(TransformerDecoder):
    pass


def _subclass(model: TransformerDecoder) -> None:
    model.__class__ = _Subclass


_NOT_THE_LOOPS = {
    "a hook on the model": _hook_model,
    "a hook on the embedding": _hook_embedding,
    "a hook on the output layer": _hook_output,
    "a hook on a layer's module": _hook_layer,
    "a forward set on the instance": _patch_forward,
    "an output bias": _biased_output,
    "a window inside the slots": _narrow_window,
    "packed decode": _packed,
    "parity mode": _parity,
    "a subclass": _subclass,
}


@pytest.mark.parametrize("change", sorted(_NOT_THE_LOOPS))
def test_steps_the_op_does_not_compute_run_in_python(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose steps are not what attn::decode_loop computes generates in the Python loop,
    and generates what it did before (the same tokens and log-probabilities)."""
    model = _model(torch.bfloat16, "untied")
    _NOT_THE_LOOPS[change](model)
    calls = _loop_calls(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    got = attn.generate(model, [[1, 2, 3]], max_new_tokens=20, temperature=0.9, generator=generator)
    assert calls == []
    expected = _in_python(model, [[1, 2, 3]], max_new_tokens=20, temperature=0.9, generator=generator.manual_seed(0))
    _assert_same(got, expected)


@pytest.mark.parametrize("options", sorted(GEMMA_OPTIONS))
def test_gemmas_steps_run_in_python(options: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma's options (an embedding scale, a logit soft cap, windows on some layers, its norms):
    not the op's steps."""
    model = tiny_model(head_dim=16, hidden_dim=64, **GEMMA_OPTIONS[options]).to(torch.bfloat16)
    calls = _loop_calls(monkeypatch)
    attn.generate(model, [[1, 2, 3]], max_new_tokens=5)
    assert calls == []


def test_a_callback_keeps_the_python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_tokens`` is Python between steps: it gets every step's tokens, in the Python loop."""
    model = _model(torch.bfloat16)
    calls = _loop_calls(monkeypatch)
    seen: list[torch.Tensor] = []
    out = attn.generate(model, [[1, 2, 3]], max_new_tokens=9, on_tokens=lambda tokens: seen.append(tokens.clone()))
    assert calls == [] and torch.equal(torch.stack(seen, 1), out.generated)


def test_a_change_between_calls_is_seen_within_a_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook added while the loop runs (from another thread, say) fires from the next call's
    steps on: the loop checks the model between calls, and the rest run in Python."""
    model = _model(torch.bfloat16)
    fired: list[int] = []
    run = NativeLoop.run

    def run_then_hook(self: NativeLoop, *args: object) -> int | None:
        following = run(self, *args)
        if not model.layers[0]._forward_hooks:
            model.layers[0].register_forward_hook(lambda *hook_args: fired.append(1))
        return following

    monkeypatch.setattr(NativeLoop, "run", run_then_hook)
    calls = _loop_calls(monkeypatch)
    new_tokens = 2 * CHUNK_STEPS + 3
    got = attn.generate(model, [[1, 2, 3]], max_new_tokens=new_tokens)
    assert calls == [CHUNK_STEPS]
    assert len(fired) == new_tokens - 1 - CHUNK_STEPS  # every later pass ran the hooked layer
    model.layers[0]._forward_hooks.clear()
    expected = _in_python(model, [[1, 2, 3]], max_new_tokens=new_tokens)
    # The loop's steps, and the token its last pass gave, as the Python loop's; then a hooked layer
    # runs its own modules (torch's products: the last bit may differ).
    kept = CHUNK_STEPS + 1
    assert torch.equal(got.logprobs[:, :kept], expected.logprobs[:, :kept])
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=2**-5, atol=2**-5)


@pytest.mark.parametrize("where", ["model", "embedding", "output", "layer"])
def test_a_forward_set_on_an_instance_between_calls_runs_from_then_on(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward set on an instance while the loop runs (accelerate's ``add_hook_to_module``)
    is seen at the next call: the rest of the steps run in Python, through it."""
    model = _model(torch.bfloat16, "untied")
    module = {"model": model, "embedding": model.tok_embeddings, "output": model.output}.get(where)
    module = model.layers[1].mlp if module is None else module
    fired: list[int] = []
    forward = module.forward
    run = NativeLoop.run

    def run_then_patch(self: NativeLoop, *args: object) -> int | None:
        following = run(self, *args)
        if "forward" not in module.__dict__:
            module.forward = lambda *a, **k: fired.append(1) or forward(*a, **k)
        return following

    monkeypatch.setattr(NativeLoop, "run", run_then_patch)
    calls = _loop_calls(monkeypatch)
    attn.generate(model, [[1, 2, 3]], max_new_tokens=CHUNK_STEPS + 6)
    assert calls == [CHUNK_STEPS] and len(fired) == 5  # the passes after the first call


def test_a_compiled_decode_counts_the_loops_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_for_decode``'s steps that run the eager model's native step run in the loop too,
    each pass counted in ``stats.native_steps``; ``native_layers=False`` compiles its steps."""
    model = _model(torch.bfloat16).eval()
    calls = _loop_calls(monkeypatch)
    fast = attn.compile_for_decode(model)
    got = attn.generate(fast, [[1, 2, 3]], max_new_tokens=20)
    assert sum(calls) == 19 and fast.stats.native_steps == 19 and fast.stats.graphs == 0
    _assert_same(got, _in_python(model, [[1, 2, 3]], max_new_tokens=20))
    calls.clear()
    compiled = attn.compile_for_decode(model, native_layers=False)
    assert compiled.native_loop(1, 64) is None


def test_a_torch_compiled_model_runs_its_compiled_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile(model)`` asked for compiled steps: its module's loop is not taken for it."""
    model = _model(torch.bfloat16).eval()
    calls = _loop_calls(monkeypatch)
    compiled = torch.compile(model, backend="eager")
    model.setup_caches(1, 64)
    assert compiled.native_loop(1, 64) is not None  # its module's attribute, which generate does not ask
    model.teardown_caches()
    attn.generate(compiled, [[1, 2, 3]], max_new_tokens=5)
    assert calls == []


def test_generations_on_two_threads_each_take_their_own_models_loop() -> None:
    """Two models generating at once on two threads (the op runs without the GIL): each
    generation is what it is alone."""
    models = [_model(torch.bfloat16, seed=seed) for seed in (0, 1)]
    alone = [attn.generate(m, [[1, 2, 3]], max_new_tokens=40) for m in models]
    together: list[attn.GenerationOutput | None] = [None, None]

    def generate(i: int) -> None:
        together[i] = attn.generate(models[i], [[1, 2, 3]], max_new_tokens=40)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for got, expected in zip(together, alone, strict=True):
        assert got is not None
        _assert_same(got, expected)


def _op_arguments(model: TransformerDecoder, rows: int = 1, slots: int = 64, new_tokens: int = 8) -> dict:
    """A valid ``attn::decode_loop`` call on ``model``'s caches, as keywords."""
    model.setup_caches(rows, slots)
    loop = model.native_loop(rows, slots)
    assert loop is not None
    run = loop.layers
    model.cache_state.fill.fill_(4)
    return dict(
        logits=torch.zeros(rows, model.config.vocab_size, dtype=loop.embedding.dtype),
        embedding=loop.embedding,
        head=loop.head,
        weights=run.weights,
        biases=run.biases,
        k_caches=[c.k_cache for c in run.caches],
        v_caches=[c.v_cache for c in run.caches],
        final_norm=loop.step.final_norm,
        final_eps=loop.step.final_eps,
        eps=run.eps,
        scale=run.scale,
        amx_from_rows=0,
        cos_sin=loop.cos_sin,
        key_valid=torch.ones(rows, slots, dtype=torch.bool),
        next_pos=torch.full((rows, 1), 4),
        fill=model.cache_state.fill,
        done=torch.zeros(rows, dtype=torch.bool),
        new_tokens=torch.zeros(rows, new_tokens, dtype=torch.long),
        new_mask=torch.zeros(rows, new_tokens, dtype=torch.bool),
        logprobs=torch.zeros(rows, new_tokens),
        all_logits=None,
        stop_ids=torch.tensor([], dtype=torch.long),
        pad_id=0,
        temperature=0.0,
        top_k=0,
        generator=None,
        first_step=0,
        last_step=new_tokens,
        avx2=attn.native.avx2_layers(),  # the build this CPU runs: AVX-512 or AVX2
    )


_BAD_CALLS = {
    "past the attended slots": (dict(key_valid=torch.ones(1, 6, dtype=torch.bool)), "past the 6 slots attended"),
    "past the RoPE table": (dict(next_pos=torch.full((1, 1), 60)), "reaches position 67, past the RoPE table's 64"),
    "logits of another dtype": (dict(logits=torch.zeros(1, 61)), "the embedding's dtype BFloat16"),
    "a pad id outside the embedding": (dict(pad_id=61), "pad_id 61 must be an id of the embedding's 61 rows"),
    "steps outside the generation": (dict(last_step=9), "steps [0, 9) are not a range of the generation's 8"),
    "a top_k past the vocabulary": (dict(top_k=62, temperature=1.0), "top_k 62 in [0, 61]"),
    "rows that do not match": (dict(done=torch.zeros(2, dtype=torch.bool)), "done (1,) bool"),
    "a RoPE table of another head dim": (dict(cos_sin=torch.zeros(2, 64, 8)), "rows (8) must be the caches' head dim"),
    "shared slots it would write": (
        dict(group=1, shared=5),
        "the steps write slots from 4, inside the 5 slots the rows share (group 1)",
    ),
    "a group that does not divide the rows": (
        dict(group=2, shared=0),
        "group must divide the 1 rows and shared be >= 0",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_CALLS))
def test_a_bad_call_raises_before_it_writes(case: str) -> None:
    """Every argument is checked before the first cache write, with the values in the message."""
    model = _model(torch.bfloat16)
    arguments = _op_arguments(model)
    change, message = _BAD_CALLS[case]
    arguments |= change
    before = [t.clone() for c in model.cache_state.caches for t in (c.k_cache, c.v_cache)]
    tokens = arguments["new_tokens"].clone()
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        torch.ops.attn.decode_loop(*arguments.values())
    after = [t for c in model.cache_state.caches for t in (c.k_cache, c.v_cache)]
    assert all(map(torch.equal, before, after)) and int(model.cache_state.fill) == 4
    assert torch.equal(arguments["new_tokens"], tokens)


@pytest.mark.parametrize("build", ["avx512", pytest.param("avx2", marks=needs_avx2)])
def test_a_valid_call_runs_its_steps(build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bad calls above differ from this one in one argument each (in both builds: the call's
    ``avx2`` is the build the CPU runs, AVX2 when AVX512-BF16 is missing)."""
    if build == "avx2":
        avx2_only(monkeypatch)
    elif not attn.native._has_avx512_bf16():
        pytest.skip("the AVX-512 build of attn::decode_loop needs a CPU with AVX512-BF16; this one has none")
    model = _model(torch.bfloat16)
    arguments = _op_arguments(model)
    assert torch.ops.attn.decode_loop(*arguments.values()) == 7  # the last step samples and stops
    assert int(model.cache_state.fill) == 11


@pytest.mark.parametrize("python", [False, True])
@pytest.mark.parametrize("avx2", [False, True])
def test_a_forked_generation_reads_each_groups_prompt_from_its_first_row(
    python: bool, avx2: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``generate(num_samples=3)`` forks the prefilled prompts; its decode steps (the C++ loop's
    and the Python loop's native steps) read the prompt's slots from each group's first row:
    other values in the copies right after the fork change no token, log-probability or logit,
    and the output is that of steps that read every row's own (unchanged) copy."""
    if avx2:
        avx2_only(monkeypatch)
    model = _model(torch.bfloat16)
    fork = model.fork_caches

    def fork_then_poison(copies: int) -> None:
        fork(copies)
        group, slots = model.cache_state.shared_slots
        for cache in model.kv_caches():
            for buffer in (cache.k_cache, cache.v_cache):
                buffer[torch.arange(buffer.shape[0]) % group != 0, :, :slots] = 3.0

    def fork_unshared(copies: int) -> None:
        fork(copies)
        model.cache_state.shared_slots = None

    def fork_poison_and_read(copies: int) -> None:
        fork_then_poison(copies)
        model.cache_state.shared_slots = None

    run = _in_python if python else attn.generate
    options = dict(max_new_tokens=CHUNK_STEPS + 2, temperature=1.0, num_samples=3, return_logits=True)
    outputs = []
    for forked in (fork_then_poison, fork_unshared, fork_poison_and_read):
        monkeypatch.setattr(model, "fork_caches", forked)
        calls = _loop_calls(monkeypatch)
        outputs.append(run(model, [[1, 2, 3, 4, 5], [6, 7]], generator=torch.Generator().manual_seed(0), **options))
        assert (calls == []) == python
    _assert_same(*outputs[:2])
    copies = torch.arange(6) % 3 != 0
    first = slice(1, 2)  # the first step after the fork (step 0 samples from the prefill)
    assert not torch.isclose(outputs[2].logits[copies, first], outputs[1].logits[copies, first]).all(-1).any()
