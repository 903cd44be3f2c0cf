"""The benchmark driver: cells, alternating timed runs, checks, memory probes, the limit.

For each cell (model size, dtype, batch, threads) it sets up every contender, runs a
warm-up generation per contender (its first full generation is the one checked for
correctness, and the one that compiles), then times ``repeats`` generations per contender,
alternating them (the order rotates every round) so that a change in machine load hits all
of them alike. The read bandwidth behind the memory-bound limit is measured the same way:
before the warm-up, at the start of every round and after the last one, so the limit is
the machine's bandwidth while the contenders ran, not a quiet moment's. Peak memory is
measured afterwards, one fresh process per contender.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from attn.bench.check import Check, check_logits, check_tokens
from attn.bench.contenders import Cell, CellContext, Contender, Generated, make_contender
from attn.bench.measure import (
    Stats,
    load_average,
    matmul_peak,
    memory_info,
    peak_rss_mb,
    process_peak_rss_mb,
    read_bandwidth,
    reset_peak_rss,
    rss_mb,
)
from attn.decoder import DecoderConfig
from attn.dtypes import dtype_from_name
from attn.huge_pages import huge_pages_available
from attn.policy import CompatWarning

__all__ = ["BenchResult", "BenchSpec", "CellInfo", "Row", "run_benchmark"]

REFERENCE = "attn-eager"


@dataclass
class BenchSpec:
    """What to run.

    Attributes:
        cells: the settings to measure, in order.
        contenders: contender names (see ``attn.bench.CONTENDERS``), or ``Contender``
            objects (tests inject a deliberately wrong one).
        repeats: timed generations per contender and cell (median, min, max over them).
        warmup: warm-up generations per contender before timing (at least 1: the first
            is the checked one, and the one that compiles).
        memory: measure peak memory, one fresh process per contender.
        seed: seed for weights and prompts.
        init_std: standard deviation of the random weights.
        checkpoint: a Hugging Face checkpoint directory (real weights) instead of random ones.
        max_rows: ``attn.compile_for_decode``'s ``max_rows``.
        nocache_max_batch: largest batch the no-cache contender runs at.
    """

    cells: list[Cell]
    contenders: list[Any]
    repeats: int = 5
    warmup: int = 1
    memory: bool = True
    seed: int = 0
    init_std: float = 0.05
    checkpoint: str | None = None
    max_rows: int = 8
    nocache_max_batch: int = 1


@dataclass
class CellInfo:
    """A cell's setting and the memory-bound limit measured for it."""

    label: str
    config_name: str
    config: dict[str, Any]
    dtype: str
    batch_size: int
    threads: int
    prompt_len: int
    new_tokens: int
    read_bandwidth_gb_s: float
    """The median of the samples: the bandwidth the timed runs had, with their neighbours."""
    read_bandwidth_samples: list[float]
    """Median over passes, measured before the warm-up, every round and after the last."""
    read_bandwidth_best_gb_s: float
    """The fastest single pass of all samples (an optimistic bound, for reference)."""
    probe_mb: int
    """Size of the probe's buffer in MiB (``probe_megabytes``)."""
    weight_bytes_per_step: int
    kv_bytes_per_step: int
    limit_tokens_per_s: float
    """The memory-bound limit: the bytes a step must read at the median read bandwidth."""
    flops_per_step: int
    compute_gflops: float
    """Median of the matrix-product probes (``matmul_peak``) in the cell's dtype and threads."""
    compute_gflops_samples: list[float]
    compute_limit_tokens_per_s: float
    """The compute-bound limit: the FLOPs of a step at ``compute_gflops``."""
    roofline_tokens_per_s: float
    """The lower of the two limits: no contender can decode faster on this machine."""
    bound: str
    """Which limit binds: ``"memory"`` or ``"compute"``."""
    weights_mb: float
    cache_mb: float


