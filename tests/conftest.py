"""Shared fixtures: tiny models, both cache policies, hypothesis profiles.

Hypothesis profiles: ``default`` (fast, for CI) and ``long`` (more examples); pick one with
``pytest --hypothesis-profile=long`` or ``HYPOTHESIS_PROFILE=long``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

import attn
import attn.native
from attn.policy import CachePolicy


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leaves out tests/test_lm_eval.py (all slow) from a run that deselects the slow tests,
    so the README's command needs no lm-eval install; a run with the slow tests imports it,
    and fails loudly where the lm-eval extra is missing."""
    if collection_path.name == "test_lm_eval.py" and "not slow" in (config.getoption("markexpr") or ""):
        return True
    return None


# The native kernels run on x86 CPUs with AVX-512 (and the bf16 product AVX512-BF16) only. Where the CPU has it
# the tests build it, and a failed build fails them: it is not a reason to skip.
needs_bf16_matvec = pytest.mark.skipif(
    not attn.native._has_avx512_bf16(), reason="attn::bf16_matvec needs a CPU with AVX512-BF16; this one has none"
)
needs_amx = pytest.mark.skipif(
    not attn.native._has_amx(), reason="attn::amx_linear needs a CPU with AMX-BF16; this one has none"
)
needs_avx2 = pytest.mark.skipif(
    not attn.native._has_avx2(), reason="attn::avx2_linear needs a CPU with AVX2; this one has none"
)
needs_native_products = pytest.mark.skipif(
    not attn.native._has_avx2(),
    reason="attn's few-row products and attn::decode_layers need a CPU with AVX2 (AVX512-BF16 for their AVX-512 "
    "build); this one has none",
)
needs_avx512 = pytest.mark.skipif(
    not attn.native._has_avx512(), reason="attn::decode_attention needs a CPU with AVX-512; this one has none"
)


