"""attn/packed.py: packed decode runs only eager decode steps, follows the weights as they
change, and gives the stock kernels' results."""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounter

import attn
from attn import packed
from attn.packed import linear, packed_linears

from .conftest import tiny_model

pytestmark = pytest.mark.skipif(not packed.packed_decode_available(), reason="this torch build has no oneDNN")


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Records the weights each packed product read, in call order."""
    read: list[torch.Tensor] = []
    original = packed._packed

    def recording(weight: torch.Tensor, rows: int, wide: bool) -> torch.Tensor:
        read.append(weight)
        return original(weight, rows, wide)

    monkeypatch.setattr(packed, "_packed", recording)
    return read


def _uncached_logits(model: attn.TransformerDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """The reference: every position recomputed without the cache, with the stock kernels."""
    with torch.no_grad():
        return model(tokens)


@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    rows=st.integers(1, 5),
    prompt=st.integers(1, 6),
    steps=st.integers(1, 5),
    seed=st.integers(0, 2**16),
    packed_decode=st.booleans(),
    cpu_bf16=st.booleans(),
)
def test_decode_steps_match_an_uncached_recomputation(
    dtype, rows, prompt, steps, seed, packed_decode, cpu_bf16
) -> None:
    """Packed (bf16 widened to fp32 from 4 rows on a CPU without bf16 arithmetic, whichever
    this one is), or (the default) oneDNN's product on the weights as they are in fp32."""
    model = tiny_model(seed % 7).to(dtype)
    attn.set_packed_decode(model, packed_decode)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 61, (rows, prompt + steps), generator=generator)
    model.setup_caches(rows, prompt + steps)
    with attn.cached_inference(model), pytest.MonkeyPatch.context() as patch:
        patch.setattr(packed, "bf16_arithmetic", lambda: cpu_bf16)
        cached = [model(tokens[:, :prompt])]
        cached += [model(tokens[:, i : i + 1]) for i in range(prompt, prompt + steps)]
    got = torch.cat(cached, 1).float()
    want = _uncached_logits(model, tokens).float()
    tolerance = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    torch.testing.assert_close(got, want, **tolerance)


def test_only_eager_decode_steps_read_packed_weights(packs: list[torch.Tensor]) -> None:
    model = tiny_model()
    attn.set_packed_decode(model)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    model.setup_caches(2, 16)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with attn.cached_inference(model):
        model(tokens)  # prefill: three tokens a row
    assert packs == []
    with torch.no_grad():
        model(tokens[:, :1])  # scoring without the cache, one token
    model(tokens[:, :1]).sum().backward()  # training
    assert packs == []
    with attn.cached_inference(model):
        model(tokens[:, :1])  # a decode step: every projection and the tied head
    assert [id(w) for w in packs] == [id(w) for w in linears]  # every projection, then the output layer
    packs.clear()
    attn.set_packed_decode(model, False)
    with attn.cached_inference(model):
        model(tokens[:, :1])
    assert packs == []


def test_a_changed_weight_is_packed_again() -> None:
    """An RL loop trains between generations: the next decode step must read the new weights."""
    model = tiny_model(3)
    attn.set_packed_decode(model)
    reference = tiny_model(3)
    model.setup_caches(1, 8)
    reference.setup_caches(1, 8)
    step = torch.tensor([[5]])
    for change in range(3):
        for m in (model, reference):
            m.reset_caches()
            with attn.cached_inference(m):
                m(torch.tensor([[1, 2]]))
        with attn.cached_inference(model), attn.cached_inference(reference):
            torch.testing.assert_close(model(step), reference(step), atol=2e-5, rtol=2e-5)
        with torch.no_grad():
            for m in (model, reference):
                if change == 0:  # in place, as an optimizer step: the version counter moves
                    m.layers[0].mlp.up_proj.weight.mul_(-1.5)
                else:  # a new storage, as .data = ...: the pointer moves
                    m.layers[1].attn.q_proj.weight.data = m.layers[1].attn.q_proj.weight.data * 0.5


def test_turning_it_off_frees_the_packed_weights() -> None:
    model = tiny_model()
    attn.set_packed_decode(model)
    model.setup_caches(1, 4)
    with attn.cached_inference(model):
        model(torch.tensor([[1]]))
    held = [p for p in model.parameters() if p in packed._PACKS]
    assert len(held) == 2 * 7 + 1  # seven projections in each of two layers, and the output layer
    attn.set_packed_decode(model, False)
    assert not any(p in packed._PACKS for p in model.parameters())


