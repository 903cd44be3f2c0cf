"""Writes an ``attn`` ``TransformerDecoder`` as a GGUF file that llama.cpp runs as a ``llama`` model.

Shapes: h = query heads, h_kv = kv heads, d = head dim, e = embed dim, f = MLP hidden dim,
v = vocab size.

Two layouts differ between ``attn`` and llama.cpp's ``llama`` architecture:

- RoPE pairs. ``attn`` (like transformers' Llama) rotates channel ``i`` of a head with channel
  ``i + d/2`` ("rotate half"); llama.cpp's ``llama`` architecture uses its "normal" RoPE, which
  rotates channels ``2i`` and ``2i + 1``. The two give the same attention once the output rows of
  the q and k projections (and their biases) are reordered within each head, so that row
  ``i`` goes to ``2i`` and row ``i + d/2`` to ``2i + 1`` (``interleave_rope_rows``). Queries
  and keys move together, so every dot product q.k is unchanged; v and the output
  projection keep their layout. llama.cpp's own converter does the same reordering for
  Hugging Face Llama checkpoints.
- RoPE scaling. Every ``RopeScaling`` kind of ``attn`` changes each pair's frequency by a
  fixed factor, which GGUF stores as the ``rope_freqs`` tensor (llama.cpp divides pair
  ``i``'s frequency by entry ``i``); YaRN's scale of cos and sin is the
  ``rope.scaling.attn_factor`` key.

Matrices are written in the model's dtype (F32, BF16 or F16); norms, biases and
``rope_freqs`` in F32, as llama.cpp expects them. The vocabulary is a dummy one of
``vocab_size`` tokens (``<unk>``, ``<s>``, ``</s>``, then ``t3``, ``t4``, ...): the benchmark
feeds token ids, never text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attn.decoder import DecoderConfig, TransformerDecoder
from attn.rope import inverse_frequencies

__all__ = [
    "ARCHITECTURE",
    "GGML_TYPES",
    "export_gguf",
    "gguf_tensors",
    "interleave_rope_rows",
    "rope_frequency_factors",
    "unsupported",
]

ARCHITECTURE = "llama"
"""The llama.cpp architecture the file declares."""

GGML_TYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
# DecoderConfig's Gemma options, each at the value the llama architecture has.
GEMMA_FIELDS = {
    name: DecoderConfig.__dataclass_fields__[name].default
    for name in (
        "embed_scale", "unit_offset_norms", "activation", "sandwich_norms", "attn_scale", "attn_softcap",
        "logit_softcap", "window_layers", "local_rope_base",
    )
}  # fmt: skip
"""Model dtype -> the GGML type (``gguf.GGMLQuantizationType`` name) its matrices are written in."""

_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: llama.cpp's defaults for a SentencePiece vocab


def unsupported(config: DecoderConfig, dtype: torch.dtype) -> str | None:
    """Why ``config`` in ``dtype`` cannot be written as a llama.cpp ``llama`` model, or ``None``."""
    if config.qk_norm:
        return "the config has q/k norms (qk_norm, Qwen3), which llama.cpp's llama architecture does not have"
    gemma = {name: getattr(config, name) for name, plain in GEMMA_FIELDS.items() if getattr(config, name) != plain}
    if gemma:
        return f"the config has Gemma's options ({gemma}), which llama.cpp's llama architecture does not have"
    if config.sliding_window is not None:
        return (
            f"the config has a sliding window ({config.sliding_window}), which llama.cpp's llama "
            "architecture does not apply"
        )
    if dtype not in GGML_TYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in GGML_TYPES)
        return f"GGUF export writes {names} weights, not {str(dtype).removeprefix('torch.')}"
    return None


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorders the output rows of a q or k projection from ``attn``'s RoPE layout to llama.cpp's.

    Within each head, row ``i`` (``i < d/2``) goes to ``2i`` and row ``i + d/2`` to ``2i + 1``.

    Args:
        weight: (h * d, e) a projection weight, or (h * d,) its bias.
        num_heads: heads the rows belong to (h for q, h_kv for k).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of an even size")
    halves = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])  # (h, 2, d/2, ...)
    return halves.transpose(1, 2).reshape(weight.shape)  # (h * d, ...), each head as (d/2, 2)


def rope_frequency_factors(config: DecoderConfig) -> torch.Tensor | None:
    """(d/2,) what each RoPE pair's frequency is divided by under ``config.rope_scaling``, or None."""
    if config.rope_scaling is None:
        return None
    plain = inverse_frequencies(config.head_dim, config.rope_base)  # (d/2,)
    scaled = inverse_frequencies(config.head_dim, config.rope_base, config.rope_scaling)  # (d/2,)
    return plain / scaled


