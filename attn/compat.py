"""The compat layer: which torch release is installed, and what it can do with the cache decision.

This is the only module that knows about torch versions. It answers, per release, how the
inference-mode half of the cache decision (``attn.policy.uses_cache``) runs under
``torch.compile``: whether it could live inside a graph with a guard that tells the kinds of
pass apart, and what it costs where it cannot (graph breaks per forward). No release today
can; the table ``RELEASES`` says why for each, and sits next to the probe that proves it
(``probe_is_inference_trace``), which the version matrix in ``compat/`` runs on every release
the table names.

Policies (``CachePolicy``), resolved once per process: ``set_cache_policy()``, then the
``ATTN_CACHE_POLICY`` environment variable, then ``INFERENCE``, the default on every release.

The same table says whether a model sharded with torch.distributed (FSDP2, tensor
parallelism) may run under inference mode (``fsdp_inference_mode``,
``tensor_parallel_inference_mode``); where it may not, ``attn.generate`` runs it under
``torch.no_grad()`` with the explicit flag (``generation_fallback``), and
``probe_distributed_inference_mode`` proves the claim on the installed release.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from attn.errors import first_line

__all__ = [
    "DEFAULT_POLICY",
    "ENV_VAR",
    "FIX",
    "FSDP_INFERENCE_MODE_REASON",
    "RELEASES",
    "TENSOR_PARALLEL_INFERENCE_MODE_REASON",
    "CachePolicy",
    "CompatWarning",
    "DistributedProbeResult",
    "FsdpApi",
    "PolicyDecision",
    "ProbeResult",
    "ReleaseSupport",
    "TorchVersion",
    "cache_policy",
    "compat_report",
    "compile_region",
    "compile_regions",
    "compile_regions_supported",
    "fsdp_api",
    "fsdp_runs_on",
    "generation_fallback",
    "gloo_reduce_scatter_averages",
    "parse_torch_version",
    "probe_distributed_inference_mode",
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
    """The default: use the cache when the flag is on or the pass runs under inference mode."""
    FLAG = "flag"
    """Use the cache only when the explicit flag (``cached_inference``, ``kv_cache_mode``) is on."""


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


FIX = (
    "for fullgraph=True, torch.export or CUDA graphs, wrap generation in "
    "attn.cached_inference(model): the explicit flag needs no inference-mode test and compiles "
    "without a graph break on every release"
)


@dataclass(frozen=True)
class ReleaseSupport:
    """What one range of torch releases can do with the inference-mode test under compile.

    Attributes:
        first: first release of the range (inclusive).
        last: first release after the range (exclusive), or ``None`` for open-ended.
        traces_is_inference: does ``torch.compile(fullgraph=True)`` trace ``x.is_inference()``?
        guards_is_inference: where it traces, does the compiled graph tell the kinds of pass
            apart (no stale graph reused for the wrong one)?
        reason: why, in a sentence a user can act on.
        fsdp_inference_mode: can a model sharded with FSDP2 (``fully_shard``) run a forward
            under inference mode and train after it? (Why not: ``FSDP_INFERENCE_MODE_REASON``.)
        tensor_parallel_inference_mode: can a model with tensor-parallel (DTensor) linears
            run a forward under inference mode? (Why not: ``TENSOR_PARALLEL_INFERENCE_MODE_REASON``.)
    """

    first: tuple[int, int, int]
    last: tuple[int, int, int] | None
    traces_is_inference: bool
    guards_is_inference: bool
    reason: str
    fsdp_inference_mode: bool
    tensor_parallel_inference_mode: bool

    @property
    def decides_in_graph(self) -> bool:
        """Could the inference-mode test live inside a fullgraph compile, correctly guarded?"""
        return self.traces_is_inference and self.guards_is_inference

    @property
    def graph_breaks_per_forward(self) -> int:
        """Graph breaks a compiled forward takes for the inference-mode test (0 with the flag)."""
        return 0 if self.decides_in_graph else 1

    def contains(self, version: TorchVersion) -> bool:
        return self.first <= version.release and (self.last is None or version.release < self.last)

    @property
    def label(self) -> str:
        first = ".".join(map(str, self.first[:2]))
        if self.last is None:
            return f">= {first}"
        last = ".".join(map(str, self.last[:2]))
        return f"{first} <= torch < {last}" if self.first > (0, 0, 0) else f"< {last}"


# Measured with FSDP2 on CPU (gloo, 2 processes) on 2.7.1, 2.8.0, 2.13.0 and 2.15.0; FSDP2 does
# not run on CPU before 2.7 (fsdp_runs_on), and its code there allocates the same way.
FSDP_INFERENCE_MODE_REASON = (
    "FSDP2 allocates a module's unsharded parameters in its first forward and refills them in "
    "place in every forward after: allocated under inference mode they are inference tensors, "
    "and the next forward outside it (no_grad scoring, the grad step) fails with 'Inplace update "
    "to inference tensor outside InferenceMode is not allowed' (upstream fixes such as "
    "pytorch/pytorch#197327 let FSDP2 run under inference mode, not leave it)"
)

# Measured with tensor-parallel linears on CPU (gloo, 2 processes) on 2.5.1; 2.6.0 on runs them.
TENSOR_PARALLEL_INFERENCE_MODE_REASON = (
    "before torch 2.6 DTensor has no sharding rule for the aten.matmul that a linear without "
    "bias becomes under inference mode, so a tensor-parallel q/k/v, o or MLP projection fails "
    "there with 'Operator aten.matmul.default does not have a sharding strategy registered'"
)

UNTRACED_BEFORE_2_6_REASON = (
    "dynamo cannot trace Tensor.is_inference() before torch 2.6 "
    "(fullgraph fails: 'torch.* op returned non-Tensor bool')"
)
UNGUARDED_2_6_REASON = (
    "dynamo traces Tensor.is_inference() on torch 2.6 and 2.7 but guards only on the "
    "input's dispatch keys, which look the same for an inference tensor outside "
    "inference mode and a normal tensor inside it, so a graph compiled for one kind of "
    "pass is reused for the other (the probe's stale-graph sequences)"
)
BREAKS_FROM_2_8_REASON = (
    "from torch 2.8 dynamo turns inference mode off while compiling and graph-breaks "
    "on Tensor.is_inference() by design (pytorch/pytorch#149321)"
)

# The one table of what each torch release does with the inference-mode test under compile,
# and with sharded models under inference mode. Every row is proven on a leg of the version
# matrix (compat/matrix.toml); a test checks that each leg's expectations resolve through this
# table, and the distributed tests run probe_distributed_inference_mode against it.
# fmt: off
RELEASES: tuple[ReleaseSupport, ...] = (
    #              first      last       traces guards reason                      fsdp   tensor parallel
    ReleaseSupport((0, 0, 0), (2, 6, 0), False, False, UNTRACED_BEFORE_2_6_REASON, False, False),
    ReleaseSupport((2, 6, 0), (2, 8, 0), True,  False, UNGUARDED_2_6_REASON,       False, True),
    ReleaseSupport((2, 8, 0), None,      False, False, BREAKS_FROM_2_8_REASON,     False, True),
)
# fmt: on
DEFAULT_POLICY = CachePolicy.INFERENCE


def eager_only(reason: str) -> Any:
    """Decorator: the function always runs in eager code; a compiled caller graph-breaks
    there, and a ``fullgraph`` one fails with ``reason`` in the error where the release can
    show one (``torch.compiler.disable(reason=...)``, torch 2.8 and later; detected, not
    looked up)."""

    def wrap(fn: Any) -> Any:
        try:
            return torch.compiler.disable(fn, reason=reason)
        except TypeError:  # no reason= before torch 2.8
            return torch.compiler.disable(fn)

    return wrap


# The first release on which a compiled decode step reuses one compiled decoder layer for every
# layer (torch.compiler.nested_compile_region around a layer that writes its KV-cache): measured
# on 2.13.0 and 2.15.0, tokens equal to eager's. Earlier releases compile every layer, as before.
COMPILE_REGIONS_FIRST = (2, 13, 0)
_regions_on = False


def compile_regions_supported() -> bool:
    """Can ``compile_region`` functions be compiled once and reused on the installed torch?"""
    return torch_version().release >= COMPILE_REGIONS_FIRST and hasattr(torch.compiler, "nested_compile_region")


def compile_region(fn: Any) -> Any:
    """Decorator: inside ``compile_regions()``, torch.compile traces and compiles ``fn`` once and
    calls that code for every call in the graph (a decoder layer: once for all layers, where
    ``compile_regions_supported()``). Everywhere else, eager or compiled, ``fn`` runs as written."""
    if not compile_regions_supported():
        return fn
    region = torch.compiler.nested_compile_region(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _regions_on and torch.compiler.is_compiling():
            return region(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def compile_regions() -> Iterator[None]:
    """Graphs compiled for calls inside compile each ``compile_region`` function once
    (``attn.compile_for_decode``'s step); a graph compiled outside never does. Dynamo guards
    on the switch: a graph is never reused across it."""
    global _regions_on
    before, _regions_on = _regions_on, True
    try:
        yield
    finally:
        _regions_on = before


def _recompile_limit_name() -> str:
    """``cache_size_limit`` before torch 2.7, ``recompile_limit`` from 2.7 (the old name an alias)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


def recompile_limit() -> int:
    """Dynamo's recompile limit now: graphs per code object."""
    return getattr(torch._dynamo.config, _recompile_limit_name())


def decode_step_options(recompile_limit: int) -> dict[str, Any]:
    """Dynamo options for ``attn.compile_for_decode``'s step, for ``torch._dynamo.config.patch``.

    - A module buffer's dim may be traced as a symbol where it is marked dynamic
      (``torch._dynamo.maybe_mark_dynamic``: the KV-cache length). Dynamo keeps every
      parameter and buffer size static unless told otherwise: ``force_parameter_static_shapes``,
      and ``force_nn_module_property_static_shapes`` (torch 2.5.1 needs this one too: there a
      buffer counts as a module property); both exist in every release the matrix covers.
      Unmarked sizes stay static either way (``tests/test_fast_decode.py`` on every leg).
    - The recompile limit, per code object, becomes ``recompile_limit``. It counts every
      graph compiled for one function in the process, whoever compiled it: each model's step
      is another graph of ``TransformerDecoder.forward``, so the ninth model would fail to
      compile (``fullgraph``).
    """
    return {
        "force_parameter_static_shapes": False,
        "force_nn_module_property_static_shapes": False,
        _recompile_limit_name(): recompile_limit,
    }


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
    if override is not None:
        return PolicyDecision(override, "override", "set by attn.compat.set_cache_policy()", version)
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


def _warn_once(key: str, message: str) -> None:
    """Warns once per process, at the user's line (not at a line inside attn or torch)."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, CompatWarning, stacklevel=_user_stacklevel())


def _reset_warnings() -> None:
    """Forgets which once-per-process warnings were given (for tests)."""
    _warned.clear()


def warn_inference_mode_ignored() -> None:
    """A FLAG-policy pass ran in inference mode without the flag (called in eager code)."""
    _warn_once(
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
    _warn_once(
        "compiled-inference-decision",
        f"torch {_decision.torch_version} cannot decide by inference mode inside a compiled "
        f"graph ({row.reason}), so a compiled forward with KV-caches set up and no flag makes "
        f"that decision in eager code: {row.graph_breaks_per_forward} graph break per forward, "
        f"same results as eager. With fullgraph=True it fails instead; {FIX}.",
    )


def warn_inference_mode_onto_filled_cache(filled: int, num_tokens: int) -> None:
    """An inference-mode pass of several tokens continues a cache that holds a finished
    sequence (``attn.policy.inference_mode_decides`` says when)."""
    _warn_once(
        "inference-mode-onto-filled-cache",
        f"a forward pass of {num_tokens} tokens per row ran under torch.inference_mode() onto "
        f"a KV-cache that already holds {filled} tokens of an earlier sequence (a generation, a "
        "decode step, a pass under the flag or a rewind ended it), so it was appended to that "
        "sequence. To score without the cache, run it under torch.no_grad() or inside "
        "attn.disable_kv_cache(model); to start a new sequence, call model.reset_caches() "
        "first; to continue on purpose, use attn.cached_inference(model), which never warns.",
    )


class ProbeResult(NamedTuple):
    """Outcome of compiling the ``is_inference()`` probe on the installed torch."""

    traced: bool
    """Did ``fullgraph=True`` trace it and give eager's results when kinds of pass alternate?"""
    guarded: bool
    """Where traced: did every stale-graph sequence give eager's results too?"""
    backend: str
    error: str | None
    """Why not, in one line (the first line of the error, or the difference), else ``None``."""

    @property
    def decides_in_graph(self) -> bool:
        return self.traced and self.guarded


def _write_if_inference(x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """The shape of a cache decision: write ``buffer`` iff the activation is an inference tensor."""
    h = x * 2  # an activation: an inference tensor exactly when the pass runs in inference mode
    if h.is_inference():
        buffer.copy_(h)
    return h + 1


def _writes(call, passes: list[tuple[str, bool]]) -> list[bool]:
    """Runs ``call`` once per (mode, inference-made input) pass; did each write the buffer?"""
    buffer = torch.zeros(4)
    writes = []
    for mode, inference_input in passes:
        if inference_input:
            with torch.inference_mode():
                x = torch.arange(4.0)
        else:
            x = torch.arange(4.0)
        buffer.zero_()
        with torch.inference_mode() if mode == "inference" else torch.no_grad():
            call(x, buffer)
        writes.append(bool(buffer.any()))
    return writes


# A straightforward alternation, then the stale-graph sequences: the first pass of each
# compiles a graph that a later pass, of the other kind but with the same dispatch keys on
# its input, may reuse.
_PLAIN_PASSES = [("inference", False), ("no_grad", False), ("inference", False)]
_STALE_SEQUENCES = (
    [("no_grad", True), ("inference", False)],
    [("inference", False), ("no_grad", True)],
)


def probe_is_inference_trace(backend: str = "eager") -> ProbeResult:
    """Compiles, with ``fullgraph=True``, a function that branches on ``h.is_inference()``.

    The function writes a preallocated buffer when its activation is an inference tensor:
    the shape of a KV-cache decision. ``traced``: dynamo compiled it and it wrote exactly
    where eager does over inference-mode and no_grad passes. ``guarded``: it also did over
    the stale-graph sequences (a no_grad pass over an input made under inference mode, and
    an inference-mode pass, in both orders, each on a fresh compile).
    """

    def compiled() -> Any:
        torch._dynamo.reset()
        return torch.compile(_write_if_inference, fullgraph=True, backend=backend)

    try:
        want, got = _writes(_write_if_inference, _PLAIN_PASSES), _writes(compiled(), _PLAIN_PASSES)
    except Exception as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return ProbeResult(False, False, backend, f"{type(error).__module__}.{type(error).__name__}: {first_line}")
    if got != want:
        return ProbeResult(False, False, backend, f"compiled without error but wrote {got} where eager wrote {want}")
    for passes in _STALE_SEQUENCES:
        want, got = _writes(_write_if_inference, passes), _writes(compiled(), passes)
        if got != want:
            sequence = " then ".join(f"{mode}{' over an inference-made input' if inf else ''}" for mode, inf in passes)
            return ProbeResult(True, False, backend, f"stale graph: {sequence} wrote {got}, eager {want}")
    return ProbeResult(True, True, backend, None)


# -- sharded models (torch.distributed) ---------------------------------------------------


class FsdpApi(NamedTuple):
    """FSDP2's names, wherever the installed release keeps them."""

    fully_shard: Any
    FSDPModule: type
    MixedPrecisionPolicy: type


def fsdp_api() -> FsdpApi:
    """FSDP2's ``fully_shard``, ``FSDPModule`` and ``MixedPrecisionPolicy``: in
    ``torch.distributed.fsdp`` from torch 2.6, in ``torch.distributed._composable.fsdp``
    before (detected by import, not looked up).

    Imported when first asked for, by the code that shards a model.
    """
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    return FsdpApi(fully_shard, FSDPModule, MixedPrecisionPolicy)


def gloo_reduce_scatter_averages(group: Any) -> bool:
    """Does ``reduce_scatter_tensor(op=ReduceOp.AVG)`` average on this gloo process group?

    Detected with one tiny reduce-scatter (a collective: every rank of ``group`` calls it).
    Measured on CPU with 2 ranks: gloo sums instead, silently, on torch 2.5.1 to 2.8.0, and
    averages on 2.13.0 and 2.15.0; FSDP2 reduces fp32 and bf16 gradients with AVG, so there
    it sums the ranks' gradients where it should average them.
    """
    size = dist.get_world_size(group)
    out = torch.zeros(1)
    dist.reduce_scatter_tensor(out, torch.ones(size), op=dist.ReduceOp.AVG, group=group)
    return bool(out.item() == 1.0)


def fsdp_runs_on(device_type: str) -> bool:
    """Does FSDP2 run on this device type? Detected, not looked up: on CPU it needs
    ``torch.cpu.Stream.record_event`` (torch 2.7 on). Before, it fails on CPU in its first
    forward: "FSDP requires CUDA for streams" (2.5), "'Stream' object has no attribute
    'record_event'" (2.6)."""
    return device_type != "cpu" or hasattr(torch.cpu.Stream, "record_event")


def _loaded_class(name: str, *modules: str) -> type | None:
    """``name`` from the first of ``modules`` already imported, else None (imports nothing)."""
    for module in modules:
        found = getattr(sys.modules.get(module), name, None)
        if found is not None:
            return found
    return None


def generation_fallback(model: nn.Module) -> str | None:
    """Why ``attn.generate`` runs ``model`` under ``torch.no_grad()`` with the explicit cache
    flag rather than under inference mode on the installed release, or ``None``.

    A model sharded with FSDP2 (``fully_shard``) or with tensor-parallel (DTensor) parameters,
    where the release table says that cannot run under inference mode. The passes that use
    the cache, and the tokens, are the same either way. Imports nothing: a model can hold FSDP2
    modules or DTensors only once torch.distributed's modules for them are loaded.
    """
    row = release_support(_decision.torch_version)
    fsdp_module = _loaded_class("FSDPModule", "torch.distributed.fsdp", "torch.distributed._composable.fsdp")
    sharded = fsdp_module is not None and any(isinstance(module, fsdp_module) for module in model.modules())
    if sharded and not row.fsdp_inference_mode:
        return f"a model sharded with FSDP2 cannot generate under inference mode ({FSDP_INFERENCE_MODE_REASON})"
    dtensor = _loaded_class("DTensor", "torch.distributed.tensor")
    split = dtensor is not None and any(isinstance(parameter, dtensor) for parameter in model.parameters())
    if split and not row.tensor_parallel_inference_mode:
        return (
            "a model with tensor-parallel (DTensor) parameters cannot generate under inference mode "
            f"({TENSOR_PARALLEL_INFERENCE_MODE_REASON})"
        )
    return None


def warn_generation_fallback(reason: str) -> None:
    """``attn.generate`` runs a sharded model under no_grad with the flag (``generation_fallback``)."""
    _warn_once(
        f"generation-fallback: {reason.split(' cannot ')[0]}",  # once per kind of model
        f"on torch {_decision.torch_version}, {reason}. attn.generate and attn.score_continuations "
        "run it under torch.no_grad() "
        "with the explicit cache flag instead: the same tokens, the same cache. For a decode loop of "
        "your own on this model, do the same (`with torch.no_grad(), attn.kv_cache_mode(model):`); "
        "a model sharded with attn.distributed.shard_fsdp also takes plain torch.inference_mode() "
        "and attn.cached_inference passes.",
    )


class DistributedProbeResult(NamedTuple):
    """Outcome of ``probe_distributed_inference_mode`` on the installed torch."""

    fsdp_runs: bool
    """Did FSDP2 run a forward and a grad step on the device (no inference mode)?"""
    fsdp_inference_mode: bool
    """Did a grad step after an inference-mode forward work too?"""
    tensor_parallel_inference_mode: bool
    """Did a column-wise parallel linear run under inference mode?"""
    errors: tuple[str, ...]
    """The first line of each error met, in order."""


def probe_distributed_inference_mode(device: torch.device | str = "cpu") -> DistributedProbeResult:
    """Runs tiny sharded linears under inference mode, then a grad step, on ``device``.

    A collective: every rank of the default process group must call it. FSDP2 (two linears,
    ``fully_shard``-ed one by one and together, as a decoder's layers and root are): a grad
    step alone, then an inference-mode forward followed by grad steps. Tensor parallelism (one
    column-wise linear without bias, as the decoder's are): an inference-mode forward.

    Raises:
        RuntimeError: torch.distributed has no default process group.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    if not dist.is_initialized():
        raise RuntimeError(
            "probe_distributed_inference_mode needs torch.distributed: call "
            "torch.distributed.init_process_group() on every rank first, then the probe on every rank"
        )
    device = torch.device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    fully_shard = fsdp_api().fully_shard
    x = torch.ones(2, 3, 8, device=device)  # (b, s, e); the same on every rank
    errors = []

    def fsdp_grad_step(inference_first: bool) -> bool:
        model = nn.Sequential(nn.Linear(8, 8, device=device), nn.Linear(8, 8, device=device))
        for module in (*model, model):  # the root keeps its parameters unsharded after a forward
            fully_shard(module, mesh=mesh)
        try:
            if inference_first:
                with torch.inference_mode():
                    model(x)
            for _ in range(2):
                model(x).sum().backward()
        except Exception as error:
            errors.append(first_line(error))
            return False
        return True

    fsdp_runs = fsdp_grad_step(inference_first=False)
    fsdp_inference_mode = fsdp_runs and fsdp_grad_step(inference_first=True)
    linear = parallelize_module(nn.Linear(8, 8, bias=False, device=device), mesh, ColwiseParallel())
    try:
        with torch.inference_mode():
            linear(x)
        tensor_parallel_inference_mode = True
    except Exception as error:
        errors.append(first_line(error))
        tensor_parallel_inference_mode = False
    return DistributedProbeResult(fsdp_runs, fsdp_inference_mode, tensor_parallel_inference_mode, tuple(errors))


def compat_report(probe: bool = False) -> str:
    """A human-readable report: torch version, policy in force and why, the release table."""
    decision = cache_policy()
    row = release_support(decision.torch_version)
    lines = [
        f"torch:               {torch.__version__} (parsed {decision.torch_version.release})",
        f"cache policy:        {decision.policy.value} ({decision.source}): {decision.reason}",
        "usage:               torch.inference_mode() passes use the cache; torch.no_grad() and grad passes"
        " leave it alone",
        f"release range:       torch {row.label}",
        f"traces is_inference: {'yes' if row.traces_is_inference else 'no'} (release table)",
        f"decides in graph:    {'yes' if row.decides_in_graph else 'no'}: {row.reason}",
        f"compiled cost:       {row.graph_breaks_per_forward} graph break per forward that tests inference mode",
        f"fullgraph/export:    {FIX}",
        f"sharded models:      under inference mode, FSDP2 {'yes' if row.fsdp_inference_mode else 'no'}, tensor "
        f"parallel {'yes' if row.tensor_parallel_inference_mode else 'no'} (release table); where no, "
        "attn.generate runs them under torch.no_grad() with the flag",
    ]
    if probe:
        result = probe_is_inference_trace()
        measured = "yes" if result.decides_in_graph else f"no ({result.error})"
        agrees = (
            "agrees"
            if (result.traced, result.decides_in_graph)
            == (
                row.traces_is_inference,
                row.decides_in_graph,
            )
            else "DISAGREES with the table"
        )
        lines.append(f"probe (fullgraph):   {measured}; {agrees}")
    lines.append(f"override:            {ENV_VAR}=inference|flag or attn.compat.set_cache_policy()")
    return "\n".join(lines)
