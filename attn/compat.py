"""The compat layer: which torch release is installed, and which cache policy follows.

This is the only module that knows about torch versions. It answers one question for the
rest of the package: how does a forward pass decide whether to use the KV-cache?

- ``CachePolicy.INFERENCE``: by the input itself (``x.is_inference()``, true under
  ``torch.inference_mode()``). Needs no work from the user, but ``torch.compile`` can trace
  ``is_inference()`` on few releases.
- ``CachePolicy.FLAG``: by an explicit flag that ``attn.kv_cache_mode`` /
  ``attn.cached_inference`` set. Compiles everywhere.

The policy in force is resolved once per process, in this order: ``set_cache_policy()``,
then the ``ATTN_CACHE_POLICY`` environment variable, then the default for the installed
release from ``RELEASES``. The table sits next to the probe that proves it
(``probe_is_inference_trace``); the version matrix in ``compat/`` runs that probe on every
release the table names.
"""

from __future__ import annotations

import enum
import os
import re
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "ENV_VAR",
    "RELEASES",
    "CachePolicy",
    "CompatWarning",
    "PolicyDecision",
    "ProbeResult",
    "ReleaseSupport",
    "TorchVersion",
    "cache_policy",
    "compat_report",
    "parse_torch_version",
    "probe_is_inference_trace",
    "release_support",
    "set_cache_policy",
    "torch_version",
]

ENV_VAR = "ATTN_CACHE_POLICY"


class CompatWarning(UserWarning):
    """Warns about how the installed torch release affects KV-cache behaviour.

    Filter it like any warning category::

        warnings.filterwarnings("ignore", category=attn.CompatWarning)
    """


class CachePolicy(str, enum.Enum):
    """How a forward pass decides whether to use the KV-cache."""

    INFERENCE = "inference"
    """Use the cache when the attention input is an inference tensor."""
    FLAG = "flag"
    """Use the cache when the explicit flag (``kv_cache_mode``) is on."""


class TorchVersion(NamedTuple):
    """A torch version parsed into numbers: ``"2.13.0+cpu"`` is ``(2, 13, 0)``.

    Compare the tuples, never the strings: ``(2, 10, 0) > (2, 8, 0)``. ``pre`` keeps a
    pre-release or dev tag (``"a0"``, ``"rc1"``, ``"dev20261101"``) and ``local`` the local
    tag (``"cpu"``, ``"git1234"``); neither takes part in the release-table lookup, so a
    nightly of 2.16 is looked up as 2.16.
    """

    major: int
    minor: int
    micro: int
    pre: str | None = None
    local: str | None = None

    @property
    def release(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.micro)

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.micro}"
        if self.pre:
            text += f".{self.pre}" if self.pre.startswith("dev") else self.pre
        if self.local:
            text += f"+{self.local}"
        return text


_VERSION_RE = re.compile(
    r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?"  # release: 2.13 or 2.13.0
    r"((?:a|b|rc)\d+)?"  # pre-release: 2.6.0a0, 2.7.0rc1
    r"(?:\.?(dev\d+))?"  # dev build: 2.16.0.dev20261101
    r"(?:\+([0-9A-Za-z.\-_]+))?\s*$"  # local tag: +cpu, +cu128, +git1234
)


def parse_torch_version(text: str) -> TorchVersion:
    """Parses a torch version string into numbers.

    Example::

        >>> parse_torch_version("2.16.0.dev20261101")
        TorchVersion(major=2, minor=16, micro=0, pre='dev20261101', local=None)

    Raises:
        ValueError: ``text`` is not a version string.
    """
    match = _VERSION_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"cannot parse torch version {text!r}: expected MAJOR.MINOR[.MICRO] with optional "
            "pre-release, .devN and +local parts, e.g. '2.13.0+cpu' or '2.16.0.dev20261101'"
        )
    major, minor, micro, pre, dev, local = match.groups()
    tags = [tag for tag in (pre, dev) if tag]
    return TorchVersion(int(major), int(minor), int(micro or 0), ".".join(tags) or None, local)


def torch_version() -> TorchVersion:
    """The installed torch release, parsed."""
    return parse_torch_version(torch.__version__)


