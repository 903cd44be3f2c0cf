"""Measurements the benchmark takes on the spot: statistics over runs, read bandwidth, memory.

Memory is read from Linux's ``/proc/self/status`` (``VmRSS``, and ``VmHWM``: the peak
resident set size), with no third-party package. Writing ``5`` to ``/proc/self/clear_refs``
resets the peak, so the peak of one phase (decode) can be read apart from earlier phases
(imports, compiling). Where that is not allowed, the process-lifetime peak
(``resource.getrusage``) is all there is, and the result says so.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from attn.decoder import DecoderConfig, TransformerDecoder
from attn.huge_pages import huge_page_zeros
from attn.packed import bf16_arithmetic

__all__ = [
    "Comparison",
    "RandomModelSpec",
    "Stats",
    "alternate",
    "init_weights",
    "matmul_peak",
    "memory_info",
    "peak_rss_mb",
    "probe_buffer",
    "read_bandwidth",
    "reset_peak_rss",
    "rss_mb",
    "timed",
]


@dataclass(frozen=True)
class Stats:
    """Median, min and max of a list of measurements (and the list)."""

    median: float
    min: float
    max: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            raise ValueError("Stats.of needs at least one value")
        return cls(statistics.median(values), min(values), max(values), tuple(values))


@dataclass(frozen=True)
class Comparison:
    """Two ways to compute one thing, timed side by side in one run."""

    name: str
    ours: str
    theirs: str
    ours_s: Stats
    theirs_s: Stats
    detail: str = ""
    shape: str = ""
    """The inputs both sides ran on, in words."""
    agree: bool | None = None
    """Did both sides give the same outputs (``None``: not checked)?"""
    ours_peak_mb: float | None = None
    theirs_peak_mb: float | None = None
    """Peak RSS of each side, MB, where measured."""

    @property
    def speedup(self) -> float:
        return self.theirs_s.median / self.ours_s.median


def init_weights(model: torch.nn.Module, std: float, seed: int) -> None:
    """Random weights: matrices ~ N(0, std); norms stay at one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float32) * std)


@dataclass(frozen=True, kw_only=True)
class RandomModelSpec:
    """A measurement's model and how it runs: ``config`` with random weights (matrices ~
    N(0, ``init_std``) from ``seed``, norms at one) in ``dtype``, on ``threads`` intra-op
    threads, each side timed ``repeats`` times."""

    config: DecoderConfig
    dtype: torch.dtype = torch.float32
    threads: int = 1
    repeats: int = 3
    init_std: float = 0.05
    seed: int = 0

    def model(self, length: int, dtype: torch.dtype | None = None) -> TransformerDecoder:
        """The model, its RoPE table long enough for ``length`` tokens, in ``dtype`` (default
        ``self.dtype``), in eval mode."""
        config = self.config if self.config.max_seq_len >= length else replace(self.config, max_seq_len=length)
        model = TransformerDecoder(config)
        init_weights(model, self.init_std, self.seed)
        return model.to(dtype or self.dtype).eval()

    @contextlib.contextmanager
    def threads_set(self) -> Iterator[None]:
        """Runs the block on ``threads`` intra-op threads, then restores the count."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(
    ours: Callable[[], object], theirs: Callable[[], object], repeats: int, *, warmup: bool = True
) -> tuple[Stats, Stats]:
    """Times ``ours`` and ``theirs`` in turn, ``repeats`` times each (after one untimed call
    of each with ``warmup``: the allocator, first-call overheads)."""
    if warmup:
        ours(), theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        times[0].append(timed(ours))
        times[1].append(timed(theirs))
    return Stats.of(times[0]), Stats.of(times[1])


def _status_kb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def rss_mb() -> float | None:
    """Resident set size now, in MB (``VmRSS``); ``None`` off Linux."""
    kb = _status_kb("VmRSS")
    return None if kb is None else kb / 1024


def peak_rss_mb() -> float | None:
    """Peak resident set size since start or since ``reset_peak_rss()``, in MB (``VmHWM``)."""
    kb = _status_kb("VmHWM")
    return None if kb is None else kb / 1024


def process_peak_rss_mb() -> float:
    """Peak resident set size over the process's life, in MB (``ru_maxrss``, never reset)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Resets ``VmHWM`` to the current RSS; ``False`` where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def memory_info() -> str:
    """How peak memory is measured on this machine, in a sentence for the report."""
    if _status_kb("VmHWM") is None:
        return "peak memory: unavailable (no /proc/self/status)"
    return (
        "peak RSS (VmHWM from /proc/self/status) in a fresh process per contender, reset "
        "(/proc/self/clear_refs) after its warm-up generation, so it covers one timed "
        "generation with everything the contender keeps resident (weights, cache, compiled code)"
    )


