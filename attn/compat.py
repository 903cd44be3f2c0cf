"""The compat layer: which torch release is installed, and what it can do with the cache decision.

This is the only module that knows about torch versions, and all it knows is them. It
answers, per release, how the inference-mode half of the cache decision
(``attn.policy.uses_cache``) runs under ``torch.compile``: whether it could live inside a
graph with a guard that tells the kinds of pass apart, and what it costs where it cannot
(graph breaks per forward). No release today can; the table ``RELEASES`` says why for each,
and sits next to the probe that proves it (``probe_is_inference_trace``), which the version
matrix in ``compat/`` runs on every release the table names.

The same table says whether a model sharded with torch.distributed (FSDP2, tensor
parallelism) may run under inference mode (``fsdp_inference_mode``,
``tensor_parallel_inference_mode``); ``attn.distributed.probe_distributed_inference_mode``
proves the claim on the installed release, and ``attn.context.generation_fallback`` acts on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = [
    "FIX",
    "FSDP_INFERENCE_MODE_REASON",
    "RELEASES",
    "TENSOR_PARALLEL_INFERENCE_MODE_REASON",
    "ProbeResult",
    "ReleaseSupport",
    "TorchVersion",
    "compat_report",
    "compile_regions_supported",
    "eager_only",
    "parse_torch_version",
    "probe_is_inference_trace",
    "release_support",
    "torch_version",
]


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


def compile_regions_supported() -> bool:
    """Can ``attn.regions.compile_region`` functions be compiled once and reused on the installed torch?"""
    return torch_version().release >= COMPILE_REGIONS_FIRST and hasattr(torch.compiler, "nested_compile_region")


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


def compat_report(probe: bool = False) -> str:
    """A human-readable report: the torch version and its row of the release table (the policy
    in force is ``attn.policy.policy_report``'s)."""
    version = torch_version()
    row = release_support(version)
    lines = [
        f"torch:               {torch.__version__} (parsed {version.release})",
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
        table = (row.traces_is_inference, row.decides_in_graph)
        agrees = "agrees" if (result.traced, result.decides_in_graph) == table else "DISAGREES with the table"
        lines.append(f"probe (fullgraph):   {measured}; {agrees}")
    return "\n".join(lines)
