"""Native CPU kernels, built on first use: ``attn::bf16_matvec``.

A bf16 product of a few rows (a decode step at a small batch) is bound by reading the weight.
Inductor's reductions widen every bf16 weight to fp32 before multiplying, and oneDNN's kernels
pay a fixed cost a call; ``attn/csrc/bf16_matvec.cpp`` uses AVX512-BF16's dot-product
instruction, loads each weight row once for all the rows and prefetches. The 30 layers'
products of the SmolLM2-135M shape, 2 threads, Xeon 6/167: 9.0 ms at one row (24 GB/s), 11.1 at
4, 14.4 at 8, against 14.7-16.3 for inductor's reductions and ``torch.mv`` at one row and 15.5
for oneDNN on packed weights at any of those.

``compile_for_decode`` calls it for its bf16 linears of at most ``BF16_MATVEC_MAX_ROWS`` rows
(and at most its ``max_rows``) where ``bf16_matvec_available()``: an x86 CPU with AVX512-BF16,
and the extension built. The build (torch's C++ extension builder: a C++ compiler with OpenMP
and ``ninja``) takes 8-30 s once per machine and torch release, then loads from torch's
extension cache (``TORCH_EXTENSIONS_DIR``). Where it cannot be built the step keeps inductor's
reductions, with one warning that says why.

Results are fp32 sums rounded to bf16 once, like the other kernels'; the order of the sums
differs, so the last bit of an output can.
"""

from __future__ import annotations

import functools
import os
import shutil
import warnings
from pathlib import Path

import torch

__all__ = ["BF16_MATVEC_MAX_ROWS", "bf16_matvec_available", "build_bf16_matvec"]

BF16_MATVEC_MAX_ROWS = 8
"""Most rows of x ``attn::bf16_matvec`` takes (the kernel's ``kMaxRows``). At 16 rows oneDNN's
product on packed weights, with AMX, was the faster: 15.8 against 25.3 ms for the 30 layers."""

_SOURCE = Path(__file__).with_name("csrc") / "bf16_matvec.cpp"

_LIBRARY = torch.library.Library("attn", "FRAGMENT")  # the namespace attn.packed defines
_LIBRARY.define("bf16_matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _build_then_call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The operator before its CPU kernel is loaded: builds and loads it, then calls it (the
    loaded kernel is the CPU one from then on and this is not reached again)."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise RuntimeError(f"attn::bf16_matvec runs on the CPU only, got x on {x.device} and weight on {weight.device}")
    if _built:
        raise RuntimeError("attn::bf16_matvec was built but registered no CPU kernel")  # not a loop
    build_bf16_matvec()
    return torch.ops.attn.bf16_matvec.default(x, weight, bias)


_built = False
_LIBRARY.impl("bf16_matvec", _build_then_call, "CompositeExplicitAutograd")


@torch.library.register_fake("attn::bf16_matvec")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _has_avx512_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return probe is not None and bool(probe())


def _extension_name() -> str:
    """One build per torch release: an extension is only loadable by the torch it was built with."""
    release = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    return f"attn_bf16_matvec_{release}"


def build_bf16_matvec() -> None:
    """Builds (or loads from torch's extension cache) the kernel behind ``attn::bf16_matvec``.

    Raises:
        RuntimeError: this CPU has no AVX512-BF16, or the build failed (the compiler's message).
    """
    global _built
    if not _has_avx512_bf16():
        raise RuntimeError("attn::bf16_matvec needs an x86 CPU with AVX512-BF16; this one has none")
    if _built:  # loaded in this process: the builder would only re-check its files
        return
    from torch.utils import cpp_extension

    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the pip package's binary, outside PATH in a venv that is not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass
    try:
        cpp_extension.load(
            name=_extension_name(),
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp"],  # OpenMP: at::parallel_for runs on torch's threads
            is_python_module=False,
            verbose=False,
        )
        _built = True
    finally:
        os.environ["PATH"] = path


@functools.cache
def bf16_matvec_available() -> bool:
    """Can ``attn::bf16_matvec`` run here? Builds it on the first call on a CPU with AVX512-BF16;
    a failed build warns once, with the reason, and answers no."""
    if not _has_avx512_bf16():
        return False
    try:
        build_bf16_matvec()
    except Exception as error:  # no compiler, no ninja, an old compiler: the step keeps inductor's kernel
        lines = str(error).strip().splitlines() or [type(error).__name__]
        first = next((line.strip() for line in lines if "error:" in line), lines[0])  # the compiler's, if any
        warnings.warn(
            f"attn: could not build the AVX512-BF16 product kernel ({first}); compile_for_decode's bf16 steps of up "
            "to 8 rows use inductor's reductions instead (a C++ compiler with OpenMP and `pip install ninja` let it "
            "build)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
