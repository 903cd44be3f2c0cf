"""Native CPU kernels, built on first use: ``attn::bf16_matvec``, ``attn::fp32_linear``,
``attn::amx_linear``, ``attn::avx2_linear``, ``attn::invariant_linear``,
``attn::decode_attention``, ``attn::decode_layers``, ``attn::decode_loop``,
``attn::first_argmax``, ``attn::keep_top_k`` and ``attn::running_sums``.

A decode step at a small batch reads every weight once for a few rows, and every cached key and
value once for a few queries: it is bound by memory reads, and by the instructions between
them. C++ kernels (``attn/csrc``) do what inductor's code and the BLAS do not:

- ``attn::bf16_matvec`` (``few_rows_linear.cpp``): bf16 products of 1 to ``BF16_MATVEC_MAX_ROWS``
  rows with AVX512-BF16's dot-product instruction, each weight row loaded once for all the
  rows and prefetched. The 30 layers' products of the SmolLM2-135M shape, 2 threads, Xeon
  6/167: 9.0 ms at one row (24 GB/s), 11.1 at 4, 14.4 at 8, against 14.7-16.3 for inductor's
  reductions and ``torch.mv`` at one row and 15.5 for oneDNN on packed weights at any of those.
  Past 8 rows, passes of 6 rows that take the same 4 weight rows (as ``attn::fp32_linear``),
  for CPUs without AMX: AMD EPYC (Zen 4), the 30 layers and the head, 15.7-17.6 ms at 16 rows
  with the former two passes (rows 0-7, then the rest) against 30.5-35.5 for ``F.linear``, and
  0.87 of that time with passes of 6, their fold inlined and a row of outputs rounded in one
  vector (paired rounds in one process, 2026-12-06).
- ``attn::fp32_linear`` (same file, same loop with FMAs): fp32 products of 1 to
  ``FP32_LINEAR_MAX_ROWS`` rows; ``compile_for_decode`` gives it those past its ``max_rows``
  (inductor's reductions are as fast below). Past 8 rows, passes of 6 rows of 4 weight rows
  each. The former two passes of 3 weight rows (rows 0-7, then the rest) took 32.5 ms (best of
  6) at 16 rows, the 30 layers and the head, weights read from memory, against 41.4 for one
  weight row a pass into all 16 rows, and 32.3-34.0 ms for the 30 layers against 41.0-42.6 for
  MKL's ``F.linear`` on an hour of faster reads; passes of 6 with their fold inlined take 0.86
  of their time at 16 rows (Zen 4, paired rounds in one process).
- ``attn::amx_linear`` (``amx_linear.cpp``): bf16 products of 1 to ``AMX_LINEAR_MAX_ROWS``
  rows with AMX tiles, reading the weight as it is stored. Same shape and machine: 11.6-12.6
  ms at 16 rows against 15.0-15.7 for oneDNN on packed weights, 11.0-12.1 at 8 rows against
  14.0-14.6 for ``attn::bf16_matvec``; it takes over from ``AMX_FROM_ROWS`` rows.
- ``attn::avx2_linear`` (``avx2_linear.cpp``): bf16 and fp32 products of 1 to
  ``AVX2_LINEAR_MAX_ROWS`` rows with AVX2 and FMA, for CPUs without AVX512-BF16 (AMD before Zen 4,
  Intel's client cores, Xeons from Skylake-SP to Ice Lake), where oneDNN widens a bf16 weight
  inside its own kernel (and cannot even pack one without AVX-512): bf16 weights become fp32 in
  registers (a shift and a mask), x once a call. The 30 layers' products of the SmolLM2-135M shape,
  2 threads, AMD EPYC (Zen 1, 22 GB/s two-thread read), median of 9: bf16 16.4 ms at one row (13.0
  GB/s), 21.6 at 4, 85.9 at 16 against 25.0, 88.2 and 345.5 for ``F.linear`` and 54.7, 89.8 and
  124.8 for oneDNN on widened packed copies; fp32 27.1, 28.6 and 74.4 against 41.5, 74.0 and 113.1
  for oneDNN's product.
- ``attn::invariant_linear`` (``invariant_linear.cpp``): bf16 and fp32 products of any rows,
  each row's bits those of the row alone (parity mode's linear, ``attn.parity``): tiles of 16
  rows through ``attn::bf16_matvec``'s and ``attn::fp32_linear``'s loop on a CPU with
  AVX512-BF16, ``attn::avx2_linear``'s elsewhere, each chunk of weight rows taken through every
  tile (``csrc/row_tiles.h``). About the time of one BLAS product of all the rows, half that of
  16-row BLAS products (the figures in ``invariant_linear.cpp``).
- ``attn::decode_attention`` (``decode_attention.cpp``): masked attention of a few queries per
  row over the cache, fp32, bf16 or fp16, with AVX-512: the query heads of one (row, kv head) a
  task, so each key and value row is read once for the group; scores 16 slots at a time (bf16 by
  vdpbf16ps where the CPU has AVX512-BF16), a vectorized softmax. One layer of that shape at 16
  rows and 192 slots, 2 threads: 111-125 us against 199-263 for inductor's reductions
  (``attn.fast_decode.decode_attention``) alone, 196 against 287 inside a bf16 step, for the
  kernel's first version (Xeon 6/167); scores 16 slots at a time then took a layer's 160 slots
  from 170 to 108 us (bf16) and from 262 to 220 (fp32), caches read from memory, best of 8. A
  task a kv head's group, and the next task's values prefetched while the value sums run: bf16
  0.68-0.71 of the time before with caches from memory and 0.61 with one layer's in cache, fp32
  0.83 and 0.71 (Zen 4, paired rounds). ``widen=True`` takes the widening path for bf16 on a CPU
  with AVX512-BF16 too, so tests cover both. ``group`` and ``shared``: rows whose first
  ``shared`` slots copy their group's first row (``fork_caches``; ``CacheState.shared_slots``)
  read those from that row, once for the group: the same bits, a GRPO group's prompt read once
  a step rather than G times.

- ``attn::decode_layers`` (``decode_layers.cpp``): a run of decoder layers' decode step in one
  call, calling the products and the attention above directly (q, k and v, and gate and up, one
  call each: ``*_group``) and doing the work between them (norms, RoPE, the cache write, SiLU,
  residuals) on the calling thread. An eager decode step runs its layers so on a CPU with
  AVX512-BF16 (``TransformerDecoder.native_layers``, ``attn.native_step``), and
  ``compile_for_decode`` runs that eager step rather than compile one: the compiled step spent
  8-10 of its 26-29 ms at 16 rows in Python, guards and small kernels between its products. 30
  layers of the SmolLM2-135M shape at 16 bf16 rows: 14.6-15.0 ms, the sum of their kernels (one
  call a layer, as the op first was; all 30 in one call took 0.4 ms less a step at batch 1).
  On a CPU with AVX2 and no AVX512-BF16 it runs its AVX2 build (``avx2=True``, ``avx2_layers``):
  ``attn::avx2_linear``'s products, and the norms, RoPE, SiLU, residuals and attention of
  ``avx2_layers.cpp``. There the layers as modules spent half an eager bf16 step at batch 1 in
  some 1,900 small ATen ops (Zen 1); with the AVX2 build forced on a Zen 4 (these probes
  answering no AVX-512), a 64-token bf16 generation took 0.53-0.55 of the time of the modules'
  steps at batch 1 on 2 threads, 0.60 on one, 0.89 at 16 rows; fp32 0.71 at batch 1.
  ``group`` and ``shared`` go to its attention (both builds); a step that would write a shared
  slot is refused.

- ``attn::decode_loop`` (``decode_loop.cpp``): ``attn.generate``'s decode steps, many a call:
  sampling with the Python sampler's ATen calls, the embedding, ``attn::decode_layers`` with the
  final norm, the output layer's product (``attn.native_loop``). At batch 1 the Python around a
  step's kernels was 1.1-1.3 ms of a 10-12 ms step (SmolLM2-135M shape, bf16, Zen 4). ``group``
  and ``shared``: passed to every step's ``attn::decode_layers``.
- ``attn::first_argmax`` (``first_argmax.cpp``): greedy decoding's tokens, each row's first largest
  logit with a NaN the largest (``torch.max(x, -1).indices``), in two AVX2 passes a row; the C++
  loop's sampler and ``attn.generation``'s (where the kernels are loaded: ``loaded()``) call it.
  16 rows of 49,152 logits, 2 threads, Zen 5: 0.041 against 0.271 ms for ``max``.
- ``attn::keep_top_k`` (``top_k.cpp``): top-k sampling's cut in place, each logit below its row's
  k-th largest to -inf (``x.masked_fill_(x < x.topk(k).values[:, -1:], -inf)``; a NaN ranked
  above every number, as topk ranks it), by a min-heap of the k largest met 8 at a time, for k up
  to ``KEEP_TOP_K_MOST``; the samplers call it as they call ``attn::first_argmax``. 16 rows of
  49,152 at k = 50: 0.29 against 1.66 ms for topk and masked_fill_.
- ``attn::running_sums`` (``running_sums.cpp``): each row's running sums in fp64 of fp32
  probabilities, ``torch.cumsum(x, -1, dtype=torch.float64)``'s bit for bit, 8 rows' chains of
  additions at once; the samplers' cumulative distribution, called as the two above are. 16 rows of
  49,152: 0.19 against 0.34 ms for ``torch.cumsum``.

The kernels share ``csrc/simd.h`` (shuffles, an exp), ``csrc/linear_checks.h`` (the products'
input checks), ``csrc/product_group.h`` (products that share x in one parallel region),
``csrc/layer_steps.h`` (the decode layers' norms, RoPE, residuals and SwiGLU, built
for AVX-512 and for AVX2), ``csrc/row_tiles.h`` (``attn::invariant_linear``'s loop over tiles)
and ``csrc/kernels.h`` (the entry points they call in each other). The build's
name holds the torch release and a hash of the sources' paths and of every source and header
(``_extension_name``), so an edited header builds anew, and two copies of attn on one torch (a
checkout and an installed copy, two environments) keep a build each. One name for both had them
rebuild each other's, and a process that had loaded the former build was left mapping a deleted
file.

Eager decode steps and ``compile_for_decode`` call them where the CPU has their instructions
(``bf16_linear_kernel``: AVX512-BF16, AMX, else AVX2; ``decode_attention_available()``: AVX-512;
``decode_layers_available()``: AVX512-BF16) and the extension is built. The build (torch's C++
extension builder: a C++ compiler with OpenMP and ``ninja``) takes 8-30 s once per machine, torch
release and copy of attn, on the first decode step that asks, then loads from torch's extension cache
(``TORCH_EXTENSIONS_DIR``). Where it cannot be built the steps keep torch's kernels or
inductor's code, with one warning that says why. A build killed before it finished leaves torch's
lock file behind, on which torch waits forever; attn builds under an ``flock`` of its own and
clears such a file first, with a warning (``_sole_builder``); a process that waits more than a
few seconds for another's build says so on stderr, with that process's pid.

Results are fp32 sums rounded to the tensors' dtype once, like the other kernels'; the order of
the sums differs, so the last bit of an output can.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import torch

__all__ = [
    "AMX_FROM_ROWS",
    "AMX_LINEAR_MAX_ROWS",
    "AVX2_LINEAR_MAX_ROWS",
    "BF16_MATVEC_MAX_ROWS",
    "FP32_LINEAR_MAX_ROWS",
    "KEEP_TOP_K_MOST",
    "amx_linear_available",
    "avx2_linear_available",
    "bf16_linear_kernel",
    "bf16_matvec_available",
    "build_native",
    "decode_attention_available",
    "decode_layers_available",
    "fp32_linear_available",
    "invariant_linear_available",
    "amx_from_rows",
    "loaded",
    "native_available",
    "native_head_dim",
    "native_product",
]

BF16_MATVEC_MAX_ROWS = 16
"""Most rows of x ``attn::bf16_matvec`` takes (``kBf16MatvecMaxRows`` in ``csrc/kernels.h``). Where
the CPU has AMX, ``attn::amx_linear`` takes ``AMX_FROM_ROWS`` rows and more."""

KEEP_TOP_K_MOST = 256
"""Largest k ``attn::keep_top_k`` takes (``kKeepTopKMost`` in ``csrc/kernels.h``): past it ATen's
topk is the faster, and the samplers call that."""

FP32_LINEAR_MAX_ROWS = 16
"""Most rows of x ``attn::fp32_linear`` takes (``kFp32LinearMaxRows``; past 8, passes of 6
rows)."""

AMX_LINEAR_MAX_ROWS = 32
"""Most rows of x ``attn::amx_linear`` takes (``kAmxLinearMaxRows``: two tiles of 16)."""

AVX2_LINEAR_MAX_ROWS = 16
"""Most rows of x ``attn::avx2_linear`` takes (``kAvx2LinearMaxRows``: passes of 4 rows)."""

AMX_FROM_ROWS = 5
"""Fewest rows that go to ``attn::amx_linear`` where the CPU has AMX: at 1 and 2 rows
``attn::bf16_matvec`` was the faster (8.2-8.6 against 9.7-10.3 ms for the 30 layers at one
row), at 4 they were equal (10.8-11.4 against 11.1-11.6)."""

_CSRC = Path(__file__).with_name("csrc")
_KERNELS = (
    "few_rows_linear", "amx_linear", "avx2_linear", "invariant_linear", "decode_attention", "avx2_layers",
    "decode_layers", "decode_loop", "first_argmax", "top_k", "running_sums"
)  # fmt: skip
_SOURCES = [str(_CSRC / f"{name}.cpp") for name in _KERNELS]
_HEADERS = [
    _CSRC / f"{name}.h"
    for name in ("kernels", "layer_steps", "linear_checks", "product_group", "row_tiles", "shared_slots", "simd")
]


_LIBRARY = torch.library.Library("attn", "FRAGMENT")  # the namespace attn.packed defines
_LIBRARY.define("bf16_matvec(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("fp32_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("amx_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("avx2_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIBRARY.define("invariant_linear(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.define("first_argmax(Tensor x) -> Tensor")
_LIBRARY.define("keep_top_k(Tensor(a!) x, int k) -> ()")
_LIBRARY.define("running_sums(Tensor x, Tensor(a!) out) -> ()")
_LIBRARY.define(
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor attn_mask, float scale, bool widen=False, int group=1, "
    "int shared=0) -> Tensor"
)
_LIBRARY.define(
    "decode_layers(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
    "Tensor slots, Tensor mask, Tensor rotation, float eps, float scale, int amx_from_rows, "
    "Tensor? final_norm=None, float final_eps=0.0, bool avx2=False, int group=1, int shared=0) -> Tensor"
)
_LIBRARY.define(
    "decode_loop(Tensor(a!) logits, Tensor embedding, Tensor head, Tensor[] weights, Tensor?[] biases, "
    "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor final_norm, float final_eps, float eps, float scale, "
    "int amx_from_rows, Tensor cos_sin, Tensor key_valid, Tensor(d!) next_pos, Tensor(e!) fill, Tensor(f!) done, "
    "Tensor(g!) new_tokens, Tensor(h!) new_mask, Tensor(i!) logprobs, Tensor(j!)? all_logits, Tensor stop_ids, "
    "int pad_id, float temperature, int top_k, Generator? generator, int first_step, int last_step, "
    "bool avx2=False, int group=1, int shared=0) -> int"
)

_built = False


def _build_then_call(name: str) -> Callable[..., torch.Tensor]:
    """The operator ``attn::<name>`` before its CPU kernel is loaded: builds and loads the
    extension, then calls it (the loaded kernel is the CPU one from then on)."""

    def call(*args: object) -> torch.Tensor:
        devices = sorted({str(arg.device) for arg in args if isinstance(arg, torch.Tensor)})
        if devices != ["cpu"]:
            raise RuntimeError(f"attn::{name} runs on the CPU only, got tensors on {', '.join(devices)}")
        if _built:
            raise RuntimeError(f"attn::{name} was built but registered no CPU kernel")  # not a loop
        build_native()
        return getattr(torch.ops.attn, name).default(*args)

    return call


_OPERATORS = (
    "bf16_matvec", "fp32_linear", "invariant_linear", "amx_linear", "avx2_linear", "decode_attention",
    "decode_layers", "decode_loop", "first_argmax", "keep_top_k", "running_sums"
)  # fmt: skip
for _name in _OPERATORS:
    _LIBRARY.impl(_name, _build_then_call(_name), "CompositeExplicitAutograd")


@torch.library.register_fake("attn::bf16_matvec")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("attn::invariant_linear")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("attn::amx_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("attn::fp32_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("attn::avx2_linear")
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("attn::first_argmax")
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:1], dtype=torch.long)  # (b,)


@torch.library.register_fake("attn::keep_top_k")
def _(x: torch.Tensor, k: int) -> None:
    return None


@torch.library.register_fake("attn::running_sums")
def _(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


@torch.library.register_fake("attn::decode_attention")
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor,
    scale: float,
    widen: bool = False,
    group: int = 1,
    shared: int = 0,
) -> torch.Tensor:
    return q.new_empty(q.shape)  # (b, h, s, d), contiguous


@torch.library.register_fake("attn::decode_layers")
def _(x: torch.Tensor, *args: object) -> torch.Tensor:
    return x.new_empty(x.shape)  # (b, 1, e)


@functools.cache
def _has_avx512() -> bool:
    """AVX-512 F, BW, VL and DQ: what ATen's AVX-512 kernels need, and a superset of ours."""
    probe = getattr(torch.cpu, "_is_avx512_supported", None)
    return probe is not None and bool(probe())


