"""attn/native_step.py: an eager decode step's layers as ``attn::decode_layers`` calls, against the
stock kernels (torch's products, SDPA) on the same weights; the step rebuilt after every change
to the model that it reads."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

import attn
from attn import TransformerDecoder
from attn.native import native_product
from attn.packed import Linear

from .conftest import (
    GEMMA_OPTIONS,
    OperatorCalls,
    avx2_only,
    examples,
    needs_bf16_matvec,
    needs_native_products,
    tiny_model,
)


def _native_model(dtype: torch.dtype, **overrides: object) -> TransformerDecoder:
    """A tiny decoder whose widths attn::decode_layers takes (heads of 16, widths of 32)."""
    fields: dict[str, object] = dict(head_dim=16, hidden_dim=64) | overrides
    return tiny_model(**fields).to(dtype)


def _native_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The layers each ``attn::decode_layers`` call computes: one element a call. Each call's
    build is the one ``attn.native`` says this CPU runs."""
    calls: list[int] = []
    op = torch.ops.attn.decode_layers

    def counted(*args: object) -> torch.Tensor:
        calls.append(len(args[3]))  # k_caches: one a layer
        assert args[13] is attn.native.avx2_layers()  # avx2: the AVX2 build
        return op(*args)

    monkeypatch.setattr(torch.ops.attn, "decode_layers", counted)
    return calls


def _stock(model: TransformerDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on ``model``'s decode steps run the stock kernels."""
    monkeypatch.setattr(model, "native_layers", lambda batch_size: False)


def _teacher_forced_logits(model: TransformerDecoder, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The prompt in one pass, then each later token in a decode step: (b, s - prompt_len + 1, v)."""
    model.setup_caches(tokens.shape[0], 32)
    with torch.inference_mode():
        logits = [model(tokens[:, :prompt_len], last_only=True)]
        logits += [model(tokens[:, i : i + 1]) for i in range(prompt_len, tokens.shape[1])]
    return torch.cat(logits, 1)


# Each family's options, and the runs of layers one call each computes in a 3-layer model.
_FAMILIES = {
    "llama": ({}, [3]),
    "qwen2": (dict(qkv_bias=True), [3]),
    "qwen3": (dict(qk_norm=True), [3]),
    "mistral": (dict(sliding_window=4), [3]),  # every layer's window: one plan
    "qwen2-windows": (dict(sliding_window=4, window_layers=(1,)), [1, 1, 1]),  # layer 1 takes the local plan
}


def _native_cases() -> list[tuple[torch.dtype, int, str, bool]]:
    """(dtype, rows, family, avx2): every family at these rows, in the AVX-512 build and, as a
    CPU without AVX-512 runs it, the AVX2 one."""
    cases = [(torch.float32, 1), (torch.float32, 3), (torch.float32, 16)]
    cases += [(torch.bfloat16, 1), (torch.bfloat16, 3), (torch.bfloat16, 8), (torch.bfloat16, 16)]
    avx2 = [(torch.float32, 2), (torch.bfloat16, 1), (torch.bfloat16, 16)]
    return [(dtype, batch, family, False) for dtype, batch in cases for family in _FAMILIES] + [
        (dtype, batch, family, True) for dtype, batch in avx2 for family in _FAMILIES
    ]


def _assert_near_stock(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within the rounding of sums in another order. bf16: a value rounded the other way flows
    on through later layers and steps, bounded by a share of the tensor's magnitude."""
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2**-5}[expected.dtype]
    scale = float(expected.abs().max()) if expected.dtype == torch.bfloat16 else 1.0
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)


