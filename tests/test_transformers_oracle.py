"""transformers as a numerical oracle for attn/checkpoint.py and the decoder it loads.

For each case (Llama with plain, ``llama3`` and ``linear`` RoPE and attention biases;
Qwen2 with q/k/v biases; Qwen3 with q/k norms and a head_dim unequal to hidden/heads;
Mistral with a sliding window shorter than the sequences; Gemma 2 with soft-capping and a
window on every other layer; Gemma 3 with q/k norms and windowed layers of their own RoPE
base beside linearly scaled global ones), the transformers model with
random weights is saved with ``save_pretrained``, loaded with ``attn.load_pretrained``,
and both models must agree on:

(a) logits: fp32 within ``assert_close``'s fp32 defaults (rtol 1.3e-6, atol 1e-5). bf16:
    attn in bf16 and transformers in bf16 are each compared with the transformers fp32
    logits (which span about +-9 here, std 2): attn's mean absolute error must be at most
    ``BF16_MEAN_RATIO`` times transformers' own (measured ratio 0.92-1.05 over 12
    config/input pairs, both about 0.04), and its largest error at most ``BF16_MAX_ABS``
    (measured 0.36-0.76; transformers' own 0.38-0.60). bf16 tokens are not compared:
    random weights give exact ties in bf16 (see shared/research/cpu-decode-performance.md).
(b) greedy generation of ``NEW_TOKENS`` tokens for a left-padded batch of prompts of
    different lengths: identical tokens to transformers' own ``generate`` (given the
    attention mask).
(c) the same with ``torch.compile(model, backend="eager")``: dynamo traces every forward,
    with no inductor code generation, to keep CI time low.

Weights are drawn with std ``INIT_STD`` = 0.25, not Llama's 0.02: at width 64, std 0.05 makes
greedy output collapse to one repeated token per row (measured), which would make token
equality meaningless; the tests also assert the output did not collapse.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import attn
from attn.checkpoint import load_pretrained, save_pretrained
from attn.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")


INIT_STD = 0.25
NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 13, 1, 9)
BF16_MEAN_RATIO = 1.25
BF16_MAX_ABS = 1.0


@dataclass(frozen=True)
class OracleCase:
    name: str
    hf: dict[str, Any]  # config arguments on top of BASE
    family: str = "Llama"  # transformers' {family}Config and {family}ForCausalLM
    model_class: str | None = None  # where it is not {family}ForCausalLM

    @property
    def model_class_name(self) -> str:
        return self.model_class or f"{self.family}ForCausalLM"


BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)
CASES = [
    OracleCase("mha-untied", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    OracleCase(
        "gqa-tied-theta5e5",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0),
    ),
    OracleCase(
        "mqa-untied-headdim32-theta1e3",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False, rope_theta=1000.0),
    ),
    OracleCase(
        "gqa-tied-headdim8-eps1e-5",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
            rope_theta=20000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    # RoPE scaled past an original context of 16 positions: the sequences below run to 45.
    OracleCase(
        "llama3-rope-gqa-tied",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=5e5,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    OracleCase(
        "linear-rope-attention-bias",
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0),
        ),
    ),
    # YaRN as Qwen's instructions enable it (factor 4 over an original context of 16: the
    # sequences run to 45), and with every key spelled out: beta bounds, an attention factor,
    # no truncation.
    OracleCase(
        "yarn-qwen3",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16),
        ),
        "Qwen3",
    ),
    OracleCase(
        "yarn-every-key-tied",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1e4,
                factor=3.0,
                original_max_position_embeddings=20,
                beta_fast=16.0,
                beta_slow=2.0,
                attention_factor=1.3,
                truncate=False,
            ),
        ),
    ),
    OracleCase("qwen2-gqa-tied", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True), "Qwen2"),
    OracleCase(
        "qwen3-headdim32-untied",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
        "Qwen3",
    ),
    OracleCase(
        "mistral-window8",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=8, rope_theta=1e6),
        "Mistral",
    ),
    # Gemma 2: layers 0 and 2 windowed; a query scalar unlike head_dim; caps low enough to
    # bend the scores and logits these weights give (transformers' 50 and 30 barely would).
    OracleCase(
        "gemma2-window6-softcap",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        "Gemma2",
    ),
    # Gemma 3: windowed layers at base 1e4, global ones at 1e6 stretched linearly; q/k norms.
    OracleCase(
        "gemma3-window6-two-ropes",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=6,
            sliding_window_pattern=2,
            tie_word_embeddings=False,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        "Gemma3Text",
        "Gemma3ForCausalLM",
    ),
]
GEMMA = {"Gemma2", "Gemma3Text"}


@dataclass(frozen=True)
class Pair:
    case: OracleCase
    directory: Path
    hf: Any  # LlamaForCausalLM, fp32
    ours: attn.TransformerDecoder  # loaded from directory, fp32


def _hf_model(case: OracleCase, seed: int = 0) -> Any:
    # No EOS: generation must run all NEW_TOKENS steps on both sides, with nothing suppressed.
    config_class = getattr(transformers, f"{case.family}Config")
    config = config_class(**BASE, **case.hf, initializer_range=INIT_STD, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = getattr(transformers, case.model_class_name)(config).eval()
    with torch.no_grad():  # norms scale by 1 and biases are 0: vary them so a swap or a drop would show
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):  # a scale in [0.5, 1.5]: Gemma's is 1 + weight
                parameter.uniform_(-0.5, 0.5) if case.family in GEMMA else parameter.uniform_(0.5, 1.5)
            elif name.endswith("embed_tokens.weight") and case.family in GEMMA:
                parameter /= config.hidden_size**0.5  # Gemma scales it up by as much: else it swamps every layer
            elif name.endswith(".bias"):
                parameter.uniform_(-0.5, 0.5)
    return model


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    case: OracleCase = request.param
    hf = _hf_model(case)
    directory = tmp_path_factory.mktemp(case.name)
    hf.save_pretrained(directory)
    return Pair(case, directory, hf, load_pretrained(directory))


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (b, s)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)  # (b, s)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = True
    return tokens, mask


def _hf_greedy(hf: Any, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    config = transformers.GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None, bos_token_id=None
    )
    with torch.no_grad():
        out = hf.generate(input_ids=tokens, attention_mask=mask.long(), generation_config=config)
    return out[:, tokens.shape[1] :]  # (b, N)


# ---------------------------------------------------------------------------- (a) logits


def test_config_matches(pair: Pair) -> None:
    hf, config = pair.hf.config, pair.ours.config
    assert config.embed_dim == hf.hidden_size and config.num_layers == hf.num_hidden_layers
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
    )
    rope = hf.rope_parameters.get("full_attention", hf.rope_parameters)  # Gemma 3: one per layer type
    assert config.rope_base == rope["rope_theta"] and config.norm_eps == hf.rms_norm_eps
    assert config.tie_embeddings == hf.tie_word_embeddings and config.max_seq_len == hf.max_position_embeddings
    assert (config.rope_scaling.kind if config.rope_scaling else "default") == rope.get("rope_type", "default")
    local = hf.rope_parameters.get("sliding_attention")
    assert config.local_rope_base == (None if local is None else local["rope_theta"])
    assert config.sliding_window == getattr(hf, "sliding_window", None)
    gemma = pair.case.family in GEMMA
    if gemma:  # Mistral lists layer_types too, all "full_attention", and windows every layer anyway
        windowed = [config.window_of(i) is not None for i in range(config.num_layers)]
        assert windowed == [kind == "sliding_attention" for kind in hf.layer_types]
    assert (config.embed_scale, config.unit_offset_norms, config.sandwich_norms) == (gemma, gemma, gemma)
    assert config.activation == ("gelu_tanh" if gemma else "silu")
    if gemma:
        assert config.attn_scale == hf.query_pre_attn_scalar**-0.5
        assert (config.attn_softcap, config.logit_softcap) == (hf.attn_logit_softcapping, hf.final_logit_softcapping)
    biases = {name.rsplit(".", 2)[-2] for name, _ in pair.hf.named_parameters() if name.endswith("proj.bias")}
    assert {"q_proj", "k_proj", "v_proj"} <= biases if config.qkv_bias else not biases & {"q_proj", "k_proj", "v_proj"}
    assert ("o_proj" in biases) == config.out_bias
    assert config.qk_norm == any(name.endswith("q_norm.weight") for name, _ in pair.hf.named_parameters())


def test_rope_frequencies_match_transformers(pair: Pair) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = pair.ours.config
    rotary = pair.hf.model.rotary_emb
    if config.local_rope_base is not None:  # Gemma 3: a table per layer type
        local = inverse_frequencies(config.head_dim, config.local_rope_base)
        torch.testing.assert_close(local, rotary.sliding_attention_inv_freq, rtol=0, atol=0)
        assert (pair.ours.local_rope.base, pair.ours.local_rope.scaling) == (config.local_rope_base, None)
        expected = rotary.full_attention_inv_freq
    else:
        rope_type = pair.hf.config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            expected = rotary.inv_freq
        else:
            expected, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](pair.hf.config, torch.device("cpu"))
            assert attention_factor == pytest.approx(pair.ours.config.rope_scaling.attention_scale, rel=1e-12)
    actual = inverse_frequencies(config.head_dim, config.rope_base, config.rope_scaling)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_fp32_logits_match(pair: Pair) -> None:
    tokens = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = pair.hf(tokens).logits
        actual = pair.ours(tokens)
    torch.testing.assert_close(actual, expected)  # fp32 defaults: rtol 1.3e-6, atol 1e-5


def test_fp32_left_padded_logits_match(pair: Pair) -> None:
    tokens, mask = _left_padded(_prompts(128))
    with torch.no_grad():
        positions = attn.padding_positions(mask)  # both sides: RoPE's shift invariance is not exact in floats
        expected = pair.hf(tokens, attention_mask=mask.long(), position_ids=positions).logits
        actual = pair.ours(tokens, input_pos=positions, mask=attn.padded_causal_mask(mask))
    torch.testing.assert_close(actual[mask], expected[mask])  # padded rows are garbage on both sides


def test_bf16_logits_within_tolerance(pair: Pair) -> None:
    tokens = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(2))
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(pair.directory, dtype=torch.bfloat16).eval()
    ours16 = load_pretrained(pair.directory, dtype=torch.bfloat16)
    assert {p.dtype for p in ours16.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        reference = pair.hf(tokens).logits  # fp32
        theirs = hf16(tokens).logits.float()
        ours = ours16(tokens)
    assert ours.dtype == torch.bfloat16
    our_error, their_error = (ours.float() - reference).abs(), (theirs - reference).abs()
    assert our_error.mean() <= BF16_MEAN_RATIO * their_error.mean(), (
        f"attn bf16 mean error {our_error.mean():.4f} exceeds {BF16_MEAN_RATIO}x transformers' bf16 mean error "
        f"{their_error.mean():.4f}"
    )
    assert our_error.max() <= BF16_MAX_ABS, (
        f"attn bf16 is up to {our_error.max():.4f} from fp32 (transformers bf16: {their_error.max():.4f})"
    )


# ---------------------------------------------------------------------------- (b), (c) generation


def _check_greedy(pair: Pair, model: Any) -> None:
    prompts = _prompts(128)
    tokens, mask = _left_padded(prompts)
    out = attn.generate(model, prompts, max_new_tokens=NEW_TOKENS, pad_id=0)
    assert torch.equal(out.tokens[:, : out.prompt_length], tokens)
    expected = _hf_greedy(pair.hf, tokens, mask)
    assert out.generated.shape == expected.shape == (len(prompts), NEW_TOKENS)
    for row in expected:
        assert len(set(row.tolist())) >= 4, f"greedy output collapsed, the comparison means little: {row.tolist()}"
    assert torch.equal(out.generated, expected), f"attn\n{out.generated}\ntransformers\n{expected}"


def test_greedy_generation_matches_transformers(pair: Pair) -> None:
    _check_greedy(pair, pair.ours)
    assert not pair.ours.caches_are_setup()


def test_compiled_greedy_generation_matches_transformers(pair: Pair) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(pair.ours, backend="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attn.CompatWarning)
        _check_greedy(pair, compiled)
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 2, f"{graphs} graphs compiled; expected one for prefill and one for every decode step"


def test_greedy_generation_with_user_caches_matches_transformers(pair: Pair) -> None:
    pair.ours.setup_caches(len(PROMPT_LENGTHS), max(PROMPT_LENGTHS) + NEW_TOKENS + 3)
    try:
        _check_greedy(pair, pair.ours)
    finally:
        pair.ours.teardown_caches()


# ---------------------------------------------------------------------------- other directions


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "mha-untied"], ids=lambda c: c.name)
def test_transformers_loads_what_attn_saves(tmp_path: Path, case: OracleCase) -> None:
    ours = load_pretrained(_saved_hf(case, tmp_path / "hf"))
    directory = save_pretrained(ours, tmp_path / "attn")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(hf).__name__ == case.model_class_name
    saved = json.loads((directory / "config.json").read_text())
    written = case.hf.get("rope_parameters", {})
    if "full_attention" not in written:
        assert saved["rope_parameters"] == {"rope_theta": ours.config.rope_base, "rope_type": "default"} | written
    else:
        assert saved["rope_parameters"] == written
    assert load_pretrained(directory).config == ours.config
    tokens = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits)


def test_mistral_without_sliding_window_matches(tmp_path: Path) -> None:
    config = transformers.MistralConfig(
        **BASE,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=None,
        rope_theta=1e6,
        initializer_range=INIT_STD,
    )
    torch.manual_seed(0)
    hf = transformers.MistralForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    tokens = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits)


def _saved_hf(case: OracleCase, directory: Path) -> Path:
    _hf_model(case, seed=1).save_pretrained(directory)
    return directory
