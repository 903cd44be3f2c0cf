"""attn/families.py: every family record reads back what it writes, and the plainest family
that can hold a config is the one chosen."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn.checkpoint import SUPPORTED_ARCHITECTURES, config_from_hf, config_to_hf
from attn.families import FAMILIES, family_for, family_named

GEMMA = dict(embed_scale=True, unit_offset_norms=True, activation="gelu_tanh", sandwich_norms=True, attn_scale=0.125)


def _config(qk_norm: bool, qkv_bias: bool, out_bias: bool, window: int | None, **options: object) -> attn.DecoderConfig:
    return attn.DecoderConfig(
        vocab_size=64, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=48, max_seq_len=128,
        qk_norm=qk_norm, qkv_bias=qkv_bias, out_bias=out_bias, sliding_window=window, **options,
    )  # fmt: skip


@st.composite
def gemma_options(draw: st.DrawFn) -> dict[str, object]:
    """None, some or all of Gemma's options, with its windows, scale and caps."""
    options = {name: value for name, value in GEMMA.items() if draw(st.booleans())}
    if draw(st.booleans()):
        options |= dict(sliding_window=16, window_layers=draw(st.sampled_from([None, (0,), (1,)])))
        if draw(st.booleans()):
            options["local_rope_base"] = 1e4
    for name, value in (("attn_scale", 0.25), ("attn_softcap", 50.0), ("logit_softcap", 30.0)):
        if draw(st.booleans()):
            options[name] = value
    return options


@given(
    qk_norm=st.booleans(),
    qkv_bias=st.booleans(),
    out_bias=st.booleans(),
    window=st.sampled_from([None, 16]),
    options=st.just({}) | gemma_options(),
)
def test_a_config_round_trips_through_its_family_or_is_refused(
    qk_norm: bool, qkv_bias: bool, out_bias: bool, window: int | None, options: dict
) -> None:
    options = {"sliding_window": window} | options  # Gemma's window, where it draws one
    config = _config(qk_norm, qkv_bias, out_bias, options.pop("sliding_window"), **options)
    holders = [family for family in FAMILIES if family.holds(config)]
    if not holders:
        with pytest.raises(ValueError, match="no Hugging Face model family has this combination"):
            family_for(config)
        return
    assert family_for(config) is holders[0]  # the plainest, in FAMILIES' order
    for family in holders:  # every family that says it holds the config reads it back whole
        written = config_to_hf(config) | {"model_type": family.model_type, "architectures": [family.architecture]}
        if family.biases == "shared":
            written["attention_bias"] = qkv_bias
        assert config_from_hf(written) == config, family.model_type


def test_the_plainest_family_wins() -> None:
    assert family_for(_config(False, False, False, None)).model_type == "llama"
    assert family_for(_config(False, True, True, None)).model_type == "llama"
    assert family_for(_config(False, True, False, None)).model_type == "qwen2"
    assert family_for(_config(False, False, False, 16)).model_type == "mistral"
    assert family_for(_config(True, False, False, None)).model_type == "qwen3"
    assert family_for(_config(False, False, False, None, **GEMMA)).model_type == "gemma2"
    gemma3 = dict(GEMMA, window_layers=(0,), local_rope_base=1e4)
    assert family_for(_config(True, False, False, 16, **gemma3)).model_type == "gemma3_text"


def test_supported_architectures_are_the_records() -> None:
    assert {f.model_type: f.architecture for f in FAMILIES} == SUPPORTED_ARCHITECTURES
    assert [family_named(f.model_type) for f in FAMILIES] == list(FAMILIES)