@needs_native_products
@pytest.mark.parametrize(("dtype", "batch", "family", "avx2"), _native_cases())
def test_eager_decode_steps_run_their_layers_in_one_call_and_equal_the_stock_kernels(
    dtype: torch.dtype, batch: int, family: str, avx2: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU runs attn::decode_layers, an eager decode step's layers are one call (one a
    run of layers that take the same plan); the logits and the cache equal the stock kernels'.
    Llama's layer and the options of Qwen2 (biases, windows on some layers), Qwen3 (q and k
    norms) and Mistral (a sliding window, here shorter than the generation). ``avx2``: as on a
    CPU with AVX2 and no AVX-512, the op's AVX2 build against the layers as modules there."""
    if avx2:
        avx2_only(monkeypatch)
    options, runs = _FAMILIES[family]
    model = _native_model(dtype, num_layers=3, **options)
    if options.get("qkv_bias"):  # tiny_model leaves biases at their init: make them count
        with torch.no_grad():
            for layer in model.layers:
                for projection in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):
                    projection.bias.normal_(0.0, 0.5)
    tokens = torch.randint(0, 61, (batch, 12), generator=torch.Generator().manual_seed(batch))
    calls = _native_calls(monkeypatch)
    native = _teacher_forced_logits(model, tokens, 5)
    native_caches = [(c.k_cache.clone(), c.v_cache.clone()) for c in model.kv_caches()]
    assert model.linear_kernels(True, 1, batch) == "native"
    assert calls == runs * 7  # 7 decode steps
    _stock(model, monkeypatch)
    stock = _teacher_forced_logits(model, tokens, 5)
    assert calls == runs * 7  # none more
    _assert_near_stock(native, stock)
    for (k, v), cache in zip(native_caches, model.kv_caches(), strict=True):
        _assert_near_stock(k, cache.k_cache)
        _assert_near_stock(v, cache.v_cache)


class _LoraLike(Linear):
    """What peft does to a projection: a module of another type in its place, with more to add."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


def _hooked(model: TransformerDecoder, seen: list[str]) -> None:
    model.layers[1].mlp.up_proj.register_forward_hook(lambda module, args, out: seen.append("hook"))


def _lora(model: TransformerDecoder, seen: list[str]) -> None:
    old = model.layers[0].attn.q_proj
    model.layers[0].attn.q_proj = _LoraLike(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    model.layers[0].attn.q_proj.register_forward_pre_hook(lambda module, args: seen.append("lora"))


def _patched_forward(model: TransformerDecoder, seen: list[str]) -> None:
    """A forward set on the instance, as accelerate's ``add_hook_to_module`` does."""
    mlp = model.layers[1].mlp
    forward = mlp.forward
    mlp.forward = lambda x: seen.append("patched") or forward(x)


def _pre_hooked_layer(model: TransformerDecoder, seen: list[str]) -> None:
    model.layers[2].register_forward_pre_hook(lambda module, args: seen.append("layer"))


@needs_native_products
@pytest.mark.parametrize(
    ("change", "expected", "runs"),
    [
        (_hooked, "hook", [1, 1]),  # FSDP2's hooks, a user's probe: they must run
        (_lora, "lora", [2]),  # peft's LoRA layers: the adapter must be applied
        (_patched_forward, "patched", [1, 1]),  # accelerate's hooks replace forward on the instance
        (_pre_hooked_layer, "layer", [2]),
    ],
)
def test_a_layer_with_hooks_or_another_projection_runs_its_modules(
    change, expected: str, runs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """attn::decode_layers computes the plain layer: in a decode step, a layer with a hook on one
    of its modules, or a projection of another type, runs its modules (the hook fires, the
    adapter adds its part), and its logits equal the stock kernels'; the layers before and after
    it are one call each."""
    model, seen = _native_model(torch.float32, num_layers=3), []
    change(model, seen)
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    calls = _native_calls(monkeypatch)
    native = _teacher_forced_logits(model, tokens, 3)
    assert model.linear_kernels(True, 1, 2) == "native"
    assert calls == runs * 4 and seen.count(expected) >= 5  # the prompt and 4 steps
    seen.clear()
    _stock(model, monkeypatch)
    stock = _teacher_forced_logits(model, tokens, 3)
    assert seen.count(expected) >= 5
    torch.testing.assert_close(native, stock, rtol=1e-4, atol=1e-4)


@needs_native_products
@pytest.mark.parametrize("change", ["none", "hooked norm", "hooked last layer", "offset norm"])
def test_the_final_norm_runs_in_the_last_call_where_it_is_the_plain_one(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final RMSNorm runs inside the step's last attn::decode_layers call (its weight and eps
    passed), unless a hook is on it, the last layer runs its own modules, or it is not Llama's
    norm: then the norm module runs after the step. The logits equal the stock kernels' either way."""
    model, seen = _native_model(torch.bfloat16, num_layers=3), []
    model.norm.eps = 1e-3
    if change == "hooked norm":
        model.norm.register_forward_hook(lambda module, args, out: seen.append("norm") or out * 1.5)
    elif change == "hooked last layer":
        model.layers[2].register_forward_hook(lambda module, args, out: seen.append("layer"))
    elif change == "offset norm":
        model.norm.unit_offset = True
    finals: list[tuple[torch.Tensor | None, float]] = []
    op = torch.ops.attn.decode_layers

    def recorded(*args: object) -> torch.Tensor:
        finals.append((args[11], args[12]))
        return op(*args)

    monkeypatch.setattr(torch.ops.attn, "decode_layers", recorded)
    tokens = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(0))
    native = _teacher_forced_logits(model, tokens, 3)
    if change == "none":
        assert finals == [(model.norm.weight, 1e-3)] * 4  # 4 decode steps, one call each
    else:
        assert finals and all(weight is None for weight, _ in finals)
    _stock(model, monkeypatch)
    stock = _teacher_forced_logits(model, tokens, 3)
    _assert_near_stock(native, stock)
    if change.startswith("hooked"):
        assert len(seen) == 2 * 5  # the prompt and 4 steps, in each run


