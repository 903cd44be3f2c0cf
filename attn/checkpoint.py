"""Checkpoints: load and save Hugging Face Llama-family checkpoint directories.

A checkpoint directory holds ``config.json`` and the weights in safetensors files: either
one ``model.safetensors``, or shards listed by ``model.safetensors.index.json``. Loading
reads tensors with ``safetensors`` only: it never unpickles anything and never imports
``transformers``.

Supported (``SUPPORTED_ARCHITECTURES``), each a switch of the one decoder's config, each a
record in ``attn.families`` (its defaults, spellings and tensor names); this module only reads
and writes through them:

=========  ====================  =====================================================
model_type architecture          what differs from Llama
=========  ====================  =====================================================
llama      LlamaForCausalLM      (``attention_bias``: q/k/v/o biases)
mistral    MistralForCausalLM    ``sliding_window`` over slots
qwen2      Qwen2ForCausalLM      q/k/v biases (Qwen2, Qwen2.5)
qwen3      Qwen3ForCausalLM      per-head q/k RMSNorm, explicit ``head_dim``
gemma2     Gemma2ForCausalLM     scaled embeddings, ``1 + w`` norms, GeGLU, norms after
                                 attention and MLP, ``query_pre_attn_scalar``, soft-capped
                                 scores and logits, a window on every other layer
gemma3_text Gemma3ForCausalLM    Gemma 2's, with q/k norms, no soft-capping, a window on
                                 5 layers in 6 and their own RoPE base
=========  ====================  =====================================================

RoPE: plain, ``linear``, ``llama3`` (Llama 3.1-3.3) and ``yarn`` scaling (Qwen2.5/Qwen3's long
context: ``max_seq_len`` becomes at least ``factor`` times the original context); ``dynamic``
runs as plain RoPE within the original context, to which it then caps ``max_seq_len``.
Refused, with an error naming the option: ``longrope`` and other RoPE types, partial rotary, MLP biases,
activations other than the family's (SiLU; Gemma's tanh GELU), per-layer sliding windows
(Qwen's ``use_sliding_window``), Gemma 3's bidirectional attention, quantized tensors.

Tensor names, Hugging Face -> attn (i = layer index; optional ones in brackets)::

    model.embed_tokens.weight                       tok_embeddings.weight
    model.layers.i.input_layernorm.weight           layers.i.attn_norm.weight
    model.layers.i.self_attn.{q,k,v,o}_proj.weight  layers.i.attn.{q,k,v,o}_proj.weight
    [model.layers.i.self_attn.{q,k,v,o}_proj.bias]  layers.i.attn.{q,k,v,o}_proj.bias
    [model.layers.i.self_attn.{q,k}_norm.weight]    layers.i.attn.{q,k}_norm.weight
    model.layers.i.post_attention_layernorm.weight  layers.i.mlp_norm.weight
    model.layers.i.mlp.{gate,up,down}_proj.weight   layers.i.mlp.{gate,up,down}_proj.weight
    model.norm.weight                               norm.weight
    lm_head.weight                                  output.weight (absent when tied)

Gemma 2 and 3 name the block's norms otherwise (``attn.families.GEMMA_LAYER_TENSORS``)::

    model.layers.i.post_attention_layernorm.weight    layers.i.attn_out_norm.weight
    model.layers.i.pre_feedforward_layernorm.weight   layers.i.mlp_norm.weight
    model.layers.i.post_feedforward_layernorm.weight  layers.i.mlp_out_norm.weight

Both layouts store linear weights as (out_features, in_features) and use rotate-half RoPE,
so every tensor is copied as it is: no permutation.

Example::

    model = attn.load_pretrained("/models/Qwen2.5-0.5B", dtype=torch.bfloat16)
    attn.checkpoint.save_pretrained(model, "/tmp/copy")  # loadable by attn and by transformers
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from attn.checks import is_int, is_number
from attn.decoder import DecoderConfig, TransformerDecoder, decoder_of
from attn.dtypes import dtype_from_name, long_name
from attn.errors import first_line
from attn.families import FAMILIES, TOP_TENSORS, Family, family_for, family_named
from attn.huge_pages import place_in_huge_pages
from attn.rope import RopeScaling

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SUPPORTED_ARCHITECTURES",
    "WEIGHTS_FILE",
    "CheckpointError",
    "CheckpointWarning",
    "CorruptFileError",
    "InvalidConfigError",
    "MissingTensorError",
    "TensorDtypeError",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnsupportedArchitectureError",
    "UnsupportedConfigError",
    "config_from_hf",
    "config_to_hf",
    "hf_tensor_names",
    "load_pretrained",
    "save_pretrained",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

SUPPORTED_ARCHITECTURES: Mapping[str, str] = {family.model_type: family.architecture for family in FAMILIES}
"""model_type -> the one ``architectures`` entry loadable for it (``attn.families``)."""

# Buffers that old transformers releases saved; they are derived from the config (as
# transformers itself does on load), so they are skipped, not reported as unexpected.
_DERIVED_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
_ROPE_THETA_DEFAULT = 10000.0  # transformers' default when a config names none
# DecoderConfig.activation -> how config.json may spell it ("silu" and "swish": one function)
_ACTIVATION_SPELLINGS: Mapping[str, tuple[str, ...]] = {"silu": ("silu", "swish"), "gelu_tanh": ("gelu_pytorch_tanh",)}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as it is; the base of the errors below."""


