"""The Hugging Face model families attn loads and saves, one record each.

A family says how its ``config.json`` spells what ``DecoderConfig`` holds: its
``model_type`` and ``architectures`` entry, transformers' defaults for the keys a config may
leave out, how it spells attention biases and sliding windows, whether it normalizes queries
and keys, its tensor names, and the keys ``save_pretrained`` writes for it.
``attn.checkpoint`` only reads and writes through these records: adding a family that needs no
new module option is adding a record here.

SmolLM2 is a Llama (``model_type: llama``); Llama 3.x's RoPE scaling is a RoPE option of any
family (``attn.checkpoint`` reads it from ``rope_scaling`` / ``rope_parameters``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from attn.decoder import DecoderConfig

__all__ = ["FAMILIES", "Family", "family_for", "family_named"]

# attn's per-layer tensor name -> the Llama layout's (every family here uses it).
LLAMA_LAYER_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
QKV_BIASES: Mapping[str, str] = {f"attn.{p}_proj.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
OUT_BIAS: Mapping[str, str] = {"attn.o_proj.bias": "self_attn.o_proj.bias"}
QK_NORMS: Mapping[str, str] = {f"attn.{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"}
TOP_TENSORS: Mapping[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

Biases = Literal["shared", "qkv", "none"]
"""How a family spells attention biases: ``shared``, ``attention_bias`` gives q/k/v and o a
bias together (Llama, Qwen3); ``qkv``, q/k/v always have one and o never (Qwen2); ``none``."""

Window = Literal["every_layer", "opt_in", "none"]
"""How a family spells a sliding window: ``every_layer``, ``sliding_window`` windows every
layer (Mistral); ``opt_in``, only with ``use_sliding_window``, and then the layers from
``max_window_layers`` on (Qwen2, Qwen3: attn refuses a window on some layers only); ``none``."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face family: the data ``attn.checkpoint`` reads and writes it with.

    Attributes:
        model_type: config.json's ``model_type``.
        architecture: the one ``architectures`` entry loadable for it (a causal LM head).
        defaults: transformers' values for keys a config.json may leave out, where they
            differ between families (``num_key_value_heads: None``: as many as the heads).
        biases: how it spells attention biases (``Biases``).
        window: how it spells a sliding window (``Window``).
        qk_norm: queries and keys go through a per-head RMSNorm before RoPE.
        written: keys ``save_pretrained`` adds to config.json for it.
        layer_tensors: attn's per-layer tensor names -> the family's (before biases and norms).
    """

    model_type: str
    architecture: str
    defaults: Mapping[str, Any]
    biases: Biases
    window: Window
    qk_norm: bool = False
    written: Mapping[str, Any] = field(default_factory=dict)
    layer_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_TENSORS)

    def holds(self, config: DecoderConfig) -> bool:
        """Can a checkpoint of this family describe ``config`` exactly?"""
        windowed = config.sliding_window is not None and config.sliding_window < config.max_seq_len
        biases = (config.qkv_bias, config.out_bias)
        spelled = {"shared": {(False, False), (True, True)}, "qkv": {(True, False)}, "none": {(False, False)}}
        return (
            config.qk_norm == self.qk_norm
            and windowed == (self.window == "every_layer")
            and biases in spelled[self.biases]
        )

    def tensor_names(self, config: DecoderConfig) -> dict[str, str]:
        """attn parameter name -> the family's tensor name, for every parameter of ``config``."""
        layer = {
            **self.layer_tensors,
            **(QKV_BIASES if config.qkv_bias else {}),
            **(OUT_BIAS if config.out_bias else {}),
            **(QK_NORMS if config.qk_norm else {}),
        }
        names = {"tok_embeddings.weight": TOP_TENSORS["tok_embeddings.weight"]}
        for i in range(config.num_layers):
            names |= {f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in layer.items()}
        names["norm.weight"] = TOP_TENSORS["norm.weight"]
        if not config.tie_embeddings:
            names["output.weight"] = TOP_TENSORS["output.weight"]
        return names


# fmt: off
FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM",
           defaults={"num_key_value_heads": None, "max_position_embeddings": 2048},
           biases="shared", window="none", written={"mlp_bias": False}),
    Family("mistral", "MistralForCausalLM",
           defaults={"num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
           biases="none", window="every_layer"),
    Family("qwen2", "Qwen2ForCausalLM",
           defaults={"num_key_value_heads": 32, "max_position_embeddings": 32768},
           biases="qkv", window="opt_in", written={"use_sliding_window": False}),
    Family("qwen3", "Qwen3ForCausalLM",
           defaults={"num_key_value_heads": 32, "max_position_embeddings": 32768, "head_dim": 128},
           biases="shared", window="opt_in", qk_norm=True, written={"use_sliding_window": False}),
)
# fmt: on
"""The families, in the order ``family_for`` tries them: the plainest that holds a config wins."""


def family_named(model_type: str) -> Family:
    """The family of ``model_type`` (one of ``FAMILIES``)."""
    return next(family for family in FAMILIES if family.model_type == model_type)


def family_for(config: DecoderConfig) -> Family:
    """The plainest family that holds ``config``: Llama, else Mistral for a window, Qwen2 for
    q/k/v biases alone, Qwen3 for q/k norms.

    Raises:
        ValueError: no family has this combination of features.
    """
    for family in FAMILIES:
        if family.holds(config):
            return family
    raise ValueError(
        f"no Hugging Face model family has this combination: qk_norm={config.qk_norm}, qkv_bias={config.qkv_bias}, "
        f"out_bias={config.out_bias}, sliding_window={config.sliding_window}; save_pretrained writes "
        f"{', '.join(family.model_type for family in FAMILIES)} checkpoints"
    )