def test_the_packed_product_matches_f_linear_in_any_shape() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weight, bias = torch.randn(24, 40).to(dtype), torch.randn(24).to(dtype)
        for shape in ((1, 40), (7, 40), (2, 3, 40)):
            x = torch.randn(shape).to(dtype)
            with packed_linears():
                got = linear(x, weight, bias)
            want = F.linear(x.double(), weight.double(), bias.double())
            assert got.shape == want.shape and got.dtype == dtype
            tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
            torch.testing.assert_close(got.double(), want, **tolerance)


@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_bf16_products_widen_from_four_rows_on_a_cpu_without_bf16_arithmetic(
    monkeypatch: pytest.MonkeyPatch, cpu_bf16: bool
) -> None:
    monkeypatch.setattr(packed, "bf16_arithmetic", lambda: cpu_bf16)
    torch.manual_seed(0)
    weight, bias = torch.randn(24, 40).bfloat16(), torch.randn(24).bfloat16()
    for rows in (1, 3, 4, 16):
        x = torch.randn(rows, 40).bfloat16()
        with packed_linears():
            got = linear(x, weight, bias)
        want = F.linear(x.double(), weight.double(), bias.double())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, atol=0.1, rtol=0.02)
        wide = not cpu_bf16 and rows >= packed.WIDEN_FROM_ROWS
        if wide or packed.bf16_packs():
            assert packed._PACKS[weight][1].dtype == (torch.float32 if wide else torch.bfloat16)
        else:  # oneDNN cannot pack bf16 on this CPU: the stock kernel, nothing packed
            assert weight not in packed._PACKS
    fp32 = weight.float()
    with packed_linears():
        linear(torch.randn(16, 40), fp32)
    assert packed._PACKS[fp32][1].dtype == torch.float32  # fp32 weights are packed as they are