@dataclass
class Row:
    """One contender in one cell."""

    cell: str
    contender: str
    description: str
    skipped: str | None = None
    decode_tokens_per_s: Stats | None = None
    ttft_s: Stats | None = None
    fraction_of_limit: float | None = None
    fraction_of_roofline: float | None = None
    vs_hf_static: float | None = None
    first_generation_s: float | None = None
    compile_s: float | None = None
    graphs: int | None = None
    recompiles_during_timed_runs: int | None = None
    peak_rss_mb: float | None = None
    peak_rss_process_mb: float | None = None
    memory_note: str | None = None
    note: str | None = None
    check_ok: bool | None = None
    check: str = ""
    rounds: list[int] = field(default_factory=list)
    """The round of each timed run (``decode_tokens_per_s.values`` in order): every round runs
    each contender once, in turn, so two contenders' runs of one round met the same machine."""
    positions: list[int] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    """Median (over timed runs) latency of each forward pass after the first, by the
    number of tokens it attends to (``positions``)."""

    def speedup_over(self, peer: Row) -> tuple[float, int]:
        """How many times ``peer``'s decode speed this row's is, and from how many rounds: the
        median over the rounds both ran of the ratio of their two runs (a round's runs met the
        same machine, and a shared VM drifts from round to round by more than two contenders
        differ); where they share no round (a contender capped to fewer runs than the other's
        rounds, or rows read from a JSON file without rounds), the ratio of the medians and 0."""
        mine, theirs = self.decode_tokens_per_s, peer.decode_tokens_per_s
        if mine is None or theirs is None:
            raise ValueError(f"{self.contender} against {peer.contender}: a row without timed runs")
        if len(self.rounds) != len(mine.values) or len(peer.rounds) != len(theirs.values):
            return mine.median / theirs.median, 0  # rows without rounds
        peer_runs = dict(zip(peer.rounds, theirs.values, strict=True))
        ratios = [speed / peer_runs[r] for r, speed in zip(self.rounds, mine.values, strict=True) if r in peer_runs]
        if not ratios:
            return mine.median / theirs.median, 0
        return statistics.median(ratios), len(ratios)


@dataclass
class BenchResult:
    """Everything one run measured; ``to_json()`` for ``--json``."""

    machine: dict[str, Any]
    cells: list[CellInfo]
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)

    def rows_of(self, cell: str) -> dict[str, Row]:
        return {row.contender: row for row in self.rows if row.cell == cell}


# -- the memory-bound limit ------------------------------------------------------------


def _layer_parameters(config: DecoderConfig) -> int:
    e, d = config.embed_dim, config.head_dim
    attention = e * config.num_heads * d * 2 + e * config.num_kv_heads * d * 2  # q, o; k, v
    return attention + 3 * e * config.hidden_dim + 2 * e  # the MLP's three matrices, two norms


def bytes_per_step(config: DecoderConfig, dtype: torch.dtype, batch_size: int, context: float) -> tuple[int, int]:
    """Bytes a decode step must read at least: ``(weights, kv_cache)``.

    Weights: every layer's matrices and norms, the final norm, the output head (the
    embedding matrix when tied) and one embedding row per sequence. Cache: keys and values
    of ``context`` tokens per sequence and layer.
    """
    size = torch.finfo(dtype).bits // 8
    e = config.embed_dim
    weights = config.num_layers * _layer_parameters(config) + e + config.vocab_size * e + batch_size * e
    kv = 2 * config.num_layers * batch_size * config.num_kv_heads * config.head_dim * context
    return int(weights * size), int(kv * size)


def flops_per_step(config: DecoderConfig, batch_size: int, context: float) -> int:
    """FLOPs a decode step must do at least (a multiply-add is two): every row's products with
    every layer's matrices and the output head, and its attention (scores and the weighted
    sum) over ``context`` tokens. Norms, RoPE, softmax and the activation are left out: a few
    FLOPs per element, against one multiply-add per weight."""
    e, d = config.embed_dim, config.head_dim
    matrices = e * config.num_heads * d * 2 + e * config.num_kv_heads * d * 2 + 3 * e * config.hidden_dim
    attention = 2 * 2 * config.num_heads * d * context  # q.k per key, then p.v per key
    per_row = config.num_layers * (2 * matrices + attention) + 2 * config.vocab_size * e
    return int(batch_size * per_row)