@needs_native_products
def test_a_global_forward_hook_fires_for_every_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook registered for every module (``register_module_forward_hook``: a profiler's, a
    tracker's) sees the same module calls in a decode step as on the stock kernels: the step runs
    the modules while it is registered, and native calls again once it is removed."""
    model = _native_model(torch.float32)
    tokens = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    calls = _native_calls(monkeypatch)
    seen: list[str] = []
    record = lambda module, args, out: seen.append(type(module).__name__)  # noqa: E731
    handle = nn.modules.module.register_module_forward_hook(record)
    try:
        native = _teacher_forced_logits(model, tokens, 3)
        native_seen = list(seen)
        seen.clear()
        with monkeypatch.context() as stock_patch:
            _stock(model, stock_patch)
            stock = _teacher_forced_logits(model, tokens, 3)
    finally:
        handle.remove()
    assert calls == [] and native_seen == seen and "Linear" in seen
    torch.testing.assert_close(native, stock, rtol=1e-4, atol=1e-4)
    _teacher_forced_logits(model, tokens, 3)
    assert calls == [2] * 3


@needs_native_products
def test_teardown_lets_the_caches_go() -> None:
    """The step built for a model's caches holds them no longer than the model: torn down, they
    are freed."""
    model = _native_model(torch.float32)
    _teacher_forced_logits(model, torch.zeros(1, 4, dtype=torch.long), 2)
    buffers = [weakref.ref(cache.k_cache) for cache in model.kv_caches()]
    model.teardown_caches()
    gc.collect()
    assert all(ref() is None for ref in buffers)


_PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj")
_HOOKED = ("", "attn", "mlp", "attn_norm", "mlp_norm", *_PROJECTIONS, "mlp.down_proj")


class NativeStepMachine(RuleBasedStateMachine):
    """Two copies of one model take the same calls: one whose decode steps are native, one on the
    stock kernels. Between steps, either may change in any way the native step reads: a hook
    added or removed on any module of a layer or on the final norm, a forward set on one of those
    modules' instances, a projection's weight or
    bias replaced, a projection swapped for an adapter, a norm's eps changed, the final norm's
    weight and eps replaced, cache rows kept or forked, the caches rewound or set up again.
    Every change is followed by a step (and more come at random), and every step's logits
    agree: the native step was rebuilt after each change, and after a fork it reads the shared
    slots from each group's first row (the stock one reads every row's own), which hold what
    ``shared_slots`` says they do."""

    @initialize(batch=st.sampled_from([1, 2, 3]))
    def build(self, batch: int) -> None:
        self.native = _native_model(torch.float32, num_layers=3, qkv_bias=True)
        self.stock = copy.deepcopy(self.native)
        self.stock.native_layers = lambda batch_size: False  # an instance attribute: this copy only
        self.hooks: list[list[torch.utils.hooks.RemovableHandle]] = []
        self.setup(batch)

    def both(self) -> tuple[TransformerDecoder, TransformerDecoder]:
        return self.native, self.stock

    @rule(batch=st.sampled_from([1, 2, 4]))
    def setup(self, batch: int) -> None:
        prompt = torch.randint(0, 61, (batch, 3), generator=torch.Generator().manual_seed(batch))
        for model in self.both():
            model.setup_caches(batch, 40)
            with torch.inference_mode():
                model(prompt)
        self.batch = batch
        self.step()

    @rule(seed=st.integers(0, 2**16))
    def step(self, seed: int = 0) -> None:
        if self.native.cache_state.size >= 40:
            return self.setup(self.batch)
        token = torch.randint(0, 61, (self.batch, 1), generator=torch.Generator().manual_seed(seed))
        assert self.native.linear_kernels(True, 1, self.batch) == "native"
        with torch.inference_mode():
            native, stock = self.native(token), self.stock(token)
        torch.testing.assert_close(native, stock, rtol=1e-4, atol=1e-4)
        return None

    @rule(layer=st.integers(0, 2), name=st.sampled_from(_HOOKED), pre=st.booleans())
    def add_hook(self, layer: int, name: str, pre: bool) -> None:
        handles = []
        for model in self.both():
            module = model.layers[layer].get_submodule(name)
            if pre:  # scales the module's input
                handles.append(module.register_forward_pre_hook(lambda m, args: (args[0] * 0.9, *args[1:])))
            else:  # shifts its output
                handles.append(module.register_forward_hook(lambda m, args, out: out + 0.01))
        self.hooks.append(handles)
        self.step()

    @rule(data=st.data())
    def remove_hook(self, data: st.DataObject) -> None:
        if self.hooks:
            for handle in self.hooks.pop(data.draw(st.integers(0, len(self.hooks) - 1))):
                handle.remove()
            self.step()

    @rule(layer=st.integers(0, 2), name=st.sampled_from(_PROJECTIONS), part=st.sampled_from(["weight", "bias"]))
    def replace_parameter(self, layer: int, name: str, part: str) -> None:
        old = getattr(self.native.layers[layer].get_submodule(name), part)
        if old is None:
            return
        new = torch.randn(old.shape, generator=torch.Generator().manual_seed(layer)) * 0.2
        for model in self.both():
            setattr(model.layers[layer].get_submodule(name), part, nn.Parameter(new.clone()))
        self.step()

    @rule(layer=st.integers(0, 2), name=st.sampled_from(_PROJECTIONS))
    def swap_for_adapter(self, layer: int, name: str) -> None:
        for model in self.both():
            parent_name, child = name.split(".")
            parent = model.layers[layer].get_submodule(parent_name)
            old = getattr(parent, child)
            adapter = _LoraLike(old.in_features, old.out_features, bias=old.bias is not None)
            adapter.load_state_dict(old.state_dict())
            setattr(parent, child, adapter)
        self.step()

    @rule(layer=st.integers(0, 2), name=st.sampled_from(["attn_norm", "mlp_norm"]), eps=st.sampled_from([1e-5, 0.5]))
    def set_eps(self, layer: int, name: str, eps: float) -> None:
        for model in self.both():
            model.layers[layer].get_submodule(name).eps = eps
        self.step()

    @rule(pre=st.booleans())
    def hook_final_norm(self, pre: bool) -> None:
        handles = []
        for model in self.both():
            if pre:
                handles.append(model.norm.register_forward_pre_hook(lambda m, args: (args[0] * 0.9, *args[1:])))
            else:
                handles.append(model.norm.register_forward_hook(lambda m, args, out: out + 0.01))
        self.hooks.append(handles)
        self.step()

    @rule(layer=st.integers(0, 2), name=st.sampled_from([*_HOOKED, "norm"]))
    def patch_forward(self, layer: int, name: str) -> None:
        """A forward set on a module instance, as accelerate's ``add_hook_to_module`` does: it must run."""
        for model in self.both():
            module = model.norm if name == "norm" else model.layers[layer].get_submodule(name)
            if "forward" in module.__dict__:
                continue
            forward = module.forward
            module.forward = lambda *args, _forward=forward, **kwargs: _forward(*args, **kwargs) * 0.95
        self.step()

    @rule(eps=st.sampled_from([1e-5, 0.5]), seed=st.integers(0, 3))
    def change_final_norm(self, eps: float, seed: int) -> None:
        weight = torch.rand(self.native.norm.weight.shape, generator=torch.Generator().manual_seed(seed)) + 0.5
        for model in self.both():
            model.norm.eps = eps
            model.norm.weight = nn.Parameter(weight.clone())
        self.step()

    @rule(data=st.data())
    def keep_rows(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.integers(0, self.batch - 1), min_size=1, max_size=4))
        for model in self.both():
            model.select_caches(rows)
        self.batch = len(rows)
        self.step()

    @rule(copies=st.integers(1, 3))
    def fork(self, copies: int) -> None:
        if self.batch * copies > 8:
            return
        filled = self.native.cache_state.size
        for model in self.both():
            model.fork_caches(copies)
        self.batch *= copies
        assert self.native.cache_state.shared_slots == ((copies, filled) if copies > 1 else None)
        self.step()

    @rule(back=st.integers(1, 6))
    def rewind(self, back: int) -> None:
        fill = max(1, self.native.cache_state.size - back)
        for model in self.both():
            model.rewind_caches(fill)
        assert self.native.cache_state.shared_slots is None
        self.step()

    @invariant()
    def same_fill(self) -> None:
        assert self.native.cache_state.size == self.stock.cache_state.size

    @invariant()
    def shared_slots_hold_the_groups_first_rows(self) -> None:
        state = self.native.cache_state
        if state.shared_slots is None:
            return
        group, slots = state.shared_slots
        assert 0 < slots <= state.size and state.batch_size % group == 0
        for cache in state.caches:
            for buffer in (cache.k_cache, cache.v_cache):  # (b, h_kv, L, d)
                shared = buffer[:, :, :slots]
                leads = shared[::group].repeat_interleave(group, 0)
                assert torch.equal(shared, leads)