def export_gguf(model: TransformerDecoder, path: str | Path) -> Path:
    """Writes ``model``'s weights and config to ``path`` as a GGUF file of llama.cpp's ``llama`` architecture.

    The weights are written in the model's dtype: float32 -> F32, bfloat16 -> BF16,
    float16 -> F16.

    Example::

        export_gguf(model, "model.gguf")
        llm = llama_cpp.Llama(model_path="model.gguf", n_ctx=256)

    Raises:
        ValueError: the model has a feature the ``llama`` architecture cannot represent
            (``unsupported`` says which).
        ImportError: the ``gguf`` package is not installed.
    """
    import gguf

    config = model.config
    dtype = model.tok_embeddings.weight.dtype
    problem = unsupported(config, dtype)
    if problem is not None:
        raise ValueError(f"cannot export this model to GGUF: {problem}")
    path = Path(path)
    writer = gguf.GGUFWriter(path, ARCHITECTURE)
    _write_config(writer, config, dtype)
    _write_vocab(writer, config.vocab_size)
    for name, tensor in gguf_tensors(model).items():
        if tensor.dim() == 1:  # norms, biases, rope_freqs: F32 whatever the model's dtype
            writer.add_tensor(name, tensor.float().numpy())
        else:
            _add_matrix(writer, name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(model: TransformerDecoder) -> dict[str, torch.Tensor]:
    """GGUF tensor name -> tensor, in the layout llama.cpp's ``llama`` architecture reads (detached, on CPU)."""
    config = model.config
    state = {name: t.detach().cpu() for name, t in model.state_dict().items()}
    tensors = {"token_embd.weight": state["tok_embeddings.weight"]}  # (v, e)
    per_layer = {
        "attn_norm.weight": "attn_norm.weight",
        "attn_q.weight": "attn.q_proj.weight",
        "attn_k.weight": "attn.k_proj.weight",
        "attn_v.weight": "attn.v_proj.weight",
        "attn_output.weight": "attn.o_proj.weight",
        "ffn_norm.weight": "mlp_norm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    if config.qkv_bias:
        per_layer |= {"attn_q.bias": "attn.q_proj.bias", "attn_k.bias": "attn.k_proj.bias"}
        per_layer["attn_v.bias"] = "attn.v_proj.bias"
    if config.out_bias:
        per_layer["attn_output.bias"] = "attn.o_proj.bias"
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    for i in range(config.num_layers):
        for theirs, ours in per_layer.items():
            tensor = state[f"layers.{i}.{ours}"]
            kind = theirs.split(".")[0]
            if kind in heads:
                tensor = interleave_rope_rows(tensor, heads[kind])  # (h * d, e) or (h * d,)
            tensors[f"blk.{i}.{theirs}"] = tensor
    tensors["output_norm.weight"] = state["norm.weight"]
    if not config.tie_embeddings:
        tensors["output.weight"] = state["output.weight"]  # tied: llama.cpp reuses token_embd
    factors = rope_frequency_factors(config)
    if factors is not None:
        tensors["rope_freqs.weight"] = factors  # (d/2,)
    return tensors


def _write_config(writer: Any, config: DecoderConfig, dtype: torch.dtype) -> None:
    import gguf

    kind = GGML_TYPES[dtype]
    writer.add_name("attn TransformerDecoder")
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if kind == "F32" else f"MOSTLY_{kind}"))
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.embed_dim)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.hidden_dim)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_base)
    if config.rope_scaling is not None and config.rope_scaling.attention_scale != 1.0:
        writer.add_rope_scaling_attn_factors(config.rope_scaling.attention_scale)
    writer.add_layer_norm_rms_eps(config.norm_eps)


def _write_vocab(writer: Any, vocab_size: int) -> None:
    import gguf

    special = _SPECIAL_TOKENS[:vocab_size]
    writer.add_tokenizer_model("llama")
    writer.add_token_list([*special, *(f"t{i}" for i in range(len(special), vocab_size))])
    writer.add_token_scores([0.0] * vocab_size)
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL][: len(special)]
    writer.add_token_types([*kinds, *[gguf.TokenType.NORMAL] * (vocab_size - len(special))])
    for token_id, add in enumerate((writer.add_unk_token_id, writer.add_bos_token_id, writer.add_eos_token_id)):
        if token_id < vocab_size:
            add(token_id)
    writer.add_add_bos_token(False)  # the benchmark's prompts are ids, with no BOS of their own


def _add_matrix(writer: Any, name: str, tensor: torch.Tensor) -> None:
    import gguf

    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: write its bits, typed as BF16
        writer.add_tensor(name, tensor.view(torch.int16).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, tensor.numpy())
