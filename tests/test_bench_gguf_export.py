"""attn/bench/gguf_export.py: the GGUF file llama.cpp reads, checked with gguf's own reader.

Shapes: b = batch, h = heads, s = sequence, d = head dim.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

import attn
from attn.bench.gguf_export import export_gguf, interleave_rope_rows, rope_frequency_factors, unsupported
from attn.bench.measure import init_weights
from attn.rope import RopeScaling, RotaryEmbedding, inverse_frequencies

TINY = dict(vocab_size=97, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=48, max_seq_len=64)
LLAMA3 = RopeScaling("llama3", factor=8.0, original_max_seq_len=64)
YARN = RopeScaling("yarn", factor=4.0, original_max_seq_len=16)


def tiny_model(dtype: torch.dtype = torch.float32, **fields: object) -> attn.TransformerDecoder:
    model = attn.TransformerDecoder(attn.DecoderConfig(**{**TINY, **fields})).eval()  # type: ignore[arg-type]
    init_weights(model, 0.05, seed=0)
    with torch.no_grad():  # norms and biases away from their defaults, so a mix-up shows
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.to(dtype)


def uninterleave(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The inverse of ``interleave_rope_rows``, written out: rows (h, d/2, 2) back to (h, 2, d/2)."""
    rows = weight.shape[0]
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])  # (h, d/2, 2, ...)
    return pairs.transpose(1, 2).reshape(weight.shape)


def read_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], torch.Tensor]]:
    """name -> (GGML type, GGUF shape (innermost first), tensor in numpy's (outer, inner) order)."""
    out = {}
    for tensor in gguf.GGUFReader(path).tensors:
        kind = tensor.tensor_type.name
        data = torch.from_numpy(tensor.data.copy())
        if kind == "BF16":  # stored as bytes: two per value
            data = data.view(torch.int16).view(torch.bfloat16)
        out[tensor.name] = (kind, tuple(int(n) for n in tensor.shape), data)
    return out


def read_fields(path: Path) -> dict[str, object]:
    return {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()}