def avx2_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on ``attn.native`` sees a CPU with AVX2 and no AVX-512 (AMD before Zen 4, Intel's
    client cores): the kernels it chooses are the ones such a CPU runs (on this one, which has
    AVX-512 too, they run as they would there)."""
    for probe in ("_has_avx512", "_has_avx512_bf16", "_has_amx"):
        monkeypatch.setattr(attn.native, probe, lambda: False)


class OperatorCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The operators a block calls, by name (``names``), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


# Tiny models: one intra-op thread is faster, and immune to a second core being busy.
# Measured on the 2-core machine with other work running: the lm-eval and transformers
# tests took minutes with two intra-op threads (each tiny matmul waits on a descheduled
# thread) and seconds with one. Set here for module-scoped fixtures too.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Every test starts on one thread, and one that changes it (the benchmark, the demo's
    ``--threads``) cannot leak its setting into the next."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def fresh_dynamo_per_module() -> Iterator[None]:
    """Each test file starts with no compiled code: dynamo keeps at most 8 graphs per code
    object (``TransformerDecoder.forward``) for the whole process, and files that compile it
    in other ways would otherwise use them up for the files after them."""
    torch._dynamo.reset()
    yield


settings.register_profile(
    "default",
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "long",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def examples(count: int) -> int:
    """A test's own example count under the default profile, and the loaded profile's where that
    is more (``long``): a count set on a test would otherwise hold under every profile."""
    return max(count, settings.default.max_examples)


# Gemma's options on a tiny decoder: layer 0 windowed (with its own RoPE base, Gemma 3), layer
# 1 global; caps low enough to bind at tiny_model's weights (Gemma 2).
GEMMA_OPTIONS: dict[str, dict[str, object]] = {
    "gemma2": dict(
        embed_scale=True, unit_offset_norms=True, activation="gelu_tanh", sandwich_norms=True, attn_scale=0.25,
        attn_softcap=5.0, logit_softcap=8.0, sliding_window=3, window_layers=(0,),
    ),
    "gemma3": dict(
        embed_scale=True, unit_offset_norms=True, activation="gelu_tanh", sandwich_norms=True, qk_norm=True,
        attn_scale=0.25, sliding_window=3, window_layers=(0,), local_rope_base=100.0,
    ),
}  # fmt: skip


def tiny_config(**overrides: object) -> attn.DecoderConfig:
    """A decoder small enough for many examples on two CPU cores."""
    fields = dict(vocab_size=61, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=48, max_seq_len=64)
    fields.update(overrides)
    return attn.DecoderConfig(**fields)


def tiny_model(seed: int = 0, **overrides: object) -> attn.TransformerDecoder:
    """A tiny decoder with weights scaled up so its outputs are far from uniform."""
    torch.manual_seed(seed)
    model = attn.TransformerDecoder(tiny_config(**overrides))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    return model.eval()


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Loops over batch, head and query in float64; a query that may attend nothing gets zeros.

    q: (b, h, s, d); k, v: (b, h_kv, L, d); mask: bool, broadcastable to (b, h, s, L).
    """
    b, h, s, d = q.shape
    group = h // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    mask = mask.expand(b, h, s, k.shape[2])
    out = torch.zeros(b, h, s, d, dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            keys, values = k[i, j // group].double(), v[i, j // group].double()  # (L, d)
            for t in range(s):
                allowed = mask[i, j, t]
                if allowed.any():
                    weights = ((keys[allowed] @ q[i, j, t].double()) * scale).softmax(-1)  # (n,)
                    out[i, j, t] = weights @ values[allowed]
    return out


def poison_on_reset(model: attn.TransformerDecoder, past: int) -> None:
    """Makes ``model.reset_caches`` (which generate calls) fill every cache slot from ``past``
    on with NaN: a pass that read one, masked or not, would give NaN (0 x NaN)."""

    def reset_and_poison() -> None:
        type(model).reset_caches(model)
        for cache in model.kv_caches():
            cache.k_cache[:, :, past:] = float("nan")
            cache.v_cache[:, :, past:] = float("nan")

    model.reset_caches = reset_and_poison  # type: ignore[method-assign]


def cache_state(model: attn.TransformerDecoder) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A copy of every cache buffer, to check a pass left them bit-for-bit unchanged."""
    return [(c.k_cache.clone(), c.v_cache.clone(), c.cache_pos.clone()) for c in model.kv_caches()]


def assert_cache_unchanged(model: attn.TransformerDecoder, before: list) -> None:
    after = cache_state(model)
    assert len(after) == len(before)
    for (k0, v0, p0), (k1, v1, p1) in zip(before, after, strict=True):
        assert torch.equal(p0, p1), f"fill position changed: {int(p0)} -> {int(p1)}"
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "cache contents changed"
        assert not k1.requires_grad and k1.grad_fn is None, "cache holds autograd history"


@pytest.fixture
def restore_policy() -> Iterator[None]:
    """Puts the process's cache policy and once-per-process warnings back after a test."""
    before = attn.policy._decision
    yield
    attn.policy._decision = before
    attn.policy._reset_warnings()


@pytest.fixture(params=[CachePolicy.INFERENCE, CachePolicy.FLAG], ids=["inference", "flag"])
def policy(request: pytest.FixtureRequest, restore_policy: None) -> CachePolicy:
    """Runs a test under each cache policy, forced through the override."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)
        attn.policy.set_cache_policy(request.param)
    return request.param


# A small chat format for the tokenizer files below: BOS once, one marker per role.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ("<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
TOKENIZER_CORPUS = (
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Caf\u00e9 au lait, \u65e5\u672c \U0001f642",
)


def write_tokenizer_files(
    directory: str | os.PathLike[str], *, chat_template: Any = CHAT_TEMPLATE, **config: Any
) -> Any:
    """Writes a tiny byte-level BPE ``tokenizer.json`` (320 ids; its post-processor adds
    ``<s>``, as Llama 3's does) and a ``tokenizer_config.json`` into ``directory``, and
    returns the ``tokenizers.Tokenizer``. ``config`` entries go into tokenizer_config.json;
    ``chat_template=None`` leaves the template out. Needs the ``tokenizers`` package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(TOKENIZER_CORPUS) * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    fields = {"bos_token": "<s>", "eos_token": "</s>", **config}
    if chat_template is not None:
        fields["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(fields, indent=2))
    return tokenizer


class HostSyncCounter:
    """Counts host reads of tensor values by wrapping the Tensor methods that make them."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor: torch.Tensor, *args: object, _original=original, **kwargs: object) -> object:
                self.count += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