def test_where_onednn_cannot_pack_bf16_a_few_rows_run_the_stock_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX2-only CPUs: oneDNN's bf16 reorder raises there, so fewer than ``WIDEN_FROM_ROWS``
    rows run ``F.linear`` (bit for bit) and more read a widened fp32 copy."""
    monkeypatch.setattr(packed, "bf16_packs", lambda: False)
    monkeypatch.setattr(packed, "bf16_arithmetic", lambda: False)
    torch.manual_seed(1)
    weight, bias = torch.randn(24, 40).bfloat16(), torch.randn(24).bfloat16()
    x = torch.randn(packed.WIDEN_FROM_ROWS - 1, 40).bfloat16()
    with packed_linears():
        got = linear(x, weight, bias)
    assert torch.equal(got, F.linear(x, weight, bias)) and weight not in packed._PACKS
    with packed_linears():
        linear(torch.randn(packed.WIDEN_FROM_ROWS, 40).bfloat16(), weight, bias)
    assert packed._PACKS[weight][1].dtype == torch.float32


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="reads x86 /proc/cpuinfo")
def test_bf16_packs_agrees_with_the_cpu_flags() -> None:
    with open("/proc/cpuinfo") as cpuinfo:
        flags = set(next(line for line in cpuinfo if line.startswith("flags")).split())
    avx512 = {"avx512bw", "avx512vl", "avx512dq"} <= flags
    assert packed.bf16_packs() == (avx512 or "avx_ne_convert" in flags)


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="reads x86 /proc/cpuinfo")
def test_bf16_arithmetic_agrees_with_the_cpu_flags() -> None:
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    assert packed.bf16_arithmetic() == ("avx512_bf16" in flags or "amx_tile" in flags)


def test_what_it_cannot_pack_runs_the_stock_kernel(packs: list[torch.Tensor]) -> None:
    x, weight = torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    with packed_linears():
        torch.testing.assert_close(linear(x, weight), F.linear(x, weight))  # float64: not packed
        half = linear(x.half(), weight.half())  # float16: not packed
        torch.testing.assert_close(half, F.linear(x.half(), weight.half()))
    assert packs == []


def test_an_unknown_kind_is_refused_before_the_switch_moves() -> None:
    switch = packed_linears("mkl")  # type: ignore[arg-type]
    kinds = r"\('packed', 'onednn', 'matvec', 'native', 'widened'\)"
    with pytest.raises(ValueError, match=rf"kind must be one of {kinds}, got 'mkl'"):
        switch.__enter__()
    assert getattr(packed._this_thread, "kind", None) is None


def test_the_switch_is_per_thread(packs: list[torch.Tensor]) -> None:
    x, weight = torch.randn(2, 8), torch.randn(4, 8)
    seen = []
    with packed_linears():
        thread = threading.Thread(target=lambda: seen.append(linear(x, weight)))
        thread.start()
        thread.join()
    assert len(seen) == 1 and packs == []


def test_compiled_passes_run_the_stock_kernels_in_one_graph(packs: list[torch.Tensor]) -> None:
    model = tiny_model()
    attn.set_packed_decode(model)
    model.setup_caches(1, 8)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with attn.cached_inference(model):
        compiled(torch.tensor([[1, 2]]))
        compiled(torch.tensor([[3]]))
        compiled(torch.tensor([[4]]))
    assert packs == [] and counter.frame_count == 2  # one graph for the prefill, one for the steps


@pytest.mark.parametrize(
    ("model", "enabled", "message"),
    [
        (torch.nn.Linear(2, 2), True, r"takes an attn.TransformerDecoder, .* got a Linear"),
        (None, "yes", r"enabled must be a bool, got 'yes'"),
    ],
)
def test_bad_arguments_are_refused(model: object, enabled: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        attn.set_packed_decode(model if model is not None else tiny_model(), enabled)  # type: ignore[arg-type]


def test_state_dict_and_linear_type_are_unchanged() -> None:
    model = tiny_model()
    assert all(isinstance(m.q_proj, torch.nn.Linear) for m in (layer.attn for layer in model.layers))
    assert "layers.0.attn.q_proj.weight" in model.state_dict()


def test_a_tied_head_reads_the_packed_embedding(packs: list[torch.Tensor]) -> None:
    model = tiny_model(tie_embeddings=True)
    attn.set_packed_decode(model)
    model.setup_caches(1, 4)
    with attn.cached_inference(model):
        model(torch.tensor([[1]]))
    assert packs[-1] is model.tok_embeddings.weight


def test_lora_adapters_train_between_packed_generations() -> None:
    """LoRA-PPO's loop: generate with packed decode, step the adapters, generate again. The
    frozen base weights stay packed, the adapters run the stock kernel, and every generation
    equals the same model's without packing."""
    from attn.demo.lora import add_lora, lora_parameters

    model = tiny_model(5)
    adapters = add_lora(model, rank=2, seed=1)
    with torch.no_grad():
        for adapter in adapters:
            adapter.up.weight.normal_(0.0, 0.3)  # a trained adapter, not a zero one
    optimizer = torch.optim.SGD(lora_parameters(model), lr=0.5)
    prompts = [[1, 2, 3], [4, 5, 6]]
    for _ in range(2):
        attn.set_packed_decode(model)
        packed_out = attn.generate(model, prompts, max_new_tokens=5, return_logits=True)
        model.packed_decode = False
        plain_out = attn.generate(model, prompts, max_new_tokens=5, return_logits=True)
        assert torch.equal(packed_out.tokens, plain_out.tokens)
        torch.testing.assert_close(packed_out.logits, plain_out.logits, atol=2e-5, rtol=2e-5)
        loss = model(packed_out.tokens).logsumexp(-1).mean()  # a grad step on the adapters only
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_it_takes_the_model_through_its_wrappers() -> None:
    model = tiny_model()
    for wrapper in (torch.compile(model, backend="eager"), attn.compile_for_decode(model)):
        attn.set_packed_decode(wrapper)
        assert model.packed_decode
        attn.set_packed_decode(wrapper, False)
        assert not model.packed_decode


@pytest.fixture
def torch_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU whose decode-step products attn's own kernels do not take (none of AVX2, AVX-512):
    the kernels chosen are torch's (attn's are ``tests/test_native.py``'s)."""
    monkeypatch.setattr(attn.decoder, "native_product", lambda rows, features, dtype: None)


@pytest.fixture
def as_vendor(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str | None], None]]:
    """Sets the CPU vendor ``attn.packed.plain_onednn_faster`` reads, for the test."""

    def set_vendor(vendor: str | None) -> None:
        monkeypatch.setattr(packed, "cpu_vendor", lambda: vendor)
        packed.plain_onednn_faster.cache_clear()

    yield set_vendor
    packed.plain_onednn_faster.cache_clear()  # before monkeypatch restores the vendor