def _param_mb(config: DecoderConfig, dtype: torch.dtype) -> float:
    e = config.embed_dim
    head = 0 if config.tie_embeddings else config.vocab_size * e
    count = config.num_layers * _layer_parameters(config) + e + config.vocab_size * e + head
    return count * (torch.finfo(dtype).bits // 8) / 2**20


def _step_bytes(cell: Cell) -> tuple[int, int]:
    """``bytes_per_step`` of a mean decode step of the cell (its context half generated)."""
    context = cell.prompt_len + cell.new_tokens / 2  # mean tokens attended by a decode step
    return bytes_per_step(cell.config, cell.dtype, cell.batch_size, context)


def probe_megabytes(cell: Cell) -> int:
    """Size of the bandwidth probe's buffer: what a decode step reads, and at least 256 MiB.

    A probe smaller than the weights can run partly from a last-level cache the weights do
    not fit in (some of these machines report a 300 MiB L3), which would overstate the limit.
    """
    return max(256, -(-sum(_step_bytes(cell)) // 2**20))


def cell_info(cell: Cell, bandwidths: list[tuple[float, float]], peaks: list[tuple[float, float]]) -> CellInfo:
    """The cell's roofline from the probes taken around its runs: ``bandwidths`` (GB/s) and
    ``peaks`` (GFLOP/s), each ``(median, best)`` per sample."""
    bandwidth = statistics.median(median for median, _ in bandwidths)
    compute = statistics.median(median for median, _ in peaks)
    weights, kv = _step_bytes(cell)
    _, cache_bytes = bytes_per_step(cell.config, cell.dtype, cell.batch_size, cell.prompt_len + cell.new_tokens)
    flops = flops_per_step(cell.config, cell.batch_size, cell.prompt_len + cell.new_tokens / 2)
    memory_limit = cell.batch_size * bandwidth * 1e9 / (weights + kv)
    compute_limit = cell.batch_size * compute * 1e9 / flops
    return CellInfo(
        label=cell.label,
        **cell_to_dict(cell),
        read_bandwidth_gb_s=bandwidth,
        read_bandwidth_samples=[median for median, _ in bandwidths],
        read_bandwidth_best_gb_s=max(best for _, best in bandwidths),
        probe_mb=probe_megabytes(cell),
        weight_bytes_per_step=weights,
        kv_bytes_per_step=kv,
        limit_tokens_per_s=memory_limit,
        flops_per_step=flops,
        compute_gflops=compute,
        compute_gflops_samples=[median for median, _ in peaks],
        compute_limit_tokens_per_s=compute_limit,
        roofline_tokens_per_s=min(memory_limit, compute_limit),
        bound="memory" if memory_limit <= compute_limit else "compute",
        weights_mb=_param_mb(cell.config, cell.dtype),
        cache_mb=cache_bytes / 2**20,
    )


# -- memory probes ---------------------------------------------------------------------


def cell_to_dict(cell: Cell) -> dict[str, Any]:
    """``cell``'s fields, JSON-ready: the config as a dict, the dtype by name."""
    fields = {name: getattr(cell, name) for name in cell.__dataclass_fields__}
    config = {name: getattr(cell.config, name) for name in cell.config.__dataclass_fields__}
    return {**fields, "config": config, "dtype": cell.dtype_name}


def cell_from_dict(data: dict[str, Any]) -> Cell:
    return Cell(**{**data, "config": DecoderConfig(**data["config"]), "dtype": dtype_from_name(data["dtype"])})


def memory_probe(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh process: one contender's peak RSS during one timed generation. Each phase
    is named on stderr as it starts, so that a probe that runs out of time says where it was (a
    wait on a build of the kernels in another process is named there too: attn.native)."""
    warnings.simplefilter("ignore")
    phase = functools.partial(print, file=sys.stderr, flush=True)
    phase("memory probe: setting up the model")
    cell = cell_from_dict(spec["cell"])
    torch.set_num_threads(cell.threads)
    ctx = CellContext(
        cell,
        seed=spec["seed"],
        init_std=spec["init_std"],
        checkpoint=spec.get("checkpoint"),
        max_rows=spec["max_rows"],
        standalone=True,
    )
    contender = make_contender(spec["contender"])
    contender.setup(ctx)
    phase("memory probe: the warm-up generation (kernels built or loaded, steps compiled)")
    contender.generate(ctx, cell.new_tokens, want_logits=False)
    phase("memory probe: the timed generation")
    gc.collect()
    before = rss_mb()
    resettable = reset_peak_rss()
    contender.generate(ctx, cell.new_tokens, want_logits=False)
    return {
        "rss_before_mb": before,
        "peak_rss_mb": peak_rss_mb() if resettable else None,
        "peak_rss_process_mb": max(process_peak_rss_mb(), peak_rss_mb() or 0.0),
        "peak_reset": resettable,
    }


def _run_probe(cell: Cell, name: str, spec: BenchSpec, timeout: float = 1800.0) -> tuple[dict[str, Any] | None, str]:
    payload = {
        "cell": cell_to_dict(cell),
        "contender": name,
        "seed": spec.seed,
        "init_std": spec.init_std,
        "checkpoint": spec.checkpoint,
        "max_rows": spec.max_rows,
    }
    command = [sys.executable, "-m", "attn.bench", "--memory-probe", json.dumps(payload)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        said = (error.stderr or b"").decode(errors="replace").strip().splitlines()
        return None, f"memory probe timed out after {timeout:.0f} s; its last words: {said[-1] if said else 'none'}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"memory probe failed (exit {done.returncode}): {tail}"
    return json.loads(lines[-1]), ""


# -- the driver ------------------------------------------------------------------------


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _check(ctx: CellContext, reference: Generated | None, got: Generated, is_reference: bool) -> Check:
    if ctx.cell.dtype == torch.float32:
        if is_reference:
            return Check(True, "reference (fp32 greedy tokens every other contender must equal)")
        if reference is None:
            return Check(False, "MISMATCH: no reference run to compare with")
        return check_tokens(reference.tokens, got.tokens, reference.logits)
    return check_logits(ctx.reference_model, ctx.prompts, got.tokens, got.logits)


def _median_latencies(runs: list[Generated], prompt_len: int) -> tuple[list[int], list[float]]:
    """Per-step latency (ms, median over runs) by the number of tokens the pass attends to."""
    steps = min(len(run.step_latencies) for run in runs)
    latencies = [statistics.median(run.step_latencies[i] for run in runs) * 1e3 for i in range(steps)]
    # Pass i (from 1) after the first attends to P + i tokens: from the cache, or recomputed.
    positions = [prompt_len + i + 1 for i in range(steps)]
    return positions, latencies


# The instruction sets that set a CPU kind's roofline for decode, as /proc/cpuinfo names them.
_KIND_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX"}


def cpu_description(cpuinfo: str) -> str:
    """The CPU's name and kind from the text of ``/proc/cpuinfo``: vendor, family and model
    (two Xeons of one name can be generations apart), the instruction sets a decode step's
    kernels depend on, and the last-level cache, e.g. ``Intel(R) Xeon(R) Processor @ 2.60GHz
    [GenuineIntel 6/106; AVX2, AVX-512, no AVX512-BF16, no AMX; 48 MiB cache]``."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():  # the first processor's block is enough
            break
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "vendor_id" not in fields:
        return name
    flags = set(fields.get("flags", "").split())
    sets = ", ".join(label if flag in flags else f"no {label}" for flag, label in _KIND_FLAGS.items())
    kind = f"{fields['vendor_id']} {fields.get('cpu family', '?')}/{fields.get('model', '?')}; {sets}"
    cache = fields.get("cache size", "").split()
    if len(cache) == 2 and cache[0].isdigit() and cache[1] == "KB":
        kind += f"; {int(cache[0]) / 1024:g} MiB cache"
    return f"{name} [{kind}]"


def machine_info() -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = cpu_description(cpuinfo.read(65536))
    except OSError:
        cpu = cpu_description("")
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average_before": load_average(),
        "memory_measurement": memory_info(),
        # PyTorch's switch for transparent huge pages on large tensors: it changes both the
        # decode speed and the measured bandwidth (README, Performance).
        "huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE", "") not in ("", "0"),
        # can attn's weights, its caches and the read probe go into huge pages (attn.place_in_huge_pages,
        # which the bench calls; setup_caches; attn.bench.measure.probe_buffer)?
        "attn_huge_pages": huge_pages_available(),
        # glibc's malloc settings, read at process start: with its defaults, freed blocks go back
        # to the OS and the prefill's every new tensor faults its pages in again (README,
        # Performance), which moves the first token's time.
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES") or None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    from attn.policy import cache_policy

    decision = cache_policy()
    info["cache_policy"] = f"{decision.policy.value} ({decision.source})"
    return info


def run_cell(cell: Cell, spec: BenchSpec, contenders: list[Contender]) -> tuple[CellInfo, list[Row]]:
    """Measures every contender in one cell; returns the cell's limit and one row each."""
    torch._dynamo.reset()  # fresh compile caches: no recompile limit carried over from other cells
    torch.set_num_threads(cell.threads)
    _log(f"== {cell.label}: measuring read bandwidth and matrix-product speed")
    probe_mb = probe_megabytes(cell)
    bandwidths = [read_bandwidth(cell.threads, megabytes=probe_mb)]  # (median, best) GB/s per sample
    peaks = [matmul_peak(cell.dtype, cell.threads)]  # (median, best) GFLOP/s per sample
    ctx = CellContext(
        cell,
        seed=spec.seed,
        init_std=spec.init_std,
        checkpoint=spec.checkpoint,
        max_rows=spec.max_rows,
        nocache_max_batch=spec.nocache_max_batch,
    )
    rows: dict[str, Row] = {}
    active: list[Contender] = []
    for contender in contenders:
        row = Row(cell=cell.label, contender=contender.name, description=contender.description)
        rows[contender.name] = row
        reason = contender.skip_reason(ctx)
        if reason is not None:
            row.skipped = reason
            _log(f"   {contender.name}: skipped ({reason})")
            continue
        contender.setup(ctx)
        active.append(contender)

    # The reference: attn eager's greedy tokens (also run when it is not a contender).
    reference: Generated | None = None
    if cell.dtype == torch.float32:
        reference = make_contender(REFERENCE).generate(ctx, cell.new_tokens, want_logits=True)

    checked: dict[str, Generated] = {}
    for contender in active:
        _log(f"   {contender.name}: warm-up")
        for i in range(max(spec.warmup, 1)):
            full = contender.warmup_tokens is None
            start = time.perf_counter()
            run = contender.generate(
                ctx, cell.new_tokens if full else contender.warmup_tokens, want_logits=full and i == 0
            )
            if i == 0:
                rows[contender.name].first_generation_s = time.perf_counter() - start
                if full:
                    checked[contender.name] = run
                    first_latency = run.step_latencies[0] if run.step_latencies else None
                    rows[contender.name].compile_s = first_latency  # corrected below, after timing

    graphs_before = {c.name: c.graphs() for c in active}
    runs: dict[str, list[Generated]] = {c.name: [] for c in active}
    rounds: dict[str, list[int]] = {c.name: [] for c in active}
    for round_ in range(spec.repeats):
        order = active[round_ % len(active) :] + active[: round_ % len(active)] if active else []
        bandwidths.append(read_bandwidth(cell.threads, megabytes=probe_mb))
        for contender in order:
            cap = contender.max_repeats
            if cap is not None and len(runs[contender.name]) >= cap:
                continue
            want_logits = contender.name not in checked and not runs[contender.name]
            _log(f"   {contender.name}: run {len(runs[contender.name]) + 1}")
            run = contender.generate(ctx, cell.new_tokens, want_logits=want_logits)
            if want_logits:
                checked[contender.name] = run
            runs[contender.name].append(run)
            rounds[contender.name].append(round_)

    _log(f"== {cell.label}: measuring read bandwidth and matrix-product speed again")
    bandwidths.append(read_bandwidth(cell.threads, megabytes=probe_mb))
    peaks.append(matmul_peak(cell.dtype, cell.threads))
    info = cell_info(cell, bandwidths, peaks)
    hf_static: Row | None = None
    for contender in active:
        row = rows[contender.name]
        timed = runs[contender.name]
        if not timed:
            continue
        row.decode_tokens_per_s = Stats.of([run.decode_tokens_per_s(cell.batch_size) for run in timed])
        row.ttft_s = Stats.of([run.ttft for run in timed])
        row.rounds = rounds[contender.name]
        row.fraction_of_limit = row.decode_tokens_per_s.median / info.limit_tokens_per_s
        row.fraction_of_roofline = row.decode_tokens_per_s.median / info.roofline_tokens_per_s
        row.positions, row.latency_ms = _median_latencies(timed, cell.prompt_len)
        graphs = contender.graphs()
        if graphs is not None:
            row.graphs = graphs
            row.recompiles_during_timed_runs = graphs - (graphs_before[contender.name] or 0)
            median_step = statistics.median(lat for run in timed for lat in run.step_latencies)
            if row.compile_s is not None:
                row.compile_s = max(row.compile_s - median_step, 0.0)  # first decode step minus a normal one
        else:
            row.compile_s = None
        row.note = contender.note()
        verdict = _check(ctx, reference, checked[contender.name], contender.name == REFERENCE)
        row.check_ok, row.check = verdict.ok, verdict.detail
        if contender.name == "hf-static":
            hf_static = row
    if hf_static is not None:
        for row in rows.values():
            if row.decode_tokens_per_s is not None:
                row.vs_hf_static, _ = row.speedup_over(hf_static)

    if spec.memory:
        for contender in active:
            row = rows[contender.name]
            if not contender.memory_probe:
                row.memory_note = "not measured"
                continue
            _log(f"   {contender.name}: memory probe (fresh process)")
            probe, error = _run_probe(cell, contender.name, spec)
            if probe is None:
                row.memory_note = error
                continue
            row.peak_rss_mb = probe["peak_rss_mb"]
            row.peak_rss_process_mb = probe["peak_rss_process_mb"]
            if not probe["peak_reset"]:
                row.memory_note = "peak RSS could not be reset: process-lifetime peak only"
    return info, list(rows.values())


def run_benchmark(spec: BenchSpec) -> BenchResult:
    """Runs every cell of ``spec``; returns what it measured (nothing is printed to stdout)."""
    if spec.repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {spec.repeats}")
    machine = machine_info()
    threads_before = torch.get_num_threads()
    result = BenchResult(machine=machine, cells=[], rows=[])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CompatWarning)
            for cell in spec.cells:
                contenders = [make_contender(c) if isinstance(c, str) else c for c in spec.contenders]
                info, rows = run_cell(cell, spec, contenders)
                result.cells.append(info)
                result.rows.extend(rows)
                del contenders
                gc.collect()
    finally:
        torch.set_num_threads(threads_before)
    machine["load_average_after"] = load_average()
    machine["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return result
