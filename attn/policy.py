"""Will this forward pass touch the KV-cache? ``uses_cache`` is the one function that answers.

A pass uses the cache iff all of these hold:

1. caches are set up;
2. the explicit flag is not off (``attn.disable_kv_cache``, ``attn.kv_cache_mode(model, False)``);
3. grad is off (a cache never holds autograd history);
4. the flag is on (``attn.cached_inference``, ``attn.kv_cache_mode``), or the pass runs under
   ``torch.inference_mode()`` (its activations are inference tensors). The second half is
   the ``INFERENCE`` policy, the default on every torch release; the ``FLAG`` policy
   (``ATTN_CACHE_POLICY=flag``) keeps the flag alone.

A grad-enabled pass with the flag on raises. The decoder asks once per forward and hands the
answer to every layer as a plain bool.

Under ``torch.compile`` the inference-mode test runs in eager code (``inference_mode_decides``
is ``torch.compiler.disable``-d): no torch release can trace it with a guard that tells the
kinds of pass apart (``attn.compat.RELEASES``), but dynamo specialises the code after the
break on the returned bool and guards it, so compiled passes decide exactly like eager ones.
The price is one graph break per forward, and only in passes that need the test (caches set
up, no flag, grad off); with the flag on there is none, so ``attn.cached_inference`` compiles
with ``fullgraph=True``, exports and suits CUDA graphs.
"""

from __future__ import annotations

import torch

from attn import compat
from attn.compat import CachePolicy
from attn.kv_cache import KVCache

__all__ = ["explicit_decision", "inference_mode_decides", "uses_cache"]


def uses_cache(cache: KVCache | None, flag: bool | None, num_tokens: int, *, warn: bool = True) -> bool:
    """Will a pass of ``num_tokens`` new tokens per row, run now, use ``cache``?

    The whole rule, for eager callers. A forward that may be compiled makes the same
    decision in two calls, so that the inference-mode test is a graph break of its own frame
    (one per forward) rather than of a nested call (one per frame on the way)::

        use_cache = explicit_decision(cache, flag)
        if use_cache is None:
            use_cache = inference_mode_decides(cache, num_tokens, torch.compiler.is_compiling())

    Args:
        cache: the cache the pass would use; ``None`` when caches are not set up.
        flag: the explicit flag: ``None`` (decide by the pass), ``True`` (on), ``False``
            (off: never use the cache).
        num_tokens: tokens per row the pass brings (to warn about scoring onto a cache that
            a decode loop left filled).
        warn: ``False`` to ask about a pass without running one (no warnings).

    Raises:
        RuntimeError: the flag is on and grad is enabled.
    """
    decision = explicit_decision(cache, flag, warn=warn)
    if decision is None:
        decision = inference_mode_decides(cache, num_tokens if warn else 1, False)
    return decision


def explicit_decision(cache: KVCache | None, flag: bool | None, *, warn: bool = True) -> bool | None:
    """Rules 1-3 and the flag: ``True``/``False`` where they decide, ``None`` where inference
    mode does. Traceable: reads only Python state and the grad mode, which dynamo guards."""
    if cache is None or flag is False:
        return False
    grad_enabled = torch.is_grad_enabled()
    if flag:
        if grad_enabled:
            raise RuntimeError(
                "a grad-enabled forward pass ran with the KV-cache flag on (kv_cache_mode / "
                "cached_inference); the cache must never hold autograd history. Run "
                "generation under attn.cached_inference(model) or torch.no_grad(), and "
                "training outside kv_cache_mode."
            )
        return True
    if grad_enabled:
        return False
    if compat.active_policy() is CachePolicy.FLAG:
        if warn and not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            compat.warn_inference_mode_ignored()
        return False
    return None


@compat.eager_only(
    "attn tests torch.inference_mode() in eager code to decide whether this pass uses the KV-cache; "
    f"{compat.FIX}; score inside attn.disable_kv_cache(model), or set ATTN_CACHE_POLICY=flag"
)
def inference_mode_decides(cache: KVCache, num_tokens: int, compiled: bool) -> bool:
    """Rule 4's second half: is inference mode on? Always runs in eager code; ``compiled``
    says a compiled forward called it (pass ``torch.compiler.is_compiling()``).

    It also warns about the scoring trap. Under plain inference mode (no flag) a pass of
    several tokens onto a cache that holds tokens is appended to them, which is what a
    prefill in chunks wants and what scoring after a generation does by mistake. The rule:
    such a pass continues a prefill, and does not warn, only if the cache's latest write
    was itself a pass of several tokens under plain inference mode and nothing moved the
    cache since (its fill is where that pass left it, ``KVCache.chunk_end``). After a decode
    step, a pass under the flag (``attn.generate``, however few tokens it made, and
    ``attn.cached_inference``), a rewind, a select or a fork, it warns once per process. A
    decode step (one token) and a pass onto an empty cache never warn. Two plain passes of
    several tokens in a row cannot be told from a prefill in two chunks, so they do not
    warn; to continue a sequence on purpose in any other case, use the flag.
    """
    if compiled:
        compat.warn_compiled_inference_decision()
    enabled = torch.is_inference_mode_enabled()
    if enabled and num_tokens > 1:
        filled = cache.size  # one host read, in multi-token passes only (never in a decode step)
        if filled and filled != cache.chunk_end:
            compat.warn_inference_mode_onto_filled_cache(filled, num_tokens)
        cache.chunk_end = filled + num_tokens
    return enabled
