"""Will this forward pass touch the KV-cache? ``uses_cache`` is the one function that answers.

The policy in force (``CachePolicy``) is resolved once per process: ``set_cache_policy()``,
then the ``ATTN_CACHE_POLICY`` environment variable, then ``INFERENCE``, the default on every
release. The warnings about passes that may not do what their author meant (``CompatWarning``,
once per process, at the user's line: ``warn_once``) live here too.

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

import enum
import os
import sys
import warnings
from typing import NamedTuple

import torch

from attn import compat
from attn.compat import FIX, TorchVersion, release_support, torch_version
from attn.kv_cache import CacheState

__all__ = [
    "DEFAULT_POLICY",
    "ENV_VAR",
    "CachePolicy",
    "CompatWarning",
    "PolicyDecision",
    "cache_policy",
    "explicit_decision",
    "inference_mode_decides",
    "policy_report",
    "set_cache_policy",
    "uses_cache",
    "warn_once",
]

# -- the policy in force, once per process ------------------------------------------------

ENV_VAR = "ATTN_CACHE_POLICY"


class CompatWarning(UserWarning):
    """Warns about how the installed torch release affects KV-cache behaviour.

    Filter it like any warning category::

        warnings.filterwarnings("ignore", category=attn.CompatWarning)
    """


class CachePolicy(str, enum.Enum):
    """How a forward pass decides whether to use the KV-cache."""

    INFERENCE = "inference"
    """The default: use the cache when the flag is on or the pass runs under inference mode."""
    FLAG = "flag"
    """Use the cache only when the explicit flag (``cached_inference``, ``kv_cache_mode``) is on."""


DEFAULT_POLICY = CachePolicy.INFERENCE


class PolicyDecision(NamedTuple):
    """The cache policy in force, where it came from, and why."""

    policy: CachePolicy
    source: str
    """``"default"``, ``"environment"`` or ``"override"``."""
    reason: str
    torch_version: TorchVersion


def _to_policy(value: CachePolicy | str, origin: str) -> CachePolicy:
    if isinstance(value, CachePolicy):
        return value
    try:
        return CachePolicy(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(repr(p.value) for p in CachePolicy)
        raise ValueError(f"{origin} is {value!r}, which is not a cache policy; use one of {choices}") from None


def _resolve(override: CachePolicy | None) -> PolicyDecision:
    version = torch_version()
    if override is not None:
        return PolicyDecision(override, "override", "set by attn.policy.set_cache_policy()", version)
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        policy = _to_policy(env, f"environment variable {ENV_VAR}")
        return PolicyDecision(policy, "environment", f"set by {ENV_VAR}={env}", version)
    return PolicyDecision(
        DEFAULT_POLICY,
        "default",
        "the default on every release: the flag or inference mode decides, in eager code",
        version,
    )


_decision: PolicyDecision = _resolve(None)


_warned: set[str] = set()


def cache_policy() -> PolicyDecision:
    """The cache policy in force for this process, where it came from and why.

    Example::

        >>> attn.policy.cache_policy().policy
        <CachePolicy.FLAG: 'flag'>
    """
    return _decision


def active_policy() -> CachePolicy:
    """The policy in force; read on every forward pass (a module global, compile-friendly)."""
    return _decision.policy


def set_cache_policy(policy: CachePolicy | str | None) -> PolicyDecision:
    """Overrides the cache policy for this process; ``None`` returns to env var or default.

    Changing the policy makes compiled models recompile on their next call (dynamo guards on
    it).

    Returns:
        The decision now in force.
    """
    global _decision
    override = None if policy is None else _to_policy(policy, "set_cache_policy(policy)")
    _decision = _resolve(override)
    return _decision


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside attn and torch."""
    frame = sys._getframe(2)  # the caller of warnings.warn's caller
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
        frame = frame.f_back
        level += 1
    return level