def read_bandwidth(threads: int, *, megabytes: int = 256, repeats: int = 9) -> tuple[float, float]:
    """Memory read bandwidth in GB/s, ``(median, best)`` over passes of ``sum()`` over a buffer
    of ``megabytes`` MiB, in transparent huge pages where the system offers them
    (``probe_buffer``).

    Args:
        threads: torch intra-op threads to use (restored after).
        megabytes: buffer size: the bytes a decode step reads (the bench's probe), so that a
            last-level cache holds as much of it as it can of the weights, no more.
        repeats: timed passes.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = probe_buffer(megabytes)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            times.append(time.perf_counter() - start)
        size = buffer.numel() * 4
        return size / statistics.median(times) / 1e9, size / min(times) / 1e9
    finally:
        torch.set_num_threads(before)


def probe_buffer(megabytes: int) -> torch.Tensor:
    """The read probe's fp32 buffer of ones, every page written (an untouched page would read
    the kernel's shared zero page, from the caches). In huge pages where the system offers them,
    as attn keeps the weights a decode step reads (``attn.place_in_huge_pages``, which the bench
    and ``load_pretrained`` call) and its caches (``setup_caches``): the hardware's prefetcher
    stops at every 4 KiB page, and one thread of an AMD EPYC Zen 4 read a 256 MiB buffer in 4 KiB
    pages at 17.1-17.9 GB/s against 31.4-33.7 in huge pages (two threads 27.6-31.4 against
    35.3-64.4), where attn's one-row product read its weights at 30.2-32.6: a probe in 4 KiB
    pages put attn's batch-1 decode at 108-125% of the memory-bound limit."""
    count = megabytes * 2**20 // 4
    placed = huge_page_zeros([((count,), torch.float32)], "the bench's read probe")
    buffer = torch.empty(count, dtype=torch.float32) if placed is None else placed[0]
    return buffer.fill_(1.0)


def matmul_peak(dtype: torch.dtype, threads: int, *, size: int = 1024, repeats: int = 9) -> tuple[float, float]:
    """Compute throughput in GFLOP/s, ``(median, best)`` over timed ``size``-square matrix
    products in ``dtype`` on ``threads`` intra-op threads (restored after): the compute-bound
    side of the roofline, as ``read_bandwidth`` is the memory-bound side. A square product of
    1024 is compute-bound on every CPU here (it reads 2 x 1024^2 elements per 2 x 1024^3 FLOPs)
    and the BLAS behind ``torch.mm`` (oneDNN, MKL) runs it near its peak for that dtype.

    bf16 on a CPU without bf16 arithmetic (``attn.packed.bf16_arithmetic``): the faster of the
    bf16 and the fp32 product. Such a CPU widens bf16 to fp32 whichever kernel runs, and packed
    decode does it outright (``attn.packed.widens``), so the fp32 rate is the peak for bf16
    matrices there; the bf16 kernel's own rate (a quarter of it on an Ice Lake Xeon) is not."""
    rate = _product_rate(dtype, threads, size, repeats)
    if dtype == torch.bfloat16 and not bf16_arithmetic():
        return max(rate, _product_rate(torch.float32, threads, size, repeats))
    return rate


def _product_rate(dtype: torch.dtype, threads: int, size: int, repeats: int) -> tuple[float, float]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
        out = torch.mm(a, b)  # the first call picks and warms the kernel
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - start)
        flops = 2 * size**3
        return flops / statistics.median(times) / 1e9, flops / min(times) / 1e9
    finally:
        torch.set_num_threads(before)


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages, or ``None`` where unavailable."""
    try:
        return os.getloadavg()
    except OSError:
        return None
