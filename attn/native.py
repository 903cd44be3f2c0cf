"""Native CPU kernels, built on first use: ``attn::bf16_matvec``.

A one-row bf16 product (a decode step at batch 1) is bound by reading the weight. Inductor's
reductions widen every bf16 weight to fp32 before multiplying, and oneDNN's matrix-vector
kernel pays a fixed cost a call; ``attn/csrc/bf16_matvec.cpp`` uses AVX512-BF16's dot-product
instruction, four weight rows a pass over the input and prefetches. The 30 layers' products of
the SmolLM2-135M shape, one row, 2 threads, Xeon 6/167: 8.5-8.9 ms (24-25 GB/s) against
14.7-16.2 for inductor's reductions and 15.0-15.8 for ``torch.mv``.

``compile_for_decode`` calls it for its one-row bf16 linears where ``bf16_matvec_available()``:
an x86 CPU with AVX512-BF16, and the extension built. The build (torch's C++ extension builder:
a C++ compiler with OpenMP and ``ninja``) takes about 30 s once per machine and torch release,
then loads from torch's extension cache (``TORCH_EXTENSIONS_DIR``). Where it cannot be built
the step keeps inductor's reductions, with one warning that says why.

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

__all__ = ["bf16_matvec_available", "build_bf16_matvec"]

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
    if not _has_avx512_bf16():
        raise RuntimeError("attn::bf16_matvec needs an x86 CPU with AVX512-BF16; this one has none")
    from torch.utils import cpp_extension

    path = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:  # the pip package's binary, outside PATH in a venv that is not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
        except ImportError:
            pass
    global _built
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
            f"attn: could not build the AVX512-BF16 matrix-vector kernel ({first}); one-row bf16 decode steps of "
            "compile_for_decode use inductor's reductions instead (a C++ compiler with OpenMP and `pip install "
            "ninja` let it build)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
