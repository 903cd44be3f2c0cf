"""attn: attention whose KV-cache follows the kind of forward pass.

Generation uses the cache; scoring without gradients and training with gradients leave it
untouched, with no work from the user. See README.md for the policy by torch release.
"""

from attn import compat
from attn.attention import MultiHeadAttention
from attn.checkpoint import load_pretrained
from attn.compat import CachePolicy, CompatWarning, cache_policy
from attn.context import cached_inference, disable_kv_cache, kv_cache_mode, local_kv_cache
from attn.decoder import DecoderConfig, TransformerDecoder
from attn.fast_decode import compile_for_decode
from attn.generation import GenerationOutput, generate
from attn.kv_cache import KVCache
from attn.masks import padded_causal_mask, padding_positions

__version__ = "0.1.0"

__all__ = [
    "CachePolicy",
    "CompatWarning",
    "DecoderConfig",
    "GenerationOutput",
    "KVCache",
    "MultiHeadAttention",
    "TransformerDecoder",
    "cache_policy",
    "cached_inference",
    "compat",
    "compile_for_decode",
    "disable_kv_cache",
    "generate",
    "kv_cache_mode",
    "load_pretrained",
    "local_kv_cache",
    "padded_causal_mask",
    "padding_positions",
]