@needs_native_products
def test_native_step_follows_every_change_between_steps() -> None:
    machine = NativeStepMachine.TestCase
    # Sequences of 16 calls, 60 of them at least (a second on two cores): fewer missed a rebuild.
    machine.settings = settings(max_examples=examples(60), stateful_step_count=16, deadline=None)
    machine().runTest()


_NOT_NATIVE_LAYERS = {
    "gemma2": lambda: _native_model(torch.float32, **GEMMA_OPTIONS["gemma2"]),
    "ragged": lambda: _native_model(torch.float32, hidden_dim=40),  # not whole vectors
}


@needs_native_products
@pytest.mark.parametrize(
    ("build", "batch", "expected"),
    [
        (_NOT_NATIVE_LAYERS["gemma2"], 2, "native"),  # attn's products, the layers as modules
        (_NOT_NATIVE_LAYERS["ragged"], 2, "native"),
        (lambda: _native_model(torch.float32), 17, "onednn"),  # past the fp32 product's 16 rows
        (lambda: _native_model(torch.bfloat16), 33, "default"),  # past every bf16 product's rows
    ],
)
def test_layers_it_does_not_compute_run_as_modules(build, batch: int, expected: str) -> None:
    """A model or a batch attn::decode_layers does not take runs its layers as modules: on
    attn's few-row products where they take every linear, else on the other kernels."""
    model = build()
    model.setup_caches(batch, 16)
    assert not model.native_layers(batch)
    got = model.linear_kernels(True, 1, batch)
    assert got == expected or (expected == "onednn" and got == "default")  # onednn: AMD CPUs only