def warn_once(key: str, message: str) -> None:
    """Warns once per process, at the user's line (not at a line inside attn or torch)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, CompatWarning, stacklevel=_user_stacklevel())


def _reset_warnings() -> None:
    """Forgets which once-per-process warnings were given (for tests)."""
    _warned.clear()


def warn_inference_mode_ignored() -> None:
    """A FLAG-policy pass ran in inference mode without the flag (called in eager code)."""
    warn_once(
        "inference-mode-ignored",
        f"a forward pass ran under torch.inference_mode() with KV-caches set up, but the "
        f"cache policy is FLAG ({_decision.reason}), so it did not use or change the cache. "
        "To generate with the cache, use attn.cached_inference(model) (or drop the FLAG "
        "policy: by default inference mode uses the cache); to score without it, wrap the "
        "pass in attn.disable_kv_cache(model).",
    )


def warn_compiled_inference_decision() -> None:
    """A compiled forward met the inference-mode test, which runs in eager code."""
    row = release_support(_decision.torch_version)
    warn_once(
        "compiled-inference-decision",
        f"torch {_decision.torch_version} cannot decide by inference mode inside a compiled "
        f"graph ({row.reason}), so a compiled forward with KV-caches set up and no flag makes "
        f"that decision in eager code: {row.graph_breaks_per_forward} graph break per forward, "
        f"same results as eager. With fullgraph=True it fails instead; {FIX}.",
    )


def warn_inference_mode_onto_filled_cache(filled: int, num_tokens: int) -> None:
    """An inference-mode pass of several tokens continues a cache that holds a finished
    sequence (``attn.policy.inference_mode_decides`` says when)."""
    warn_once(
        "inference-mode-onto-filled-cache",
        f"a forward pass of {num_tokens} tokens per row ran under torch.inference_mode() onto "
        f"a KV-cache that already holds {filled} tokens of an earlier sequence (a generation, a "
        "decode step, a pass under the flag or a rewind ended it), so it was appended to that "
        "sequence. To score without the cache, run it under torch.no_grad() or inside "
        "attn.disable_kv_cache(model); to start a new sequence, call model.reset_caches() "
        "first; to continue on purpose, use attn.cached_inference(model), which never warns.",
    )


def policy_report() -> str:
    """The policy lines of ``attn info``: the policy in force and why, and how to change it."""
    decision = cache_policy()
    return "\n".join(
        (
            f"cache policy:        {decision.policy.value} ({decision.source}): {decision.reason}",
            "usage:               torch.inference_mode() passes use the cache; torch.no_grad() and grad passes"
            " leave it alone",
            f"override:            {ENV_VAR}=inference|flag or attn.policy.set_cache_policy()",
        )
    )


# -- the decision, per forward --------------------------------------------------------------


def uses_cache(state: CacheState, num_tokens: int, *, warn: bool = True) -> bool:
    """Will a pass of ``num_tokens`` new tokens per row, run now, use the caches of ``state``?

    The whole rule, for eager callers. ``TransformerDecoder.forward``, which may be compiled,
    makes the same decision in two calls, so that the inference-mode test is a graph break of
    its own frame (one per forward) rather than of a nested call (one per frame on the way)::

        use_cache = explicit_decision(state)
        if use_cache is None:
            use_cache = inference_mode_decides(state, num_tokens, torch.compiler.is_compiling())

    Args:
        state: the model's ``CacheState``: its caches (none until set up) and its explicit
            flag, ``mode``: ``None`` (decide by the pass), ``True`` (on), ``False`` (off:
            never use the cache).
        num_tokens: tokens per row the pass brings (to warn about scoring onto a cache that
            a decode loop left filled).
        warn: ``False`` to ask about a pass without running one (no warnings).

    Raises:
        RuntimeError: the flag is on and grad is enabled.
    """
    decision = explicit_decision(state, warn=warn)
    if decision is None:
        decision = inference_mode_decides(state, num_tokens if warn else 1, False)
    return decision


def explicit_decision(state: CacheState, *, warn: bool = True) -> bool | None:
    """Rules 1-3 and the flag: ``True``/``False`` where they decide, ``None`` where inference
    mode does. Traceable: reads only Python state and the grad mode, which dynamo guards."""
    flag = state.mode
    if not state.caches or flag is False:
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
    if active_policy() is CachePolicy.FLAG:
        if warn and not torch.compiler.is_compiling() and torch.is_inference_mode_enabled():
            warn_inference_mode_ignored()
        return False
    return None


@compat.eager_only(
    "attn tests torch.inference_mode() in eager code to decide whether this pass uses the KV-cache; "
    f"{compat.FIX}; score inside attn.disable_kv_cache(model), or set ATTN_CACHE_POLICY=flag"
)
def inference_mode_decides(state: CacheState, num_tokens: int, compiled: bool) -> bool:
    """Rule 4's second half: is inference mode on? Always runs in eager code; ``compiled``
    says a compiled forward called it (pass ``torch.compiler.is_compiling()``).

    It also warns about the scoring trap. Under plain inference mode (no flag) a pass of
    several tokens onto a cache that holds tokens is appended to them, which is what a
    prefill in chunks wants and what scoring after a generation does by mistake. The rule:
    such a pass continues a prefill, and does not warn, only if the cache's latest write
    was itself a pass of several tokens under plain inference mode and nothing moved the
    cache since (its fill is where that pass left it, ``CacheState.chunk_end``). After a decode
    step, a pass under the flag (``attn.generate``, however few tokens it made, and
    ``attn.cached_inference``), a rewind, a select or a fork, it warns once per process. A
    decode step (one token) and a pass onto an empty cache never warn. Two plain passes of
    several tokens in a row cannot be told from a prefill in two chunks, so they do not
    warn; to continue a sequence on purpose in any other case, use the flag.
    """
    if compiled:
        warn_compiled_inference_decision()
    enabled = torch.is_inference_mode_enabled()
    if enabled and num_tokens > 1:
        filled = state.size  # one host read, in multi-token passes only (never in a decode step)
        if filled and filled != state.chunk_end:
            warn_inference_mode_onto_filled_cache(filled, num_tokens)
        state.chunk_end = filled + num_tokens
    return enabled
