"""attn: a decoder whose KV-cache follows the kind of forward pass.

Passes under ``torch.inference_mode()`` use the cache; ``torch.no_grad()`` scoring and
training with gradients leave it untouched, with no work from the user
(``attn.policy.uses_cache`` is the rule). See README.md.
"""

from attn import compat
from attn.attention import MultiHeadAttention
from attn.checkpoint import load_pretrained
from attn.context import cached_inference, disable_kv_cache, kv_cache_mode, local_kv_cache
from attn.decoder import DecoderConfig, TransformerDecoder
from attn.generation import GenerationOutput, generate
from attn.huge_pages import place_in_huge_pages
from attn.kv_cache import KVCache, attended_slots
from attn.logprobs import CompletionLogprobs, completion_logprobs
from attn.masks import padded_causal_mask, padding_positions
from attn.packed import set_packed_decode
from attn.parity import set_parity_mode
from attn.policy import CachePolicy, CompatWarning, cache_policy
from attn.scoring import ContinuationScore, score_continuations

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``attn.compile_for_decode`` loads the CPU fast path (and inductor) when first asked for."""
    if name == "compile_for_decode":
        from attn.fast_decode import compile_for_decode

        return compile_for_decode
    raise AttributeError(f"module 'attn' has no attribute {name!r}")


__all__ = [
    "CachePolicy",
    "CompatWarning",
    "CompletionLogprobs",
    "ContinuationScore",
    "DecoderConfig",
    "GenerationOutput",
    "KVCache",
    "MultiHeadAttention",
    "TransformerDecoder",
    "attended_slots",
    "cache_policy",
    "cached_inference",
    "compat",
    "compile_for_decode",
    "completion_logprobs",
    "disable_kv_cache",
    "generate",
    "kv_cache_mode",
    "load_pretrained",
    "local_kv_cache",
    "padded_causal_mask",
    "padding_positions",
    "place_in_huge_pages",
    "score_continuations",
    "set_packed_decode",
    "set_parity_mode",
]