@needs_bf16_matvec  # it counts attn::fp32_linear and attn::bf16_matvec calls
@pytest.mark.parametrize("name", sorted(_NOT_NATIVE_LAYERS))
def test_layers_run_as_modules_on_attns_products_match_an_uncached_pass(name: str) -> None:
    """Those layers' decode steps call attn::fp32_linear for every linear and never
    attn::decode_layers, and their logits are those of a pass without the cache."""
    model = _NOT_NATIVE_LAYERS[name]()
    tokens = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    model.setup_caches(2, 6)
    with attn.cached_inference(model):
        steps = [model(tokens[:, :4])]
        with OperatorCalls() as calls:
            steps += [model(tokens[:, i : i + 1]) for i in (4, 5)]
    linears = sum(isinstance(m, nn.Linear) for m in model.layers.modules()) + 1  # and the output layer
    assert calls.names.count("attn.fp32_linear.default") == 2 * linears
    assert not any("decode_layers" in call for call in calls.names)
    with torch.no_grad():
        want = model(tokens)
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=2e-5, rtol=2e-5)


@needs_native_products
def test_native_layers_need_a_cache_of_the_models_dtype_and_leave_other_choices_alone() -> None:
    model = _native_model(torch.float32)
    assert not model.native_layers(2)  # no caches yet
    model.setup_caches(2, 16, dtype=torch.bfloat16)
    assert not model.native_layers(2)
    model.setup_caches(2, 16)
    assert model.linear_kernels(True, 1, 2) == "native"
    assert model.linear_kernels(True, 2, 2) == "default"  # prefill
    assert model.linear_kernels(False, 1, 2) == "default"  # no cache: scoring, training
    attn.set_packed_decode(model)
    assert model.linear_kernels(True, 1, 2) == "packed"  # asked for
    attn.set_packed_decode(model, False)
    attn.set_parity_mode(model)
    assert model.linear_kernels(True, 1, 2) == "exact"
    assert all(native_product(2, width, torch.float32) is not None for width in (32, 64))


