"""The Hugging Face model families attn loads and saves, one record each.

A family says how its ``config.json`` spells what ``DecoderConfig`` holds: its
``model_type`` and ``architectures`` entry, transformers' defaults for the keys a config may
leave out, how it spells attention biases and sliding windows, the module options every
checkpoint of it has (q/k norms; Gemma's scaled embeddings, ``1 + w`` norms, GeGLU and extra
norms), the keys only it reads, its tensor names, and the keys ``save_pretrained`` writes.
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
# Gemma 2 and 3: a norm before and after each half of the block; its MLP's input norm is the
# "pre_feedforward" one, and "post_attention" normalizes the attention's output.
GEMMA_LAYER_TENSORS: Mapping[str, str] = {
    **LLAMA_LAYER_TENSORS,
    "attn_out_norm.weight": "post_attention_layernorm.weight",
    "mlp_norm.weight": "pre_feedforward_layernorm.weight",
    "mlp_out_norm.weight": "post_feedforward_layernorm.weight",
}
GEMMA_OPTIONS: Mapping[str, Any] = {
    "embed_scale": True,
    "unit_offset_norms": True,
    "activation": "gelu_tanh",
    "sandwich_norms": True,
}
FAMILY_OPTIONS: Mapping[str, Any] = {
    name: DecoderConfig.__dataclass_fields__[name].default
    for name in ("qk_norm", "embed_scale", "unit_offset_norms", "activation", "sandwich_norms")
}
"""The ``DecoderConfig`` fields a family fixes (``Family.options``), with their defaults."""
GEMMA_KEYS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
TOP_TENSORS: Mapping[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

Biases = Literal["shared", "qkv", "none"]
"""How a family spells attention biases: ``shared``, ``attention_bias`` gives q/k/v and o a
bias together (Llama, Qwen3); ``qkv``, q/k/v always have one and o never (Qwen2); ``none``."""

Window = Literal["every_layer", "opt_in", "layer_types", "none"]
"""How a family spells a sliding window: ``every_layer``, ``sliding_window`` windows every
layer (Mistral); ``opt_in``, only with ``use_sliding_window``, and then the layers from
``max_window_layers`` on (Qwen2, Qwen3: attn refuses a window on some layers only);
``layer_types``, the layers ``layer_types`` calls ``sliding_attention`` (by default every
layer but each ``window_pattern``-th: Gemma); ``none``."""


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
        options: the ``DecoderConfig`` fields of ``FAMILY_OPTIONS`` that every checkpoint of
            it sets other than to their defaults (Qwen3's q/k norms, Gemma's ``GEMMA_OPTIONS``).
        reads: the keys of ``GEMMA_KEYS`` it reads: score scale and soft-capping (such a
            family holds only a config with an explicit ``attn_scale``: it always spells one).
        window_pattern: ``layer_types`` families: every this-many-th layer has no window
            where config.json lists no ``layer_types`` (``sliding_window_pattern`` overrides it).
        local_rope_base: its windowed layers have a RoPE of their own, unscaled, with this base
            by default (Gemma 3: ``rope_parameters.sliding_attention``, or ``rope_local_base_freq``).
        written: keys ``save_pretrained`` adds to config.json for it.
        layer_tensors: attn's per-layer tensor names -> the family's (before biases and norms).
    """

    model_type: str
    architecture: str
    defaults: Mapping[str, Any]
    biases: Biases
    window: Window
    options: Mapping[str, Any] = field(default_factory=dict)
    reads: tuple[str, ...] = ()
    window_pattern: int | None = None
    local_rope_base: float | None = None
    written: Mapping[str, Any] = field(default_factory=dict)
    layer_tensors: Mapping[str, str] = field(default_factory=lambda: LLAMA_LAYER_TENSORS)

    def holds(self, config: DecoderConfig) -> bool:
        """Can a checkpoint of this family describe ``config`` exactly?"""
        windowed = config.sliding_window is not None and config.sliding_window < config.max_seq_len
        biases = (config.qkv_bias, config.out_bias)
        spelled = {"shared": {(False, False), (True, True)}, "qkv": {(True, False)}, "none": {(False, False)}}
        # layer_types spells any arrangement of windows; the others one window on every layer or none
        window_fits = self.window == "layer_types" or (
            windowed == (self.window == "every_layer") and config.window_layers is None
        )
        scores = (config.attn_scale, config.attn_softcap, config.logit_softcap)
        return (
            all(getattr(config, name) == self.options.get(name, default) for name, default in FAMILY_OPTIONS.items())
            and window_fits
            and (config.local_rope_base is not None) == (self.local_rope_base is not None)
            and (config.attn_scale is not None if self.reads else scores == (None, None, None))
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
           biases="shared", window="opt_in", options={"qk_norm": True}, written={"use_sliding_window": False}),
    Family("gemma2", "Gemma2ForCausalLM",
           defaults={"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
                     "sliding_window": 4096, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                     "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
           biases="shared", window="layer_types", options=GEMMA_OPTIONS, reads=GEMMA_KEYS, window_pattern=2,
           layer_tensors=GEMMA_LAYER_TENSORS),
    Family("gemma3_text", "Gemma3ForCausalLM",
           defaults={"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
                     "sliding_window": 4096, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                     "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0},
           biases="shared", window="layer_types", options={**GEMMA_OPTIONS, "qk_norm": True}, reads=GEMMA_KEYS,
           window_pattern=6, local_rope_base=10_000.0, layer_tensors=GEMMA_LAYER_TENSORS),
)
# fmt: on
"""The families, in the order ``family_for`` tries them: the plainest that holds a config wins."""


def family_named(model_type: str) -> Family:
    """The family of ``model_type`` (one of ``FAMILIES``)."""
    return next(family for family in FAMILIES if family.model_type == model_type)


def family_for(config: DecoderConfig) -> Family:
    """The plainest family that holds ``config``: Llama, else Mistral for a window, Qwen2 for
    q/k/v biases alone, Qwen3 for q/k norms, Gemma 2 or 3 for Gemma's options.

    Raises:
        ValueError: no family has this combination of features.
    """
    for family in FAMILIES:
        if family.holds(config):
            return family
    options = ", ".join(f"{name}={getattr(config, name)!r}" for name in FAMILY_OPTIONS)
    raise ValueError(
        f"no Hugging Face model family has this combination: {options}, qkv_bias={config.qkv_bias}, "
        f"out_bias={config.out_bias}, sliding_window={config.sliding_window}, window_layers={config.window_layers}, "
        f"local_rope_base={config.local_rope_base}, attn_scale={config.attn_scale}, "
        f"attn_softcap={config.attn_softcap}, logit_softcap={config.logit_softcap}; save_pretrained writes "
        f"{', '.join(family.model_type for family in FAMILIES)} checkpoints"
    )