def test_a_default_fp32_decode_step_runs_onednn_on_the_weights_as_they_are(
    monkeypatch: pytest.MonkeyPatch, as_vendor: Callable[[str | None], None], torch_products: None
) -> None:
    """On an AMD CPU: no packed copy, and only decode steps; bf16 steps keep F.linear."""
    as_vendor("AuthenticAMD")
    calls: list[torch.Tensor] = []
    original = torch.ops.mkldnn._linear_pointwise

    def recording(x, weight, *args):  # type: ignore[no-untyped-def]
        calls.append(weight)
        return original(x, weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", recording)
    model = tiny_model()
    model.setup_caches(1, 8)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2]]))
        assert calls == []  # a prefill: F.linear
        model(torch.tensor([[3]]))
    assert [id(w) for w in calls] == [id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert not any(w in packed._PACKS for w in calls)
    calls.clear()
    model.to(torch.bfloat16).teardown_caches()
    model.setup_caches(1, 8)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2]]))
        model(torch.tensor([[3]]))
    assert calls == []


@pytest.mark.parametrize("vendor", ["GenuineIntel", None])
def test_a_default_fp32_decode_step_keeps_f_linear_off_amd_cpus(
    monkeypatch: pytest.MonkeyPatch,
    as_vendor: Callable[[str | None], None],
    vendor: str | None,
    torch_products: None,
) -> None:
    """MKL's F.linear is the faster there (docs/performance.md): no oneDNN call, no copy."""
    as_vendor(vendor)
    calls: list[torch.Tensor] = []
    original = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, *a: calls.append(w) or original(x, w, *a))
    model = tiny_model()
    model.setup_caches(1, 8)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2]]))
        model(torch.tensor([[3]]))
    assert model.linear_kernels(True, 1, 1) == "default"
    assert calls == []


def test_cpu_vendor_agrees_with_proc_cpuinfo() -> None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo to compare with")
    vendor_ids = {line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")}
    expected = next(iter(vendor_ids)) if vendor_ids else None
    assert packed.cpu_vendor() == (expected if expected in ("GenuineIntel", "AuthenticAMD") else None)
    assert packed.plain_onednn_faster() == (expected == "AuthenticAMD")


def test_the_plan_names_the_linear_kernels_of_each_pass(
    as_vendor: Callable[[str | None], None], torch_products: None
) -> None:
    as_vendor("AuthenticAMD")
    model = tiny_model()
    assert model.linear_kernels(True, 1, 4) == "onednn"  # a CPU fp32 decode step where oneDNN's is the faster
    assert model.linear_kernels(True, 2, 4) == model.linear_kernels(False, 1, 4) == "default"
    attn.set_packed_decode(model)
    assert model.linear_kernels(True, 1, 4) == "packed"
    attn.set_packed_decode(model, False)
    model.to(torch.bfloat16)
    assert model.linear_kernels(True, 1, 1) == "matvec"  # one row: oneDNN's matrix-vector product
    assert model.linear_kernels(True, 1, 4) == "default"  # bf16 F.linear is oneDNN's already
    assert model.linear_kernels(True, 2, 1) == model.linear_kernels(False, 1, 1) == "default"
    attn.set_packed_decode(model)
    assert model.linear_kernels(True, 1, 1) == "packed"
    attn.set_parity_mode(model)
    assert model.linear_kernels(True, 1, 1) == "exact"
    attn.set_parity_mode(model, False)
    model.half()
    assert model.linear_kernels(True, 1, 1) == "packed"  # asked for; fp16 weights run F.linear inside it
    attn.set_packed_decode(model, False)
    assert model.linear_kernels(True, 1, 1) == "default"  # fp16: torch.mv is 3x slower than F.linear


@given(
    leading=st.sampled_from([(), (1,), (1, 1), (1, 1, 1)]),
    features=st.integers(1, 80),
    outputs=st.integers(1, 80),
    with_bias=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_one_row_bf16_product_matches_a_float64_reference(
    leading, features, outputs, with_bias, strided, seed
) -> None:
    """``kind="matvec"``: any one-row input shape, with or without a bias, a strided row."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(outputs, features, generator=generator).bfloat16()
    bias = torch.randn(outputs, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(*leading, 2 * features, generator=generator).bfloat16()
    x = x[..., ::2] if strided else x[..., :features]
    with packed_linears("matvec"):
        got = linear(x, weight, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.01)


def test_matvec_runs_one_row_bf16_products_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows, another dtype: F.linear as it is."""
    rows: list[int] = []
    original = packed._matvec
    monkeypatch.setattr(packed, "_matvec", lambda x, w, b: rows.append(x.shape[:-1].numel()) or original(x, w, b))
    weight = torch.randn(6, 8)
    with packed_linears("matvec"):
        linear(torch.randn(1, 8).bfloat16(), weight.bfloat16())
        linear(torch.randn(2, 8).bfloat16(), weight.bfloat16())
        linear(torch.randn(1, 8), weight)
        linear(torch.randn(1, 8).half(), weight.half())
    assert rows == [1]


def test_a_bf16_decode_step_at_batch_1_runs_matrix_vector_products(
    monkeypatch: pytest.MonkeyPatch, torch_products: None
) -> None:
    """Each projection and the head once a step; not in a prefill, at batch 2 or compiled."""
    calls: list[torch.Tensor] = []
    original = packed._matvec
    monkeypatch.setattr(packed, "_matvec", lambda x, w, b: calls.append(w) or original(x, w, b))
    model = tiny_model().bfloat16()
    linears = [id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    model.setup_caches(1, 8)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2]]))
        assert calls == []  # a prefill
        model(torch.tensor([[3]]))
        assert [id(w) for w in calls] == linears
        calls.clear()
        torch.compile(model, backend="eager")(torch.tensor([[4]]))
    assert calls == []
    model.teardown_caches()
    model.setup_caches(2, 8)
    with attn.cached_inference(model):
        model(torch.tensor([[1, 2], [3, 4]]))
        model(torch.tensor([[3], [5]]))
    assert calls == []