@needs_native_products
@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))])
def test_a_copy_decodes_with_its_own_weights(copy_of, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deep copy or a pickle of a model that has run native steps computes with its own
    weights: changed in place after the copy, they give the copy's stock logits, not the
    original's."""
    model = _native_model(torch.float32)
    tokens = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(0))
    _teacher_forced_logits(model, tokens, 3)
    twin = copy_of(model)
    with torch.no_grad():
        twin.layers[1].mlp.down_proj.weight.mul_(-1.0)
    calls = _native_calls(monkeypatch)
    native = _teacher_forced_logits(twin, tokens, 3)
    assert calls == [2] * 3
    _stock(twin, monkeypatch)
    torch.testing.assert_close(native, _teacher_forced_logits(twin, tokens, 3), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(native, _teacher_forced_logits(model, tokens, 3))


def _poison_copies(model: TransformerDecoder, seed: int) -> None:
    """Other values in every forked row's shared slots but each group's first: what reads them
    gets logits of its own."""
    group, slots = model.cache_state.shared_slots
    gen = torch.Generator().manual_seed(seed)
    for cache in model.kv_caches():
        for buffer in (cache.k_cache, cache.v_cache):  # (b, h_kv, L, d)
            copies = torch.arange(buffer.shape[0]) % group != 0
            noise = torch.randn(buffer[copies, :, :slots].shape, generator=gen).to(buffer.dtype)
            buffer[copies, :, :slots] = noise


@needs_native_products
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("avx2", [False, True])
def test_after_a_fork_decode_steps_read_the_shared_slots_once_for_each_group(
    dtype: torch.dtype, avx2: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill 2 prompts, fork each 3 ways, then decode: the native step reads each group's
    prompt slots from its first row (garbage in the other rows' copies changes no bit of the
    logits), and its logits are, bit for bit, those of the same step reading every row's own
    copy. Both builds: AVX-512 and AVX2."""
    if avx2:
        avx2_only(monkeypatch)
    model = _native_model(dtype)
    twin = copy.deepcopy(model)
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(0))
    steps = torch.randint(0, 61, (6, 4), generator=torch.Generator().manual_seed(1))
    logits = []
    for copy_ in (model, twin):
        copy_.setup_caches(2, 16)
        with torch.inference_mode():
            copy_(prompt)
            copy_.fork_caches(3)
    assert model.cache_state.shared_slots == (3, 5)
    _poison_copies(model, seed=2)
    twin.cache_state.shared_slots = None  # every row read from its own copy
    misread = copy.deepcopy(model)
    misread.cache_state.shared_slots = None  # the poisoned copies read
    calls = _native_calls(monkeypatch)
    for copy_ in (model, twin, misread):
        with torch.inference_mode():
            logits.append(torch.cat([copy_(steps[:, i : i + 1]) for i in range(steps.shape[1])], 1))
    assert calls == [2] * 12  # native steps, every model
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(logits[2][::3], logits[1][::3])  # the groups' first rows: not poisoned
    copies = torch.arange(6) % 3 != 0
    assert not torch.isclose(logits[2][copies], logits[1][copies]).all(-1).any()  # each copy's: other values
