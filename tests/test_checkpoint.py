"""attn/checkpoint.py: round trips, and a clear error for each kind of bad checkpoint.

These tests write checkpoints with attn's own ``save_pretrained`` and then break them;
they need ``safetensors`` but not ``transformers`` (tests/test_transformers_oracle.py
checks the same loader against transformers itself).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import attn
from attn.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    InvalidConfigError,
    MissingTensorError,
    TensorDtypeError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedArchitectureError,
    UnsupportedConfigError,
    config_from_hf,
    config_to_hf,
    load_pretrained,
    save_pretrained,
)
from tests.conftest import tiny_model


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def _write(directory: Path, *, config: dict[str, Any] | None = None, tensors: dict[str, torch.Tensor] | None = None):
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _assert_same_model(a: attn.TransformerDecoder, b: attn.TransformerDecoder) -> None:
    assert a.config == b.config
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())  # load_pretrained builds on meta: rebuilt?
    assert ba.keys() == bb.keys()
    for name in ba:
        assert torch.equal(ba[name], bb[name]), name
    tokens = torch.randint(0, a.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(tokens), b(tokens), rtol=0, atol=0)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[attn.TransformerDecoder, Path]:
    """An untied tiny model and its checkpoint directory."""
    model = tiny_model(seed=3)
    return model, save_pretrained(model, tmp_path / "ckpt")


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("tie_embeddings", [False, True], ids=["untied", "tied"])
def test_round_trip_is_exact(tmp_path: Path, tie_embeddings: bool) -> None:
    model = tiny_model(seed=1, tie_embeddings=tie_embeddings, rope_base=500.0, norm_eps=1e-6, head_dim=16)
    directory = save_pretrained(model, tmp_path / "ckpt")
    assert ("lm_head.weight" in _tensors(directory)) is not tie_embeddings
    loaded = load_pretrained(directory)
    _assert_same_model(model, loaded)
    assert not loaded.training and not loaded.caches_are_setup()


def test_sharded_checkpoint_loads(saved: tuple[attn.TransformerDecoder, Path], tmp_path: Path) -> None:
    model, directory = saved
    tensors = _tensors(directory)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((directory / "config.json").read_text())
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, sharded / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard_names, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same_model(model, load_pretrained(sharded))


@pytest.mark.parametrize(
    ("stored", "requested", "expected"),
    [
        (torch.bfloat16, None, torch.bfloat16),  # the checkpoint's own dtype by default
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, "float32", torch.float32),
        (torch.float32, "torch.float16", torch.float16),
    ],
)
def test_dtype(tmp_path: Path, stored: torch.dtype, requested: Any, expected: torch.dtype) -> None:
    model = tiny_model(seed=2)
    directory = save_pretrained(model, tmp_path / "ckpt", dtype=stored)
    assert _config(directory)["dtype"] == str(stored).removeprefix("torch.")
    loaded = load_pretrained(directory, dtype=requested)
    assert {p.dtype for p in loaded.parameters()} == {expected}
    reference = model.to(stored).to(expected)
    for (name, a), b in zip(reference.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), b in zip(reference.named_buffers(), loaded.buffers(), strict=True):
        assert torch.equal(a, b), name  # the RoPE table stays fp32 whatever the parameter dtype


def test_bad_dtype_argument(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported; use one of float32 \(fp32\).*or None"):
        load_pretrained(saved[1], dtype="int8")


def test_old_rotary_buffers_are_skipped(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    model, directory = saved
    tensors = _tensors(directory)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # transformers < 4.3x saved these
    _write(directory, tensors=tensors)
    _assert_same_model(model, load_pretrained(directory))


def test_tied_checkpoint_with_equal_head_loads(tmp_path: Path) -> None:
    model = tiny_model(seed=4, tie_embeddings=True)
    directory = save_pretrained(model, tmp_path / "ckpt")
    tensors = _tensors(directory)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    _write(directory, tensors=tensors)
    _assert_same_model(model, load_pretrained(directory))


# ---------------------------------------------------------------------------- config mapping


def test_config_from_transformers_5_and_4_spellings() -> None:
    common = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=80,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    v5 = {**common, "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}, "dtype": "bfloat16"}
    v4 = {**common, "rope_theta": 250000.0, "rope_scaling": None, "torch_dtype": "bfloat16"}
    expected = attn.DecoderConfig(
        vocab_size=100,
        embed_dim=64,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        hidden_dim=80,
        max_seq_len=512,
        norm_eps=1e-5,
        rope_base=250000.0,
        tie_embeddings=True,
    )
    assert config_from_hf(v5) == expected
    assert config_from_hf(v4) == expected


@st.composite
def decoder_configs(draw: st.DrawFn) -> attn.DecoderConfig:
    num_kv_heads = draw(st.integers(1, 4))
    num_heads = num_kv_heads * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([None, 2, 8, 24]))
    return attn.DecoderConfig(
        vocab_size=draw(st.integers(1, 50_000)),
        embed_dim=num_heads * 2 * draw(st.integers(1, 32)),  # an even head_dim when it is derived
        num_layers=draw(st.integers(1, 40)),
        num_heads=num_heads,
        num_kv_heads=draw(st.sampled_from([None, num_kv_heads])),
        head_dim=head_dim,
        hidden_dim=draw(st.integers(1, 10_000)),
        max_seq_len=draw(st.integers(1, 1 << 20)),
        norm_eps=draw(st.floats(1e-12, 1e-1)),
        rope_base=draw(st.floats(1.0, 1e7)),
        tie_embeddings=draw(st.booleans()),
    )


@given(decoder_configs())
def test_config_survives_config_json(config: attn.DecoderConfig) -> None:
    assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


def test_config_defaults_follow_transformers() -> None:
    minimal = dict(
        model_type="llama",
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=80,
    )
    config = config_from_hf(minimal)
    assert (config.num_kv_heads, config.head_dim, config.max_seq_len) == (4, 16, 2048)
    assert (config.norm_eps, config.rope_base, config.tie_embeddings) == (1e-6, 10000.0, False)


def test_gemma_defaults_follow_transformers() -> None:
    minimal = dict(vocab_size=100, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, intermediate_size=80)
    gemma2 = config_from_hf({"model_type": "gemma2", **minimal})
    assert (gemma2.num_kv_heads, gemma2.head_dim, gemma2.max_seq_len, gemma2.tie_embeddings) == (4, 256, 8192, True)
    assert (gemma2.attn_scale, gemma2.attn_softcap, gemma2.logit_softcap) == (256**-0.5, 50.0, 30.0)
    assert (gemma2.sliding_window, gemma2.window_layers, gemma2.local_rope_base) == (4096, (0, 2, 4, 6, 8, 10), None)
    gemma3 = config_from_hf({"model_type": "gemma3_text", **minimal})
    assert (gemma3.attn_softcap, gemma3.logit_softcap, gemma3.qk_norm) == (None, None, True)
    assert (gemma3.rope_base, gemma3.local_rope_base, gemma3.max_seq_len) == (1e6, 1e4, 131072)
    assert gemma3.window_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # all but every 6th
    legacy = config_from_hf(
        {"model_type": "gemma3_text", **minimal, "rope_local_base_freq": 2e4, "sliding_window_pattern": 3,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )  # fmt: skip
    assert (legacy.local_rope_base, legacy.rope_scaling.factor, legacy.window_layers) == (
        2e4,
        8.0,
        (0, 1, 3, 4, 6, 7, 9, 10),
    )
    unwindowed = config_from_hf({"model_type": "gemma3_text", **minimal, "sliding_window": None})
    assert (unwindowed.sliding_window, unwindowed.local_rope_base) == (131072, 1e4)  # the windowed layers' RoPE kept
    for config in (gemma2, gemma3):
        assert (config.embed_scale, config.unit_offset_norms, config.activation, config.sandwich_norms) == (
            True,
            True,
            "gelu_tanh",
            True,
        )


def test_mistral_without_window_is_llama() -> None:
    base = dict(
        vocab_size=100,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=80,
        max_position_embeddings=256,
        rope_theta=1e6,
    )
    llama = config_from_hf({**base, "model_type": "llama"})
    mistral = {**base, "model_type": "mistral"}
    assert config_from_hf({**mistral, "sliding_window": None}) == llama
    assert config_from_hf({**mistral, "sliding_window": 4096}) == llama  # the window covers every position
    assert config_from_hf({**mistral, "sliding_window": None, "num_key_value_heads": None}) == llama
    # Keys left out take transformers' Mistral defaults, which differ from Llama's:
    assert config_from_hf({**mistral, "max_position_embeddings": 8192}).sliding_window == 4096
    del mistral["num_key_value_heads"]
    assert config_from_hf({**mistral, "sliding_window": None, "num_attention_heads": 16}).num_kv_heads == 8


def test_dequantized_checkpoint_loads_with_a_warning(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    model, directory = saved
    _write(directory, config={**_config(directory), "quantization_config": {"quant_method": "gguf"}})
    with pytest.warns(CheckpointWarning, match=r"quant_method 'gguf'\), but every tensor is stored as a float \(F32\)"):
        _assert_same_model(model, load_pretrained(directory))


def test_quantized_checkpoint_is_refused_naming_its_tensors(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    directory = saved[1]
    tensors = _tensors(directory)
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 8, dtype=torch.int32)  # packed, as GPTQ
    tensors["model.layers.0.self_attn.q_proj.scales"] = torch.ones(1, 32, dtype=torch.float16)
    _write(directory, config={**_config(directory), "quantization_config": {"quant_method": "gptq"}}, tensors=tensors)
    with pytest.raises(
        TensorDtypeError,
        match=r"quant_method 'gptq'\) and the weights are quantized: 1 of \d+ tensors are stored as \['I32'\], "
        r"e.g. \[\"'model.layers.0.self_attn.q_proj.weight'",
    ):
        load_pretrained(directory)


def test_max_seq_len_caps_the_context(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    model, directory = saved
    short = load_pretrained(directory, max_seq_len=16)
    assert short.config.max_seq_len == 16 and short.layers[0].attn.rope.cos_sin.shape[1] == 16
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(short(tokens), model(tokens), rtol=0, atol=0)
    for bad in (0, model.config.max_seq_len + 1, 8.0, True):
        with pytest.raises(ValueError, match=rf"max_seq_len must be an int in \[1, {model.config.max_seq_len}\]"):
            load_pretrained(directory, max_seq_len=bad)


def test_dynamic_rope_runs_as_plain_rope_within_the_original_context(
    saved: tuple[attn.TransformerDecoder, Path],
) -> None:
    model, directory = saved
    rope = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}
    _write(directory, config={**_config(directory), "rope_scaling": rope})
    with pytest.warns(CheckpointWarning, match=r"loads it as plain RoPE with max_seq_len 32 \(not 64\)"):
        loaded = load_pretrained(directory)
    assert loaded.config.max_seq_len == 32 and loaded.config.rope_scaling is None
    tokens = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rope", "max_seq_len", "attention_scale"),
    [
        # Qwen's instructions: rope_scaling added, max_position_embeddings (64) left alone.
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, 128, 0.1 * math.log(4.0) + 1),
        # no original context: max_position_embeddings; no factor: their ratio (here 1)
        ({"rope_type": "yarn", "factor": None}, 64, 1.0),
        # DeepSeek's spelling of the attention factor
        (
            {
                "rope_type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
            },
            64,
            (0.1 * math.log(2.0) + 1) / (0.05 * math.log(2.0) + 1),
        ),
    ],
)
def test_yarn_runs_to_factor_times_its_original_context(
    saved: tuple[attn.TransformerDecoder, Path], rope: dict, max_seq_len: int, attention_scale: float
) -> None:
    _, directory = saved
    _write(directory, config={**_config(directory), "rope_scaling": rope})
    loaded = load_pretrained(directory)
    assert loaded.config.max_seq_len == max_seq_len and loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling.kind == "yarn"
    assert loaded.config.rope_scaling.attention_scale == pytest.approx(attention_scale, rel=1e-12)
    assert load_pretrained(directory, max_seq_len=16).config.max_seq_len == 16


def test_attention_dropout_is_ignored_with_a_warning(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    model, directory = saved
    _write(directory, config={**_config(directory), "attention_dropout": 0.1})
    with pytest.warns(CheckpointWarning, match=r"attention_dropout = 0.1 is ignored"):
        _assert_same_model(model, load_pretrained(directory))


# ---------------------------------------------------------------------------- bad checkpoints


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    def change(config: dict[str, Any]) -> None:
        config.update(values)

    return change


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def change(config: dict[str, Any]) -> None:
        del config[key]

    return change


BAD_CONFIGS = [
    # another architecture
    ("gpt2", _set(model_type="gpt2"), UnsupportedArchitectureError, r"model_type 'gpt2' is not supported: attn loads"),
    ("list model type", _set(model_type=["llama"]), InvalidConfigError, r"'model_type' must be a string .*\['llama'\]"),
    (
        "classifier head",
        _set(architectures=["LlamaForSequenceClassification"]),
        UnsupportedArchitectureError,
        r"architectures \['LlamaForSequenceClassification'\] is not supported",
    ),
    (
        "no model type",
        lambda c: [c.pop("model_type"), c.pop("architectures")],
        InvalidConfigError,
        r"names neither 'model_type' nor 'architectures'",
    ),
    # unsupported options
    (
        "longrope rope",
        _set(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}),
        UnsupportedConfigError,
        r"rope_parameters has rope_type 'longrope', which attn does not implement .* remove the rope scaling",
    ),
    (
        "llama3 rope without its band",
        _set(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
        InvalidConfigError,
        r"rope_parameters \(rope_type 'llama3'\): config.json lacks the required key 'low_freq_factor'",
    ),
    (
        "llama3 rope with an empty band",
        _set(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 16,
            }
        ),
        InvalidConfigError,
        r"rope_scaling: RopeScaling needs 0 < low_freq_factor \(4.0\) < high_freq_factor \(1.0\)",
    ),
    (
        "partial rotary",
        _set(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
        UnsupportedConfigError,
        r"partial_rotary_factor 0.5",
    ),
    (
        "attention bias without bias tensors",
        _set(attention_bias=True),
        MissingTensorError,
        r"lacks 8 tensor\(s\) the config implies, e.g. \['model.layers.0.self_attn.k_proj.bias'",
    ),
    ("mlp bias", _set(mlp_bias=True), UnsupportedConfigError, r"mlp_bias = True is not supported"),
    ("gelu", _set(hidden_act="gelu"), UnsupportedConfigError, r"hidden_act = 'gelu' is not supported: .*SiLU"),
    (
        "qwen2 windowing some layers",
        _set(
            model_type="qwen2",
            architectures=["Qwen2ForCausalLM"],
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
        UnsupportedConfigError,
        r"use_sliding_window = true windows layers 1..1 only \(sliding_window 8, max_window_layers 1\)",
    ),
    ("fp8 dtype", _set(dtype="float8_e4m3fn"), UnsupportedConfigError, r"dtype 'float8_e4m3fn' is not supported"),
    (
        "gemma2 with exact gelu",
        _set(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_activation="gelu"),
        UnsupportedConfigError,
        r"hidden_activation = 'gelu' is not supported: attn's gemma2 MLP is GeGLU with tanh-approximated GELU",
    ),
    (
        "embedding gemma's bidirectional attention",
        _set(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True),
        UnsupportedConfigError,
        r"use_bidirectional_attention = True is not supported: attn's attention is causal",
    ),
    (
        "gemma3 with a scaled local rope",
        _set(
            model_type="gemma3_text",
            architectures=["Gemma3ForCausalLM"],
            rope_theta=None,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            },
        ),
        UnsupportedConfigError,
        r"rope_parameters.sliding_attention = .* runs the windowed layers with plain RoPE",
    ),
    (
        "gemma3 window pattern 0",
        _set(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window_pattern=0),
        InvalidConfigError,
        r"sliding_window_pattern must be a positive int, got 0",
    ),
    (
        "gemma2 layer_types of the wrong length",
        _set(model_type="gemma2", architectures=["Gemma2ForCausalLM"], layer_types=["full_attention"]),
        InvalidConfigError,
        r"layer_types must list 'sliding_attention' or 'full_attention' for each of the 2 layers",
    ),
    # invalid configs
    ("no hidden_size", _drop("hidden_size"), InvalidConfigError, r"lacks the required key 'hidden_size'"),
    ("string heads", _set(num_attention_heads="4"), InvalidConfigError, r"num_attention_heads must be an integer"),
    ("NaN eps", _set(rms_norm_eps=float("nan")), InvalidConfigError, r"rms_norm_eps must be a finite number, got nan"),
    (
        "infinite base",
        _set(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": float("inf")}),
        InvalidConfigError,
        r"rope_theta must be a finite number, got inf",
    ),
    (
        "heads vs kv heads",
        _set(num_key_value_heads=3),
        InvalidConfigError,
        r"invalid model: num_heads \(4\) must be a positive multiple of num_kv_heads \(3\)",
    ),
    (
        "two rope bases",
        _set(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        InvalidConfigError,
        r"two RoPE bases",
    ),
]


@pytest.mark.parametrize(("change", "error", "match"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config(saved: tuple[attn.TransformerDecoder, Path], change, error, match) -> None:
    directory = saved[1]
    config = _config(directory)
    change(config)
    _write(directory, config=config)
    with pytest.raises(error, match=match):
        load_pretrained(directory)
    assert issubclass(error, CheckpointError) and issubclass(error, ValueError)


def _remove(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return change


def _put(name: str, make: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Callable[[dict], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = make(tensors)

    return change


BAD_TENSORS = [
    (
        "missing k_proj",
        _remove("model.layers.1.self_attn.k_proj.weight"),
        MissingTensorError,
        r"lacks 1 tensor\(s\) the config implies, e.g. \['model.layers.1.self_attn.k_proj.weight'\]",
    ),
    ("missing head", _remove("lm_head.weight"), MissingTensorError, r"set tie_word_embeddings to true"),
    (
        "misshapen v_proj",
        _put("model.layers.0.self_attn.v_proj.weight", lambda t: torch.zeros(8, 32)),
        TensorShapeError,
        r"'model.layers.0.self_attn.v_proj.weight' \(in model.safetensors\) has shape \(8, 32\), but config.json "
        r"implies \(16, 32\)",
    ),
    (
        "bias",
        _put("model.layers.0.self_attn.q_proj.bias", lambda t: torch.zeros(32)),
        UnexpectedTensorError,
        r"holds 1 tensor\(s\) .* no place for, e.g. \[\"'model.layers.0.self_attn.q_proj.bias' \(in model",
    ),
    (
        "extra layer",
        _put("model.layers.2.input_layernorm.weight", lambda t: torch.ones(32)),
        UnexpectedTensorError,
        r"model.layers.2.input_layernorm.weight",
    ),
    (
        "int8 weights",
        _put("model.norm.weight", lambda t: torch.ones(32, dtype=torch.int8)),
        TensorDtypeError,
        r"'model.norm.weight' \(in model.safetensors\) is stored as I8, not a float",
    ),
]


@pytest.mark.parametrize(("change", "error", "match"), [c[1:] for c in BAD_TENSORS], ids=[c[0] for c in BAD_TENSORS])
def test_bad_tensors(saved: tuple[attn.TransformerDecoder, Path], change, error, match) -> None:
    directory = saved[1]
    tensors = _tensors(directory)
    change(tensors)
    _write(directory, tensors=tensors)
    with pytest.raises(error, match=match):
        load_pretrained(directory)


def test_missing_tensor_is_also_a_key_error(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    directory = saved[1]
    tensors = _tensors(directory)
    del tensors["model.norm.weight"]
    _write(directory, tensors=tensors)
    with pytest.raises(KeyError) as info:
        load_pretrained(directory)
    assert str(info.value).startswith("checkpoint lacks 1 tensor(s)")  # not quoted like a plain KeyError


def test_tied_head_that_differs_is_refused(tmp_path: Path) -> None:
    directory = save_pretrained(tiny_model(seed=5, tie_embeddings=True), tmp_path / "ckpt")
    tensors = _tensors(directory)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    _write(directory, tensors=tensors)
    with pytest.raises(UnexpectedTensorError, match=r"tie_word_embeddings is true, but 'lm_head.weight'"):
        load_pretrained(directory)


def test_layer_count_mismatch(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    directory = saved[1]
    _write(directory, config={**_config(directory), "num_hidden_layers": 3})
    with pytest.raises(MissingTensorError, match=r"lacks 9 tensor\(s\)"):
        load_pretrained(directory)


# ---------------------------------------------------------------------------- files


def test_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config.json not found: load_pretrained takes a local checkpoint"):
        load_pretrained(tmp_path)


def test_pickle_checkpoint_is_never_loaded(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    directory = saved[1]
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model.bin'\], pickle files attn never loads"):
        load_pretrained(directory)


def _shard(saved: tuple[attn.TransformerDecoder, Path], weight_map: Callable[[list[str]], dict[str, str]]) -> Path:
    directory = saved[1]
    tensors = _tensors(directory)
    (directory / "model.safetensors").unlink()
    save_file(tensors, directory / "model-00001-of-00001.safetensors")
    index = {"weight_map": weight_map(sorted(tensors))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_index_names_a_missing_shard(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    directory = _shard(saved, lambda names: {n: "model-00001-of-00002.safetensors" for n in names})
    with pytest.raises(FileNotFoundError, match=r"lists shard 'model-00001-of-00002.safetensors', which is not in"):
        load_pretrained(directory)


def test_index_names_a_path(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    directory = _shard(saved, lambda names: {n: "../model-00001-of-00001.safetensors" for n in names})
    with pytest.raises(InvalidConfigError, match=r"a shard must be a file name in the checkpoint directory"):
        load_pretrained(directory)


@pytest.mark.parametrize("name", [None, 3, ["model.safetensors"]])
def test_index_names_a_shard_that_is_not_a_string(saved: tuple[attn.TransformerDecoder, Path], name: object) -> None:
    directory = _shard(saved, lambda names: {**{n: "model-00001-of-00001.safetensors" for n in names}, names[0]: name})
    with pytest.raises(InvalidConfigError, match=rf"names shard {re.escape(repr(name))}: a shard must be a file name"):
        load_pretrained(directory)


def test_index_disagrees_with_shards(saved: tuple[attn.TransformerDecoder, Path]) -> None:
    def weight_map(names: list[str]) -> dict[str, str]:
        return {
            **{n: "model-00001-of-00001.safetensors" for n in names},
            "model.extra": "model-00001-of-00001.safetensors",
        }

    directory = _shard(saved, weight_map)
    with pytest.raises(MissingTensorError, match=r"says tensor 'model.extra' is in model-00001-of-00001.safetensors"):
        load_pretrained(directory)


@pytest.mark.parametrize(
    ("key", "value"), [("vocab_size", 10**9), ("intermediate_size", 10**9), ("hidden_size", 2**20)]
)
def test_a_size_that_disagrees_with_the_headers_fails_before_any_allocation(
    saved: tuple[attn.TransformerDecoder, Path], key: str, value: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config size far off the weights (1e9 tokens: terabytes of embedding) is caught by the
    safetensors headers before the model's parameters are allocated."""
    _, directory = saved
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config[key] = value
    config_path.write_text(json.dumps(config))

    def never(*args: object) -> None:
        raise AssertionError("parameters were allocated before the headers were checked")

    monkeypatch.setattr(attn.checkpoint, "_materialize", never)
    with pytest.raises(TensorShapeError, match=r"config\.json does not match the weights"):
        load_pretrained(directory)