@dataclass(frozen=True)
class ReleaseSupport:
    """What one range of torch releases can do, and the cache policy it gets by default.

    Attributes:
        first: first release of the range (inclusive).
        last: first release after the range (exclusive), or ``None`` for open-ended.
        traces_is_inference: does ``torch.compile(fullgraph=True)`` trace ``x.is_inference()``?
        default_policy: the policy this range gets when nothing overrides it.
        reason: why, in a sentence a user can act on.
    """

    first: tuple[int, int, int]
    last: tuple[int, int, int] | None
    traces_is_inference: bool
    default_policy: CachePolicy
    reason: str

    def contains(self, version: TorchVersion) -> bool:
        return self.first <= version.release and (self.last is None or version.release < self.last)

    @property
    def label(self) -> str:
        first = ".".join(map(str, self.first[:2]))
        if self.last is None:
            return f">= {first}"
        last = ".".join(map(str, self.last[:2]))
        return f"{first} <= torch < {last}" if self.first > (0, 0, 0) else f"< {last}"


# The one table of what each torch release does with `x.is_inference()` under compile.
# Every row is proven on a leg of the version matrix (compat/matrix.toml); a test checks
# that each leg's expectations resolve through this table.
RELEASES: tuple[ReleaseSupport, ...] = (
    ReleaseSupport(
        first=(0, 0, 0),
        last=(2, 6, 0),
        traces_is_inference=False,
        default_policy=CachePolicy.FLAG,
        reason=(
            "dynamo cannot trace Tensor.is_inference() before torch 2.6 "
            "(fullgraph fails: 'torch.* op returned non-Tensor bool')"
        ),
    ),
    ReleaseSupport(
        first=(2, 6, 0),
        last=(2, 8, 0),
        traces_is_inference=True,
        default_policy=CachePolicy.FLAG,
        reason=(
            "dynamo traces Tensor.is_inference() on torch 2.6 and 2.7 but guards only on the "
            "input's dispatch keys, so a compiled graph is reused for the wrong kind of pass: "
            "measured on 2.6.0 and 2.7.1 (stale-graph check in compat/legs.py), a no_grad pass "
            "over token ids made under inference mode, then an inference-mode decode loop "
            "calling model(ids), skips the cache write that eager does (eager, aot_eager and "
            "inductor backends, with and without fullgraph)"
        ),
    ),
    ReleaseSupport(
        first=(2, 8, 0),
        last=None,
        traces_is_inference=False,
        default_policy=CachePolicy.FLAG,
        reason=(
            "from torch 2.8 dynamo turns inference mode off while compiling and graph-breaks "
            "on Tensor.is_inference() by design (pytorch/pytorch#149321)"
        ),
    ),
)


def release_support(version: TorchVersion | str | None = None) -> ReleaseSupport:
    """The row of ``RELEASES`` that covers ``version`` (default: the installed torch)."""
    if version is None:
        version = torch_version()
    elif isinstance(version, str):
        version = parse_torch_version(version)
    for row in RELEASES:
        if row.contains(version):
            return row
    raise AssertionError(f"RELEASES does not cover torch {version}")  # the table is total


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
    row = release_support(version)
    if override is not None:
        return PolicyDecision(override, "override", "set by attn.compat.set_cache_policy()", version)
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        policy = _to_policy(env, f"environment variable {ENV_VAR}")
        return PolicyDecision(policy, "environment", f"set by {ENV_VAR}={env}", version)
    return PolicyDecision(row.default_policy, "default", row.reason, version)


_decision: PolicyDecision = _resolve(None)
_warned: set[str] = set()


def cache_policy() -> PolicyDecision:
    """The cache policy in force for this process, where it came from and why.

    Example::

        >>> attn.compat.cache_policy().policy
        <CachePolicy.FLAG: 'flag'>
    """
    return _decision


def active_policy() -> CachePolicy:
    """The policy in force; read on every forward pass (a module global, compile-friendly)."""
    return _decision.policy


def set_cache_policy(policy: CachePolicy | str | None) -> PolicyDecision:
    """Overrides the cache policy for this process; ``None`` returns to env var or default.

    Changing the policy makes compiled models recompile on their next call (dynamo guards on
    it). Forcing ``INFERENCE`` on a release that cannot trace ``is_inference()`` warns once.

    Returns:
        The decision now in force.
    """
    global _decision
    override = None if policy is None else _to_policy(policy, "set_cache_policy(policy)")
    _decision = _resolve(override)
    warn_if_inference_untraceable()
    return _decision


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, CompatWarning, stacklevel=4)


def _reset_warnings() -> None:
    """Forgets which once-per-process warnings were given (for tests)."""
    _warned.clear()