class UnsupportedArchitectureError(CheckpointError):
    """The checkpoint is a model family or head that attn does not implement."""


class UnsupportedConfigError(CheckpointError):
    """config.json asks for an option attn does not implement (rope scaling, biases, ...)."""


class CorruptFileError(CheckpointError):
    """A checkpoint file that cannot be read: JSON that does not parse, a truncated shard."""


class InvalidConfigError(CheckpointError):
    """config.json lacks a required key, or holds a value of the wrong kind."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the model needs is not in the checkpoint's safetensors files."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds tensors the model has no place for (another architecture?)."""


class TensorShapeError(CheckpointError):
    """A tensor's shape differs from the one config.json implies."""


class TensorDtypeError(CheckpointError):
    """A tensor is stored in a dtype that is not a float (quantized weights, say)."""


class CheckpointWarning(UserWarning):
    """Warns about a checkpoint option that attn ignores because it cannot change outputs."""


# ---------------------------------------------------------------------------- config


def config_from_hf(hf_config: Mapping[str, Any]) -> DecoderConfig:
    """Translate a Hugging Face Llama-family ``config.json`` dict to a ``DecoderConfig``.

    Handles both RoPE spellings: ``rope_theta`` / ``rope_scaling`` at the top level
    (transformers 4) and the ``rope_parameters`` dict (transformers 5).

    Args:
        hf_config: the parsed ``config.json``.

    Returns:
        The equivalent ``DecoderConfig``.

    Raises:
        UnsupportedArchitectureError: ``model_type`` / ``architectures`` is not one of
            ``SUPPORTED_ARCHITECTURES``.
        UnsupportedConfigError: an option attn does not implement (longrope RoPE, MLP biases,
            an activation other than SiLU, per-layer sliding windows).
        InvalidConfigError: a required key is missing or has the wrong type.

    Example::

        cfg = attn.checkpoint.config_from_hf(json.loads(Path("ckpt/config.json").read_text()))
    """
    family = family_named(_check_architecture(hf_config))
    hf_config, local_rope_base = _layer_type_ropes(hf_config, family)
    hf_config = {**family.defaults, **hf_config}  # keys left out, not explicit nulls
    _check_options(hf_config, family)
    hidden_size = _get_int(hf_config, "hidden_size")
    num_heads = _get_int(hf_config, "num_attention_heads")
    num_kv_heads = _get_int(hf_config, "num_key_value_heads", default=num_heads)
    head_dim = _get_int(hf_config, "head_dim", default=None)
    max_seq_len = _get_int(hf_config, "max_position_embeddings")
    rope_base, rope_scaling, rope_context = _rope(hf_config, max_seq_len)
    qkv_bias, out_bias = _attention_biases(hf_config, family)
    sliding_window, window_layers = _sliding_window(hf_config, family, max_seq_len)
    scores = _scores(hf_config, family)
    try:
        return DecoderConfig(
            vocab_size=_get_int(hf_config, "vocab_size"),
            embed_dim=hidden_size,
            num_layers=_get_int(hf_config, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_dim=_get_int(hf_config, "intermediate_size"),
            max_seq_len=rope_context,
            norm_eps=_get_float(hf_config, "rms_norm_eps", default=1e-6),
            rope_base=rope_base,
            rope_scaling=rope_scaling,
            tie_embeddings=_get_bool(hf_config, "tie_word_embeddings", default=False),
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            sliding_window=sliding_window,
            window_layers=window_layers,
            local_rope_base=local_rope_base if sliding_window is not None else None,  # no windowed layer
            **scores,
            **family.options,
        )
    except ValueError as err:  # DecoderConfig's own validation, e.g. heads vs kv heads
        raise InvalidConfigError(f"config.json describes an invalid model: {err}") from err


def config_to_hf(config: DecoderConfig, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict of the Hugging Face model equivalent to ``config``.

    The family is the plainest that has every feature ``config`` uses: Qwen3 for q/k norms,
    Qwen2 for q/k/v biases without an output bias, Mistral for a sliding window, else
    Llama. Writes both RoPE spellings (``rope_theta`` / ``rope_scaling`` and
    ``rope_parameters``) so that transformers 4 and 5 read the same model.

    Raises:
        ValueError: no Hugging Face family has this combination of features.
    """
    family = family_for(config)
    rope = {"rope_type": "default"}
    if config.rope_scaling is not None:
        rope = {"rope_type": config.rope_scaling.kind, "factor": config.rope_scaling.factor}
        if config.rope_scaling.kind == "llama3":
            rope |= {
                "low_freq_factor": config.rope_scaling.low_freq_factor,
                "high_freq_factor": config.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": config.rope_scaling.original_max_seq_len,
            }
        if config.rope_scaling.kind == "yarn":  # the keys that differ from transformers' defaults
            yarn = config.rope_scaling
            rope["original_max_position_embeddings"] = yarn.original_max_seq_len
            optional = {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "truncate": True}
            rope |= {key: getattr(yarn, key) for key, default in optional.items() if getattr(yarn, key) != default}
    hf_config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.hidden_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_base,
        "rope_scaling": None if config.rope_scaling is None else rope,
        "rope_parameters": {**rope, "rope_theta": config.rope_base},
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "dtype": long_name(dtype),
    }
    if family.biases == "shared":
        hf_config["attention_bias"] = config.qkv_bias
    if family.window == "every_layer":
        hf_config["sliding_window"] = config.sliding_window
    if family.window == "layer_types":
        hf_config |= {"sliding_window": config.sliding_window or config.max_seq_len, "layer_types": [
            "full_attention" if config.window_of(i) is None else "sliding_attention" for i in range(config.num_layers)
        ]}  # fmt: skip
    if family.options.get("activation") == "gelu_tanh":
        hf_config["hidden_act"] = hf_config["hidden_activation"] = "gelu_pytorch_tanh"
    if family.reads:
        hf_config |= {
            "query_pre_attn_scalar": _round(config.attn_scale**-2),
            "attn_logit_softcapping": config.attn_softcap,
            "final_logit_softcapping": config.logit_softcap,
        }
    if family.local_rope_base is not None:  # Gemma 3: both spellings of each layer type's RoPE
        local = {"rope_type": "default", "rope_theta": config.local_rope_base}
        hf_config["rope_parameters"] = {"full_attention": hf_config["rope_parameters"], "sliding_attention": local}
        hf_config["rope_local_base_freq"] = config.local_rope_base
    return hf_config | dict(family.written)


def _round(value: float) -> float | int:
    """``value``, as an int where it is one to float precision (``query_pre_attn_scalar``)."""
    return round(value) if math.isclose(value, round(value), rel_tol=1e-12) else value


def _check_architecture(hf_config: Mapping[str, Any]) -> str:
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures")
    supported = ", ".join(f"{t!r} ({a})" for t, a in SUPPORTED_ARCHITECTURES.items())
    if model_type is None and architectures is None:
        raise InvalidConfigError(
            "config.json names neither 'model_type' nor 'architectures': cannot tell which "
            f"model it describes; attn loads {supported}"
        )
    if model_type is not None and not isinstance(model_type, str):
        raise InvalidConfigError(f"config.json's 'model_type' must be a string such as 'llama', got {model_type!r}")
    if model_type is not None and model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"model_type {model_type!r} is not supported: attn loads {supported}")
    if architectures is not None:
        wanted = {SUPPORTED_ARCHITECTURES[model_type]} if model_type else set(SUPPORTED_ARCHITECTURES.values())
        if not isinstance(architectures, list) or len(architectures) != 1 or (architectures[0] not in wanted):
            raise UnsupportedArchitectureError(
                f"architectures {architectures!r} is not supported: attn loads a causal LM "
                f"with an LM head, one of {sorted(wanted)} (a base model or a "
                "classification head has other tensors)"
            )
        if model_type is None:
            model_type = next(t for t, a in SUPPORTED_ARCHITECTURES.items() if a == architectures[0])
    return model_type


def _check_options(hf_config: Mapping[str, Any], family: Family) -> None:
    def refuse(key: str, fix: str) -> None:
        raise UnsupportedConfigError(f"{key} = {hf_config[key]!r} is not supported: {fix}")

    activation = family.options.get("activation", "silu")
    key = "hidden_activation" if "hidden_activation" in hf_config else "hidden_act"
    spellings = _ACTIVATION_SPELLINGS[activation]
    if hf_config.get(key, spellings[0]) not in spellings:
        mlp = {"silu": "SwiGLU with SiLU", "gelu_tanh": "GeGLU with tanh-approximated GELU"}[activation]
        refuse(key, f"attn's {family.model_type} MLP is {mlp} ({key} {spellings[0]!r})")
    if hf_config.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", "attn's attention is causal (an embedding model's is not)")
    if hf_config.get("mlp_bias", False):
        refuse("mlp_bias", "attn's MLP linears have no bias; load this model with transformers")
    dropout = hf_config.get("attention_dropout", 0.0)
    if dropout:
        warnings.warn(
            f"attention_dropout = {dropout!r} is ignored: attn has no dropout. Outputs in eval "
            "mode are the same; training would differ.",
            CheckpointWarning,
            stacklevel=3,
        )


def _attention_biases(hf_config: Mapping[str, Any], family: Family) -> tuple[bool, bool]:
    """(q/k/v biases, output bias), as the family spells them (``attn.families.Biases``)."""
    if family.biases == "qkv":
        return True, False
    if family.biases == "none":
        return False, False
    bias = _get_bool(hf_config, "attention_bias", default=False)
    return bias, bias


def _sliding_window(
    hf_config: Mapping[str, Any], family: Family, max_seq_len: int
) -> tuple[int | None, tuple[int, ...] | None]:
    """The window and the layers it applies to (None: every layer), or (None, None), as the
    family spells them (``attn.families.Window``)."""
    if family.window == "layer_types":
        return _layer_type_window(hf_config, family, max_seq_len)
    if family.window == "every_layer":
        window = _get_int(hf_config, "sliding_window", default=None)
    elif family.window == "opt_in" and _get_bool(hf_config, "use_sliding_window", default=False):
        window = _get_int(hf_config, "sliding_window", default=None)
        layers = _get_int(hf_config, "num_hidden_layers")
        first = _get_int(hf_config, "max_window_layers", default=28)
        kinds = hf_config.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)
        ]
        windowed = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
        if window is not None and windowed and len(windowed) < layers:
            raise UnsupportedConfigError(
                f"use_sliding_window = true windows layers {windowed[0]}..{windowed[-1]} only (sliding_window "
                f"{window}, max_window_layers {first}): attn applies one attention span to every layer; set "
                "use_sliding_window to false to run full attention (what the released Qwen2.5/Qwen3 configs do)"
            )
        window = window if windowed else None
    else:
        window = None
    if window is not None and window >= max_seq_len:
        return None, None  # the window holds every position the model runs
    return window, None


def _layer_type_window(
    hf_config: Mapping[str, Any], family: Family, max_seq_len: int
) -> tuple[int | None, tuple[int, ...] | None]:
    """Gemma's windows: on the layers ``layer_types`` calls ``sliding_attention``, by default
    all but every ``sliding_window_pattern``-th. Kept even where the window holds every
    position, or is null (then it is every position): Gemma 3's windowed layers rotate with a
    RoPE of their own."""
    layers = _get_int(hf_config, "num_hidden_layers")
    pattern = _get_int(hf_config, "sliding_window_pattern", default=family.window_pattern)
    if pattern < 1:
        raise InvalidConfigError(f"sliding_window_pattern must be a positive int, got {pattern}")
    kinds = hf_config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise InvalidConfigError(
            f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {layers} layers, "
            f"got {kinds!r}"
        )
    window = _get_int(hf_config, "sliding_window", default=max_seq_len)
    windowed = tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    if not windowed:
        return None, None
    return window, None if len(windowed) == layers else windowed


def _layer_type_ropes(hf_config: Mapping[str, Any], family: Family) -> tuple[Mapping[str, Any], float | None]:
    """(config.json as ``_rope`` reads the global layers' RoPE from it, the windowed layers'
    base or None). Gemma 3 spells the two as ``rope_parameters.full_attention`` and
    ``.sliding_attention`` (transformers 5), or ``rope_theta`` / ``rope_scaling`` and
    ``rope_local_base_freq`` (transformers 4); the windowed layers' RoPE is never scaled."""
    if family.local_rope_base is None:
        return hf_config, None
    local_base = _get_float(hf_config, "rope_local_base_freq", default=family.local_rope_base)
    params = hf_config.get("rope_parameters")
    if not (isinstance(params, Mapping) and "full_attention" in params):
        return hf_config, local_base
    local, full = params.get("sliding_attention") or {}, params["full_attention"] or {}
    if not isinstance(local, Mapping) or local.get("rope_type", "default") != "default":
        raise UnsupportedConfigError(
            f"rope_parameters.sliding_attention = {local!r} is not supported: attn runs the windowed layers "
            "with plain RoPE (rope_type 'default', Gemma 3's)"
        )
    view = {**hf_config, "rope_parameters": full}
    if "rope_theta" not in hf_config and isinstance(full, Mapping) and "rope_theta" in full:
        view["rope_theta"] = full["rope_theta"]  # not the family's default: the nested base is the one
    return view, _get_float(local, "rope_theta", default=local_base)


def _scores(hf_config: Mapping[str, Any], family: Family) -> dict[str, float | None]:
    """``DecoderConfig``'s score scale and soft-caps from the keys only the family reads (Gemma's)."""
    if not family.reads:
        return {}
    scalar = _get_float(hf_config, "query_pre_attn_scalar", default=None)
    return {
        "attn_scale": None if scalar is None else scalar**-0.5,
        "attn_softcap": _get_float(hf_config, "attn_logit_softcapping", default=None),
        "logit_softcap": _get_float(hf_config, "final_logit_softcapping", default=None),
    }


_ROPE_KINDS = ("default", "linear", "llama3", "yarn", "dynamic")


def _rope(hf_config: Mapping[str, Any], max_seq_len: int) -> tuple[float, RopeScaling | None, int]:
    """(base, scaling, the positions the model runs) from the RoPE keys of config.json.

    The positions are ``max_position_embeddings`` (``max_seq_len``), except: ``dynamic``, at
    most its original context; ``yarn``, at least ``factor`` times its original context (what
    Qwen's instructions enable by adding ``rope_scaling`` alone, as vLLM reads it)."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf_config.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise InvalidConfigError(f"{key} must be a dict or null, got {value!r}")
    # transformers' order: the legacy rope_scaling over rope_parameters, then the top level.
    key = "rope_scaling" if hf_config.get("rope_scaling") else "rope_parameters"
    params: Mapping[str, Any] = hf_config.get(key) or {}
    base = _rope_theta(params, hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise UnsupportedConfigError(
            f"{key} has partial_rotary_factor {factor!r}: attn rotates the whole head (partial_rotary_factor 1.0)"
        )
    if rope_type not in _ROPE_KINDS:
        raise UnsupportedConfigError(
            f"{key} has rope_type {rope_type!r}, which attn does not implement (it implements "
            f"{', '.join(_ROPE_KINDS)}); loading it anyway would silently change the model at every "
            "position. To run within the pretrained context, remove the rope scaling from config.json "
            "and set max_position_embeddings to original_max_position_embeddings"
        )
    if rope_type == "default":
        return base, None, max_seq_len
    if rope_type == "dynamic":
        # Dynamic NTK is plain RoPE up to the original context, and re-encodes every position
        # once a sequence grows past it (which keys already in a static cache cannot follow).
        original = _get_int(params, "original_max_position_embeddings", default=max_seq_len)
        if original < max_seq_len:
            warnings.warn(
                f"{key} rope_type 'dynamic' is plain RoPE within original_max_position_embeddings "
                f"({original}) and rescales every position past it, which a static cache cannot follow: "
                f"attn loads it as plain RoPE with max_seq_len {original} (not {max_seq_len})",
                CheckpointWarning,
                stacklevel=4,
            )
        return base, None, min(original, max_seq_len)
    try:
        if rope_type == "linear":
            return base, RopeScaling("linear", _get_float(params, "factor", default=_NO_DEFAULT)), max_seq_len
        if rope_type == "yarn":
            scaling = _yarn(params, max_seq_len)
            return base, scaling, max(max_seq_len, int(scaling.original_max_seq_len * scaling.factor))
        scaling = RopeScaling(
            "llama3",
            factor=_get_float(params, "factor", default=_NO_DEFAULT),
            low_freq_factor=_get_float(params, "low_freq_factor", default=_NO_DEFAULT),
            high_freq_factor=_get_float(params, "high_freq_factor", default=_NO_DEFAULT),
            original_max_seq_len=_get_int(params, "original_max_position_embeddings"),
        )
    except InvalidConfigError as err:
        raise InvalidConfigError(f"{key} (rope_type {rope_type!r}): {err}") from None
    except ValueError as err:
        raise InvalidConfigError(f"{key}: {err}") from None
    return base, scaling, max_seq_len


def _yarn(params: Mapping[str, Any], max_seq_len: int) -> RopeScaling:
    """YaRN's keys, with transformers' defaults: ``original_max_position_embeddings`` is
    ``max_position_embeddings``, a null ``factor`` their ratio, ``attention_factor`` from
    ``mscale`` / ``mscale_all_dim`` where both are given (DeepSeek's spelling)."""
    original = _get_int(params, "original_max_position_embeddings", default=max_seq_len)
    factor = params.get("factor")
    factor = max_seq_len / original if factor is None else _get_float(params, "factor", default=_NO_DEFAULT)
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        attention_factor = _get_float(params, "attention_factor", default=_NO_DEFAULT)
    elif params.get("mscale") and params.get("mscale_all_dim") and factor > 1:
        mscale, mscale_all_dim = (_get_float(params, key, default=_NO_DEFAULT) for key in ("mscale", "mscale_all_dim"))
        attention_factor = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
    return RopeScaling(
        "yarn",
        factor=factor,
        original_max_seq_len=original,
        beta_fast=_get_float(params, "beta_fast", default=None) if params.get("beta_fast") else 32.0,
        beta_slow=_get_float(params, "beta_slow", default=None) if params.get("beta_slow") else 1.0,
        attention_factor=attention_factor,
        truncate=_get_bool(params, "truncate", default=True),
    )


def _rope_theta(params: Mapping[str, Any], hf_config: Mapping[str, Any]) -> float:
    top = hf_config.get("rope_theta")
    theta = params.get("rope_theta", top)
    if top is not None and theta != top:
        raise InvalidConfigError(
            f"config.json gives two RoPE bases: rope_theta {top!r} and rope_parameters.rope_theta {theta!r}; remove one"
        )
    if theta is None:
        return _ROPE_THETA_DEFAULT
    if not is_number(theta) or not math.isfinite(theta):
        raise InvalidConfigError(f"config.json rope_theta must be a finite number, got {theta!r}")
    return float(theta)


_NO_DEFAULT: Any = object()


def _get(hf_config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = hf_config.get(key)
    if value is None:
        if default is _NO_DEFAULT:
            raise InvalidConfigError(f"config.json lacks the required key {key!r}")
        return default
    return value


def _get_int(hf_config: Mapping[str, Any], key: str, default: Any = _NO_DEFAULT) -> Any:
    value = _get(hf_config, key, default)
    if value is not default and not is_int(value):
        raise InvalidConfigError(f"config.json {key} must be an integer, got {value!r}")
    return value


def _get_float(hf_config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = _get(hf_config, key, default)
    if value is None:  # absent or null, with None the default
        return None
    if not is_number(value):
        raise InvalidConfigError(f"config.json {key} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidConfigError(f"config.json {key} must be a finite number, got {value!r}")
    return float(value)


def _get_bool(hf_config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = _get(hf_config, key, default)
    if not isinstance(value, bool):
        raise InvalidConfigError(f"config.json {key} must be true or false, got {value!r}")
    return value


def _config_dtype(hf_config: Mapping[str, Any]) -> torch.dtype | None:
    name = hf_config.get("dtype", hf_config.get("torch_dtype"))
    return _dtype_or_none(name, UnsupportedConfigError, "config.json: {error}, or pass dtype= to load_pretrained")


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    return _dtype_or_none(dtype, ValueError, "{error}, or None (the checkpoint's own)")


def _dtype_or_none(name: torch.dtype | str | None, error_type: type[Exception], message: str) -> torch.dtype | None:
    """``name`` as a dtype (None stays None); an unknown name raises ``error_type`` with
    ``message``, whose ``{error}`` is what ``dtype_from_name`` said."""
    if name is None:
        return None
    try:
        return dtype_from_name(name)
    except ValueError as error:
        raise error_type(message.format(error=error)) from None


# ---------------------------------------------------------------------------- tensors


def hf_tensor_names(config: DecoderConfig, family: Family | None = None) -> dict[str, str]:
    """attn parameter name -> Hugging Face tensor name, for every parameter of the model."""
    return (family or family_for(config)).tensor_names(config)


@dataclass(frozen=True)
class _Index:
    """Where each tensor of a checkpoint lives: Hugging Face name -> safetensors file."""

    files: dict[str, Path]

    def describe(self, name: str) -> str:
        return f"{name!r} (in {self.files[name].name})"


def _read_index(directory: Path) -> _Index:
    single = directory / WEIGHTS_FILE
    index_path = directory / INDEX_FILE
    if single.is_file():
        shards = [single]
        listed: dict[str, str] = {}
    elif index_path.is_file():
        index = _read_json(index_path)
        listed = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(listed, dict):
            raise InvalidConfigError(f"{index_path} has no 'weight_map' dict")
        shards = []
        for shard in listed.values():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise InvalidConfigError(
                    f"{index_path} names shard {shard!r}: a shard must be a file name in the "
                    "checkpoint directory, not a path"
                )
        for shard in sorted(set(listed.values())):
            if not (directory / shard).is_file():
                raise FileNotFoundError(
                    f"{index_path} lists shard {shard!r}, which is not in {directory}: copy "
                    "every shard of the checkpoint"
                )
            shards.append(directory / shard)
    else:
        pickled = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
        hint = (
            f"; it holds {pickled}, pickle files attn never loads (they can run code): convert them to safetensors"
            if pickled
            else ""
        )
        raise FileNotFoundError(f"{directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    files: dict[str, Path] = {}
    for shard in shards:
        with _safe_open(shard) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if name in files:
                    raise InvalidConfigError(f"tensor {name!r} is stored twice, in {files[name].name} and {shard.name}")
                files[name] = shard
    for name, shard in listed.items():
        if files.get(name) != directory / shard:
            raise MissingTensorError(
                f"{INDEX_FILE} says tensor {name!r} is in {shard}, but it is not there: the "
                "shards do not match the index"
            )
    return _Index(files)


def _check_names(index: _Index, names: Mapping[str, str], config: DecoderConfig) -> None:
    expected = set(names.values())
    stored = {n for n in index.files if not _DERIVED_TENSOR.match(n)}
    if config.tie_embeddings:
        stored.discard(TOP_TENSORS["output.weight"])  # checked for equality on load
    missing = sorted(expected - stored)
    if missing:
        raise MissingTensorError(
            f"checkpoint lacks {len(missing)} tensor(s) the config implies, e.g. "
            f"{missing[:3]}: the checkpoint is incomplete or config.json does not match it" + _hint(missing, config)
        )
    unexpected = sorted(stored - expected)
    if unexpected:
        raise UnexpectedTensorError(
            f"checkpoint holds {len(unexpected)} tensor(s) a Llama model with this config has "
            f"no place for, e.g. {[index.describe(n) for n in unexpected[:3]]}: is it another "
            "architecture, or does config.json (num_hidden_layers, tie_word_embeddings, biases) "
            "not match the weights?"
        )


def _hint(missing: list[str], config: DecoderConfig) -> str:
    if missing == [TOP_TENSORS["output.weight"]] and not config.tie_embeddings:
        return " (no lm_head.weight: if the output layer shares the embedding, set tie_word_embeddings to true)"
    return ""


def _check_tensor(name: str, info: Any, expected: torch.Size, index: _Index) -> None:
    shape = tuple(info.get_shape())
    if shape != tuple(expected):
        raise TensorShapeError(
            f"tensor {index.describe(name)} has shape {shape}, but config.json implies "
            f"{tuple(expected)}: config.json does not match the weights"
        )
    stored = info.get_dtype()
    if stored not in _FLOAT_DTYPES:
        raise TensorDtypeError(
            f"tensor {index.describe(name)} is stored as {stored}, not a float: attn loads "
            "unquantized float weights only"
        )


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # safetensors' names


def _check_dequantized(quantization: Any, index: _Index) -> None:
    """A ``quantization_config`` over float tensors (transformers writes one after
    dequantizing a GGUF, say) is loaded with a warning; over quantized tensors, refused."""
    method = quantization.get("quant_method", "unknown") if isinstance(quantization, Mapping) else "unknown"
    with ExitStack() as stack:
        readers = _open_all(stack, index)
        stored = {name: readers[shard].get_slice(name).get_dtype() for name, shard in index.files.items()}
    packed = sorted(name for name, dtype in stored.items() if dtype not in _FLOAT_DTYPES)
    if packed:
        kinds = sorted({stored[name] for name in packed})
        raise TensorDtypeError(
            f"config.json has a quantization_config (quant_method {method!r}) and the weights are quantized: "
            f"{len(packed)} of {len(stored)} tensors are stored as {kinds}, e.g. "
            f"{[index.describe(n) for n in packed[:2]]}. "
            "attn loads float weights only: load this checkpoint with transformers, or use the unquantized release"
        )
    warnings.warn(
        f"config.json has a quantization_config (quant_method {method!r}), but every tensor is stored as a float "
        f"({', '.join(sorted(set(stored.values())))}): the weights are already dequantized, so attn loads them as they "
        "are and ignores quantization_config",
        CheckpointWarning,
        stacklevel=3,
    )


def _open_all(stack: ExitStack, index: _Index) -> dict[Path, Any]:
    return {shard: stack.enter_context(_safe_open(shard)) for shard in sorted(set(index.files.values()))}


def _safe_open(shard: Path) -> Any:
    try:
        return safe_open(shard, framework="pt")
    except Exception as error:  # safetensors' SafetensorError (a bad header, a short file), or an OSError
        raise CorruptFileError(
            f"{shard} is not a readable safetensors file ({first_line(error)}): it may be truncated or "
            "corrupt; download it again"
        ) from error


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptFileError(f"{path} is not valid JSON ({error}): fix it, or download it again") from None


# ---------------------------------------------------------------------------- load / save


def load_pretrained(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    max_seq_len: int | None = None,
    huge_pages: bool = True,
) -> TransformerDecoder:
    """Load a local Hugging Face Llama-family checkpoint directory.

    The config options and every tensor's name, shape and dtype are checked before any
    weight is read, so a bad checkpoint fails fast with an error that names what is wrong.

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` (or shards listed by
            ``model.safetensors.index.json``). Local only: nothing is downloaded.
        dtype: parameter dtype (``torch.float32``, ``torch.bfloat16``, ``torch.float16`` or
            their names). None: the ``dtype`` / ``torch_dtype`` of config.json, else float32.
        device: where the parameters go; None: the default device.
        max_seq_len: the most positions the model will run (its RoPE table and largest
            cache); None: the checkpoint's ``max_position_embeddings``. Lower it to save
            memory on long-context checkpoints (Llama 3.1: 131072 positions).
        huge_pages: on the CPU, read the weights into one mapping of transparent huge pages
            where the system offers them (``attn.place_in_huge_pages``: a CPU decode step
            streams every weight, and 4 KiB pages cost it a TLB miss each); ``False`` gives
            each parameter memory of its own from torch's allocator.

    Returns:
        The model, in eval mode, with no caches set up.

    Raises:
        FileNotFoundError: no config.json, no safetensors weights, or a missing shard.
        UnsupportedArchitectureError, UnsupportedConfigError, InvalidConfigError: see
            ``config_from_hf``.
        MissingTensorError, UnexpectedTensorError, TensorShapeError, TensorDtypeError: the
            weights do not match the config. All are ``CheckpointError`` (a ``ValueError``).

    Example::

        model = attn.load_pretrained("/models/my-llama", dtype="bfloat16")
        out = attn.generate(model, [tokenizer.encode("Hello")], max_new_tokens=32)
    """
    directory = Path(path)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{config_path} not found: load_pretrained takes a local checkpoint directory "
            "(config.json plus safetensors weights), as written by save_pretrained"
        )
    hf_config = _read_json(config_path)
    if not isinstance(hf_config, dict):
        raise InvalidConfigError(f"{config_path} must hold a JSON object")
    config = config_from_hf(hf_config)
    if max_seq_len is not None:
        limit = config.max_seq_len
        if not is_int(max_seq_len) or not 0 < max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be an int in [1, {limit}] (its context), got {max_seq_len!r}")
        config = dataclasses.replace(config, max_seq_len=max_seq_len)
    dtype = _resolve_dtype(dtype) or _config_dtype(hf_config) or torch.float32

    index = _read_index(directory)
    if hf_config.get("quantization_config") is not None:
        _check_dequantized(hf_config["quantization_config"], index)
    names = hf_tensor_names(config, family_named(_check_architecture(hf_config)))
    _check_names(index, names, config)

    with torch.device("meta"):  # shapes only: nothing is allocated before every header is checked
        model = TransformerDecoder(config).to(dtype=dtype)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if set(shapes) != set(names):  # attn's own layout changed: a bug here, not the user's
        raise RuntimeError(
            f"attn's parameters {sorted(set(shapes) ^ set(names))[:4]} do not match the "
            "checkpoint name table in attn/checkpoint.py: update the table"
        )
    with ExitStack() as stack:
        readers = _open_all(stack, index)
        for ours, theirs in names.items():
            _check_tensor(theirs, readers[index.files[theirs]].get_slice(theirs), shapes[ours], index)
        model = _materialize(model, device)
        if huge_pages and model.tok_embeddings.weight.device.type == "cpu":
            place_in_huge_pages(model, copy=False)  # before the weights are read in: no copy
        params = dict(model.named_parameters())
        with torch.no_grad():
            for ours, theirs in names.items():
                params[ours].copy_(readers[index.files[theirs]].get_tensor(theirs))
            tied_head = TOP_TENSORS["output.weight"]
            if config.tie_embeddings and tied_head in index.files:
                _check_tied_head(
                    readers[index.files[tied_head]].get_tensor(tied_head), params["tok_embeddings.weight"], index
                )
    return model.eval()


def _materialize(model: TransformerDecoder, device: torch.device | str | None) -> TransformerDecoder:
    """A model built on the meta device, given uninitialized parameters on ``device``, each of
    which the checkpoint then overwrites: no time or memory goes to a random init (seconds and
    a second fp32 copy for a 1B model). Buffers hold derived values that their modules rebuild
    when moved (the RoPE table); tests/test_checkpoint.py checks they equal a fresh model's."""
    target = torch.device(device) if device is not None else torch.get_default_device()
    return model.to_empty(device=target)


def _check_tied_head(head: torch.Tensor, embedding: torch.Tensor, index: _Index) -> None:
    name = TOP_TENSORS["output.weight"]
    if head.shape != embedding.shape or not torch.equal(
        head.to(device=embedding.device, dtype=embedding.dtype), embedding
    ):
        raise UnexpectedTensorError(
            f"tie_word_embeddings is true, but {index.describe(name)} differs from "
            "model.embed_tokens.weight: set tie_word_embeddings to false to use it as the "
            "output layer, or remove it"
        )


def save_pretrained(
    model: TransformerDecoder,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory (``config_to_hf`` picks the family).

    The directory gets ``config.json`` and one ``model.safetensors``; both attn's
    ``load_pretrained`` and transformers' ``AutoModelForCausalLM.from_pretrained`` read it.

    Args:
        model: the model to save (a ``torch.compile`` or ``attn.compile_for_decode``
            wrapper is unwrapped).
        path: the directory; created if missing. Existing files of the same names are
            replaced.
        dtype: the stored dtype; None: the model's parameter dtype.

    Returns:
        The directory's path.
    """
    model = decoder_of(model, "save_pretrained")
    names = hf_tensor_names(model.config)
    params = dict(model.named_parameters())
    dtype = _resolve_dtype(dtype) or params["tok_embeddings.weight"].dtype
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        theirs: params[ours].detach().to(device="cpu", dtype=dtype).contiguous() for ours, theirs in names.items()
    }
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    hf_config = config_to_hf(model.config, dtype=dtype)
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    return directory