@given(
    rows=st.integers(1, 3 * packed.WIDEN_EACH_CALL_FROM_ROWS),
    dims=st.tuples(st.integers(1, 48), st.integers(1, 40)),
    with_bias=st.booleans(),
    block=st.integers(1, 2000),
    seed=st.integers(0, 2**16),
)
def test_widened_products_round_the_exact_product_once(
    rows: int, dims: tuple[int, int], with_bias: bool, block: int, seed: int
) -> None:
    """``kind="widened"``: from ``WIDEN_EACH_CALL_FROM_ROWS`` rows a bf16 product is the fp32
    product of the bf16 operands, rounded to bf16 once, whatever the blocks the weight is widened
    in (``WIDENED_WEIGHT_ELEMENTS``); fewer rows run ``F.linear`` bit for bit."""
    n, k = dims
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    weight = torch.randn(n, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    with packed_linears("widened"), mock.patch.object(packed, "WIDENED_WEIGHT_ELEMENTS", block):
        got = linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    if rows < packed.WIDEN_EACH_CALL_FROM_ROWS:
        assert torch.equal(got, F.linear(x, weight, bias))
        return
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())  # (rows, n)
    # fp32 sums of at most 41 exact products: within 41 fp32 ulps of the exact sum, then one bf16 rounding
    fp32_slack = (
        41 * 2.0**-23 * (x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs()))
    )
    bf16_ulp = 2.0 ** (torch.floor(torch.log2(exact.abs() + fp32_slack).clamp(min=-126)) - 7)
    assert ((got.double() - exact).abs() <= bf16_ulp + fp32_slack).all()


def test_passes_without_gradients_widen_bf16_products_on_a_cpu_without_bf16_arithmetic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill or a scoring pass of a bf16 model where the CPU has no bf16 arithmetic runs its
    products of many rows in fp32 (oneDNN's bf16 kernel is 4-6x slower there); a pass with
    gradients, a decode step, an fp32 model and a CPU with bf16 arithmetic keep their kernels."""
    model = tiny_model().to(torch.bfloat16)
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    for cpu_bf16 in (True, False):
        monkeypatch.setattr(attn.decoder, "bf16_arithmetic", lambda cpu_bf16=cpu_bf16: cpu_bf16)
        with torch.no_grad():
            assert (
                model.linear_kernels(False, 8, 2)
                == model.linear_kernels(True, 8, 2)
                == ("default" if cpu_bf16 else "widened")
            )
            assert model.linear_kernels(True, 1, 2) != "widened"  # a decode step
        assert model.linear_kernels(False, 8, 2) == "default"  # gradients: fp32 copies would be kept for backward
    assert model.float().linear_kernels(False, 8, 2) == "default"
    model.to(torch.bfloat16)

    class Inputs(torch.overrides.TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: list[torch.dtype] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is F.linear:
                self.dtypes.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Inputs() as inputs:
        widened = model(tokens)
    assert set(inputs.dtypes) == {torch.float32}  # every product of the pass: 16 rows each
    monkeypatch.setattr(attn.decoder, "bf16_arithmetic", lambda: True)
    with torch.no_grad():
        stock = model(tokens)
    reference = model.float()(tokens)  # the same (bf16-valued) weights in fp32
    assert widened.dtype == stock.dtype == torch.bfloat16
    widened_error = (widened.float() - reference).abs().mean()
    stock_error = (stock.float() - reference).abs().mean()
    assert widened_error <= 1.5 * stock_error + 1e-3, (widened_error, stock_error)