def warn_if_inference_untraceable() -> None:
    """Warns once when ``INFERENCE`` is forced on a release that cannot compile it."""
    row = release_support(_decision.torch_version)
    if _decision.policy is CachePolicy.INFERENCE and not row.traces_is_inference:
        _warn_once(
            "forced-inference",
            f"the INFERENCE cache policy is {_decision.reason[0].lower() + _decision.reason[1:]} "
            f"on torch {_decision.torch_version}, where {row.reason}: eager code is correct, "
            "but torch.compile will graph-break at every attention layer (and fullgraph=True "
            "fails). Use the FLAG policy with attn.cached_inference(model) to compile.",
        )


def warn_on_cache_setup() -> None:
    """Called when caches are set up: tells a user on a FLAG-default release what to do."""
    if _decision.source == "default" and _decision.policy is CachePolicy.FLAG:
        _warn_once(
            "flag-default",
            f"attn uses the FLAG cache policy on torch {_decision.torch_version}: "
            f"{_decision.reason}. torch.inference_mode() alone does not use the KV-cache "
            "here; wrap generation in attn.cached_inference(model), which caches on every "
            f"torch release, eager or compiled (set {ENV_VAR}=flag to silence this, or "
            f"{ENV_VAR}=inference to decide by inference mode in eager code).",
        )
    warn_if_inference_untraceable()


def warn_inference_mode_ignored() -> None:
    """Called (eagerly) when a FLAG-policy pass ran in inference mode without the flag."""
    _warn_once(
        "inference-mode-ignored",
        f"a forward pass ran under torch.inference_mode() with KV-caches set up, but the "
        f"cache policy is FLAG ({_decision.reason}), so it did not use or change the cache. "
        "To generate with the cache, use attn.cached_inference(model); to score without it, "
        "wrap the pass in attn.disable_kv_cache(model) to silence this warning.",
    )


class ProbeResult(NamedTuple):
    """Outcome of compiling the ``is_inference()`` probe on the installed torch."""

    traced: bool
    """Did ``fullgraph=True`` trace it and give eager's result?"""
    backend: str
    error: str | None
    """The error text where tracing failed (first line), else ``None``."""


def probe_is_inference_trace(backend: str = "eager") -> ProbeResult:
    """Compiles, with ``fullgraph=True``, a function that branches on ``x.is_inference()``.

    The function writes a preallocated buffer when its input is an inference tensor: the
    shape of a KV-cache write. Tracing succeeds only if dynamo can evaluate
    ``is_inference()``; a traced result also has to match eager on an inference input and
    on a normal one.
    """

    def write_if_inference(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        if x.is_inference():
            buffer.copy_(x)
        return x + 1

    compiled = torch.compile(write_if_inference, fullgraph=True, backend=backend)
    buffer = torch.zeros(4)
    try:
        with torch.inference_mode():
            compiled(torch.arange(4.0), buffer)
        wrote_under_inference = bool(torch.equal(buffer, torch.arange(4.0)))
        buffer.zero_()
        with torch.no_grad():
            compiled(torch.arange(4.0), buffer)
        wrote_under_no_grad = bool(buffer.any())
    except Exception as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return ProbeResult(False, backend, f"{type(error).__module__}.{type(error).__name__}: {first_line}")
    if not wrote_under_inference or wrote_under_no_grad:
        return ProbeResult(
            False,
            backend,
            f"compiled without error but gave wrong results (wrote under inference mode: "
            f"{wrote_under_inference}, wrote under no_grad: {wrote_under_no_grad})",
        )
    return ProbeResult(True, backend, None)


def compat_report(probe: bool = False) -> str:
    """A human-readable report: torch version, policy in force and why, the release table."""
    decision = cache_policy()
    row = release_support(decision.torch_version)
    lines = [
        f"torch:               {torch.__version__} (parsed {decision.torch_version.release})",
        f"cache policy:        {decision.policy.value} ({decision.source})",
        f"why:                 {decision.reason}",
        f"release range:       torch {row.label}",
        f"traces is_inference: {'yes' if row.traces_is_inference else 'no'} (release table)",
    ]
    if probe:
        result = probe_is_inference_trace()
        measured = "yes" if result.traced else f"no ({result.error})"
        agrees = "agrees" if result.traced == row.traces_is_inference else "DISAGREES with the table"
        lines.append(f"probe (fullgraph):   {measured}; {agrees}")
    lines.append(f"override:            {ENV_VAR}=inference|flag or attn.compat.set_cache_policy()")
    return "\n".join(lines)