@functools.cache
def _has_avx2() -> bool:
    """AVX2 (with FMA, which every AVX2 CPU has and ATen's AVX2 kernels need too)."""
    probe = getattr(torch.cpu, "_is_avx2_supported", None)
    return probe is not None and bool(probe())


@functools.cache
def _has_avx512_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return probe is not None and bool(probe())


@functools.cache
def _has_amx() -> bool:
    """AMX tiles, and AVX512-BF16, which the AMX kernel rounds its outputs with."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return probe is not None and bool(probe()) and _has_avx512_bf16()


def native_head_dim(head_dim: int) -> bool:
    """Does ``attn::decode_attention`` take heads of this size? Multiples of 16 up to 512."""
    return 0 < head_dim <= 512 and head_dim % 16 == 0


def _extension_name() -> str:
    """The build's name: one per torch release (an extension is only loadable by the torch it was
    built with), per place of the sources (torch's builder rebuilds when their paths change: two
    copies of attn would rebuild each other's) and per text of the kernels, headers included (it
    rebuilds when a source's text or a flag changes, not when an included header does)."""
    release = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    texts = [Path(source).read_bytes() for source in _SOURCES] + [header.read_bytes() for header in _HEADERS]
    digest = hashlib.sha256(b"\0".join([" ".join(_SOURCES).encode(), *texts])).hexdigest()[:12]
    return f"attn_native_{release}_{digest}"


def build_native() -> None:
    """Builds (or loads from torch's extension cache) the kernels behind ``attn::bf16_matvec``,
    ``attn::fp32_linear``, ``attn::amx_linear`` and ``attn::decode_attention``.

    Raises:
        RuntimeError: this CPU has neither AVX2 nor AVX-512, or the build failed (the compiler's message).
    """
    global _built
    if not _has_avx2():
        raise RuntimeError("attn's native kernels need an x86 CPU with AVX2 (or AVX-512); this one has neither")
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
    name = _extension_name()
    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    try:
        with _sole_builder(directory):
            cpp_extension.load(
                name=name,
                sources=_SOURCES,
                extra_cflags=["-O3", "-fopenmp"],  # OpenMP: at::parallel_for runs on torch's threads
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        _built = True
    finally:
        os.environ["PATH"] = path


@contextlib.contextmanager
def _sole_builder(directory: Path) -> Iterator[None]:
    """Makes this process the only attn process building or loading the extension in
    ``directory`` while it runs (an ``flock``, which the system drops when its holder dies), and
    first clears a lock file that torch's builder left there when its process was killed mid-build
    (SIGKILL, a job's time limit, the OOM killer): torch would wait on it forever, without a word,
    on every later first decode step. Under the ``flock`` no attn process is building, so the file
    is stale. A process that waits for another more than a few seconds says so on stderr, with the
    holder's pid (``_take_flock``): a first decode step that waits on a build in another process
    (ranks started together, a second job on the machine) is not silent. Where
    there is no ``flock`` (Windows, a network file system that refuses it), torch's own lock file
    is all there is, and it is left as it is."""
    try:
        import fcntl  # noqa: F401 - _take_flock's; where there is none, there is no flock
    except ImportError:
        yield
        return
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "attn-build.flock", "a+") as held:
        try:
            _take_flock(held, directory)
        except OSError:  # ENOLCK and the like: no way to tell a live builder's lock from a dead one's
            yield
            return
        held.truncate(0)  # the holder's pid, for the next process that has to wait
        held.write(str(os.getpid()))
        held.flush()
        stale = directory / "lock"  # torch's FileBaton
        if stale.exists():
            warnings.warn(
                f"attn: removed {stale}, left by a build of the native kernels that was killed before it "
                "finished; torch's extension builder would have waited on it forever",
                RuntimeWarning,
                stacklevel=4,
            )
            stale.unlink(missing_ok=True)
        yield


# How long a process waits for another's flock before it says so: loading a built extension
# holds it for a moment, which ranks started together can meet; a build holds it for longer.
_QUIET_WAIT_S = 5.0


def _take_flock(held: IO[str], directory: Path) -> None:
    """Takes the ``flock`` on ``held``, waiting for a live holder (the flock drops when its file
    closes). A wait past ``_QUIET_WAIT_S`` is announced on stderr with the holder's pid, which
    each holder writes into the file: a note, not a warning, since nothing is wrong, and one that
    no warnings filter turns into an error in the middle of a first decode step."""
    import fcntl

    deadline = time.monotonic() + _QUIET_WAIT_S
    while True:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    held.seek(0)
    holder = held.read().strip() or "unknown"
    print(
        f"attn: another process (pid {holder}) is building or loading the native kernels in {directory}; "
        "waiting for it to finish (a build runs once per machine, torch release and copy of attn)",
        file=sys.stderr,
        flush=True,
    )
    fcntl.flock(held, fcntl.LOCK_EX)


@functools.cache
def _built_here() -> bool:
    """Builds the extension on the first call on a CPU with AVX2; a failed build warns once,
    with the reason, and answers no from then on."""
    if not _has_avx2():
        return False
    try:
        build_native()
    except Exception as error:  # no compiler, no ninja, an old compiler: the step keeps inductor's code
        lines = str(error).strip().splitlines() or [type(error).__name__]
        first = next((line.strip() for line in lines if "error:" in line), lines[0])  # the compiler's, if any
        warnings.warn(
            f"attn: could not build the native CPU kernels ({first}); compile_for_decode's steps use inductor's code "
            "and the BLAS for their few-row products and their attention instead (a C++ compiler with OpenMP and "
            "`pip install ninja` let it build)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def loaded() -> bool:
    """Are the native kernels loaded in this process (built, or loaded from torch's cache, by an
    earlier call)? Unlike ``native_available``, this never starts a build."""
    return _built


def native_available() -> bool:
    """Is the extension built here (a CPU with AVX2 or AVX-512; built on the first call, and a
    failed build warns once and answers no)? Each kernel's own ``*_available`` says whether
    this CPU runs it."""
    return _built_here()


def bf16_matvec_available() -> bool:
    """Can ``attn::bf16_matvec`` run here? A CPU with AVX512-BF16, and the extension built
    (on the first call; a failed build warns once and answers no)."""
    return _has_avx512_bf16() and _built_here()


def amx_linear_available() -> bool:
    """Can ``attn::amx_linear`` run here? A CPU with AMX, the extension built, and Linux's
    permission for the tile state (asked on the first call; a refusal warns once)."""
    return _has_amx() and _built_here() and _tiles_permitted()


@functools.cache
def _tiles_permitted() -> bool:
    """One small product: the kernel asks Linux for the tile state, and says so if refused."""
    x, weight = torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(16, 32, dtype=torch.bfloat16)
    try:
        torch.ops.attn.amx_linear.default(x, weight, None)
    except RuntimeError as error:
        warnings.warn(f"attn: {error}; bf16 steps of 5 to 32 rows use other kernels", RuntimeWarning, stacklevel=3)
        return False
    return True


def bf16_linear_kernel(rows: int, features: int) -> torch._ops.OpOverload | None:
    """The native kernel for a bf16 linear of ``rows`` input rows of ``features`` here:
    ``attn::amx_linear`` from ``AMX_FROM_ROWS`` to ``AMX_LINEAR_MAX_ROWS`` rows (features a
    multiple of 32) on a CPU with AMX, else ``attn::bf16_matvec`` up to
    ``BF16_MATVEC_MAX_ROWS`` on one with AVX512-BF16, ``attn::avx2_linear`` up to
    ``AVX2_LINEAR_MAX_ROWS`` on one with AVX2 and no AVX512-BF16; ``None`` where none takes it."""
    if AMX_FROM_ROWS <= rows <= AMX_LINEAR_MAX_ROWS and features % 32 == 0 and amx_linear_available():
        return torch.ops.attn.amx_linear.default
    if 1 <= rows <= BF16_MATVEC_MAX_ROWS and bf16_matvec_available():
        return torch.ops.attn.bf16_matvec.default
    if 1 <= rows <= AVX2_LINEAR_MAX_ROWS and avx2_linear_available():
        return torch.ops.attn.avx2_linear.default
    return None


def invariant_linear_available() -> bool:
    """Can ``attn::invariant_linear`` (parity mode's bf16 and fp32 products) run here? A CPU with
    AVX512-BF16 or AVX2 (each its own kernel, fixed for the process), and the extension built."""
    return (_has_avx512_bf16() or _has_avx2()) and _built_here()


def fp32_linear_available() -> bool:
    """Can ``attn::fp32_linear`` run here? A CPU with AVX512-BF16 (it is built with the bf16
    kernel's instruction set), and the extension built."""
    return bf16_matvec_available()


def decode_attention_available() -> bool:
    """Can ``attn::decode_attention`` run here? A CPU with AVX-512, and the extension built
    (on the first call; a failed build warns once and answers no)."""
    return _has_avx512() and _built_here()


def avx2_linear_available() -> bool:
    """Does ``attn::avx2_linear`` take the few-row products here? A CPU with AVX2 and no
    AVX512-BF16, where attn's AVX-512 products cannot run: AVX2 CPUs, and AVX-512 ones without
    BF16 (Skylake-SP to Ice Lake), whose eager bf16 decode ran oneDNN's product widening inside
    its loop and the layers as modules (an Ice Lake stand-in, ``docs/performance.md``: the AVX2
    build's steps took 0.39 of that time at batch 1). And the extension built."""
    return not _has_avx512_bf16() and _has_avx2() and _built_here()


def decode_layers_available() -> bool:
    """Can ``attn::decode_layers`` run here? A CPU with AVX512-BF16 (its AVX-512 build), or one
    with AVX2 and no AVX512-BF16 (its AVX2 build: ``avx2_layers``), and the extension built (on
    the first call; a failed build warns once and answers no)."""
    return bf16_matvec_available() or avx2_linear_available()


def avx2_layers() -> bool:
    """What ``attn::decode_layers`` and ``attn::decode_loop`` are told of the CPU: True where they
    run their AVX2 build (``attn::avx2_linear``'s products, the work between them in
    ``avx2_layers.cpp``): a CPU with AVX2 and no AVX512-BF16, where ``decode_layers_available``."""
    return not bf16_matvec_available()


def native_product(rows: int, features: int, dtype: torch.dtype) -> torch._ops.OpOverload | None:
    """The native kernel for a linear of ``rows`` input rows of ``features`` in ``dtype`` here:
    bf16 as ``bf16_linear_kernel`` says, fp32 ``attn::fp32_linear`` up to ``FP32_LINEAR_MAX_ROWS``
    rows, else ``attn::avx2_linear`` up to ``AVX2_LINEAR_MAX_ROWS``; ``None`` where none takes it."""
    if dtype == torch.bfloat16:
        return bf16_linear_kernel(rows, features)
    if dtype == torch.float32 and 1 <= rows <= FP32_LINEAR_MAX_ROWS and fp32_linear_available():
        return torch.ops.attn.fp32_linear.default
    if dtype == torch.float32 and 1 <= rows <= AVX2_LINEAR_MAX_ROWS and avx2_linear_available():
        return torch.ops.attn.avx2_linear.default
    return None


@functools.cache
def amx_from_rows() -> int:
    """What ``attn::decode_layers`` is told of AMX: bf16 products take it from ``AMX_FROM_ROWS``
    rows (features a multiple of 32) where it runs here, as ``bf16_linear_kernel`` chooses; 0:
    never."""
    return AMX_FROM_ROWS if amx_linear_available() else 0