def interleaved_rope(x: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """llama.cpp's "normal" RoPE, written out: channels (2i, 2i + 1) turn by ``position * inv_freq[i]``."""
    angles = positions[:, None].float() * inv_freq  # (s, d/2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]  # each (b, h, s, d/2)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)  # (b, h, s, d)


@pytest.mark.parametrize("head_dim", [4, 8, 64])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_interleaved_channels_under_llamas_rope_equal_attns_rope(head_dim: int, scaling: RopeScaling | None) -> None:
    """Rotating the reordered channels the llama.cpp way gives attn's rotation, reordered."""
    seq = 40
    x = torch.randn(2, 3, seq, head_dim, generator=torch.Generator().manual_seed(head_dim))  # (b, h, s, d)
    positions = torch.arange(seq)
    order = interleave_rope_rows(torch.arange(head_dim), 1)  # one head's rows, as channel indices
    ours = RotaryEmbedding(head_dim, seq, base=500.0, scaling=scaling)(x, positions)  # (b, h, s, d)
    theirs = interleaved_rope(x[..., order], inverse_frequencies(head_dim, 500.0, scaling), positions)
    torch.testing.assert_close(theirs, ours[..., order], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(interleaved_rope(x, inverse_frequencies(head_dim, 500.0, scaling), positions), ours)


def test_interleave_rope_rows_moves_row_i_to_2i_and_i_plus_half_to_2i_plus_1() -> None:
    rows = torch.arange(2 * 6).float()  # 2 heads of d = 6
    assert interleave_rope_rows(rows, 2).tolist() == [0, 3, 1, 4, 2, 5, 6, 9, 7, 10, 8, 11]
    weight = torch.randn(4 * 8, 5)  # (h * d, e)
    torch.testing.assert_close(uninterleave(interleave_rope_rows(weight, 4), 4), weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="6 rows do not split into 2 heads of an even size"):
        interleave_rope_rows(torch.zeros(6), 2)


@pytest.mark.parametrize(
    ("dtype", "fields"),
    [
        (torch.float32, {}),
        (torch.bfloat16, {"tie_embeddings": True, "qkv_bias": True, "out_bias": True}),
        (torch.float32, {"head_dim": 16, "qkv_bias": True, "rope_scaling": LLAMA3, "rope_base": 100_000.0}),
    ],
    ids=["fp32", "bf16-tied-biases", "fp32-head-dim-llama3"],
)
def test_export_writes_every_weight_and_the_config(tmp_path: Path, dtype: torch.dtype, fields: dict) -> None:
    model = tiny_model(dtype, **fields)
    config = model.config
    path = export_gguf(model, tmp_path / "model.gguf")
    meta = read_fields(path)
    assert meta["general.architecture"] == "llama"
    expected_meta = {
        "llama.vocab_size": config.vocab_size,
        "llama.context_length": config.max_seq_len,
        "llama.embedding_length": config.embed_dim,
        "llama.block_count": config.num_layers,
        "llama.feed_forward_length": config.hidden_dim,
        "llama.attention.head_count": config.num_heads,
        "llama.attention.head_count_kv": config.num_kv_heads,
        "llama.attention.key_length": config.head_dim,
        "llama.attention.value_length": config.head_dim,
        "llama.rope.dimension_count": config.head_dim,
    }
    assert {key: meta[key] for key in expected_meta} == expected_meta
    assert meta["llama.rope.freq_base"] == pytest.approx(config.rope_base)
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config.norm_eps)
    assert "llama.rope.scaling.attn_factor" not in meta  # no YaRN here

    tensors = read_tensors(path)
    matrix_type = {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype]
    state = model.state_dict()
    e, d = config.embed_dim, config.head_dim
    expected = {"token_embd.weight": (state["tok_embeddings.weight"], (e, config.vocab_size))}
    expected["output_norm.weight"] = (state["norm.weight"], (e,))
    if not config.tie_embeddings:
        expected["output.weight"] = (state["output.weight"], (e, config.vocab_size))
    for i in range(config.num_layers):
        ours = f"layers.{i}."
        layer = {
            "attn_norm.weight": ("attn_norm.weight", (e,)),
            "attn_q.weight": ("attn.q_proj.weight", (e, config.num_heads * d)),
            "attn_k.weight": ("attn.k_proj.weight", (e, config.num_kv_heads * d)),
            "attn_v.weight": ("attn.v_proj.weight", (e, config.num_kv_heads * d)),
            "attn_output.weight": ("attn.o_proj.weight", (config.num_heads * d, e)),
            "ffn_norm.weight": ("mlp_norm.weight", (e,)),
            "ffn_gate.weight": ("mlp.gate_proj.weight", (e, config.hidden_dim)),
            "ffn_up.weight": ("mlp.up_proj.weight", (e, config.hidden_dim)),
            "ffn_down.weight": ("mlp.down_proj.weight", (config.hidden_dim, e)),
        }
        if config.qkv_bias:
            layer["attn_q.bias"] = ("attn.q_proj.bias", (config.num_heads * d,))
            layer["attn_k.bias"] = ("attn.k_proj.bias", (config.num_kv_heads * d,))
            layer["attn_v.bias"] = ("attn.v_proj.bias", (config.num_kv_heads * d,))
        if config.out_bias:
            layer["attn_output.bias"] = ("attn.o_proj.bias", (e,))
        for theirs, (name, shape) in layer.items():
            expected[f"blk.{i}.{theirs}"] = (state[ours + name], shape)
    if config.rope_scaling is not None:
        expected["rope_freqs.weight"] = (rope_frequency_factors(config), (d // 2,))
    assert set(tensors) == set(expected)

    for name, (want, shape) in expected.items():
        kind, got_shape, got = tensors[name]
        assert got_shape == shape, name
        assert kind == (matrix_type if want.dim() == 2 else "F32"), name
        if name.split(".")[-2] in ("attn_q", "attn_k"):  # the RoPE reordering, undone
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            got = uninterleave(got, heads)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=0, msg=name)


def test_rope_scaling_becomes_frequency_factors_and_yarns_attention_factor(tmp_path: Path) -> None:
    linear = attn.DecoderConfig(**TINY, rope_scaling=RopeScaling("linear", factor=4.0))
    torch.testing.assert_close(rope_frequency_factors(linear), torch.full((4,), 4.0))
    assert rope_frequency_factors(attn.DecoderConfig(**TINY)) is None
    llama3 = rope_frequency_factors(attn.DecoderConfig(**TINY, head_dim=32, rope_scaling=LLAMA3))
    assert llama3[0] == 1.0 and llama3[-1] == pytest.approx(8.0)  # fast pairs kept, slow ones stretched

    path = export_gguf(tiny_model(rope_scaling=YARN), tmp_path / "yarn.gguf")
    assert read_fields(path)["llama.rope.scaling.attn_factor"] == pytest.approx(YARN.attention_scale)
    _, _, factors = read_tensors(path)["rope_freqs.weight"]
    plain = inverse_frequencies(8, 10_000.0)
    torch.testing.assert_close(plain / factors, inverse_frequencies(8, 10_000.0, YARN))


def test_dummy_vocab_has_vocab_size_tokens(tmp_path: Path) -> None:
    meta = read_fields(export_gguf(tiny_model(), tmp_path / "model.gguf"))
    tokens = meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.model"] == "llama" and len(tokens) == TINY["vocab_size"]
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "t3"] and len(set(tokens)) == len(tokens)
    assert len(meta["tokenizer.ggml.token_type"]) == len(meta["tokenizer.ggml.scores"]) == TINY["vocab_size"]
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (1, 2)


@pytest.mark.parametrize(
    ("fields", "dtype", "message"),
    [
        ({"qk_norm": True}, torch.float32, r"q/k norms \(qk_norm, Qwen3\)"),
        ({"sliding_window": 16}, torch.float32, r"a sliding window \(16\)"),
        ({}, torch.float64, r"writes float32, bfloat16, float16 weights, not float64"),
        (
            {"embed_scale": True, "activation": "gelu_tanh"},
            torch.float32,
            r"Gemma's options \(\{'embed_scale': True, 'activation': 'gelu_tanh'\}\)",
        ),
        ({"logit_softcap": 30.0}, torch.float32, r"Gemma's options \(\{'logit_softcap': 30.0\}\)"),
    ],
)
def test_unrepresentable_models_are_refused_by_name(
    tmp_path: Path, fields: dict, dtype: torch.dtype, message: str
) -> None:
    model = tiny_model(dtype, **fields)
    assert unsupported(model.config, dtype) is not None
    with pytest.raises(ValueError, match="cannot export this model to GGUF: .*" + message):
        export_gguf(model, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()  # checked before anything is written
