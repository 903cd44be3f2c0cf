"""The benchmark's outputs: the table, a summary per cell, JSON, and the latency plot."""

from __future__ import annotations

import json
from pathlib import Path

from attn.bench.run import BenchResult, CellInfo, Row
from attn.bench.targets import Targets, check_targets

__all__ = ["compiled_summary", "format_table", "write_json", "write_plot"]


def _fmt_stats(row: Row) -> str:
    s = row.decode_tokens_per_s
    return "-" if s is None else f"{s.median:7.1f} [{s.min:.1f}-{s.max:.1f}]"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_table(result: BenchResult, targets: Targets | None = None) -> str:
    """The human-readable report: one block per cell, then a summary per cell, the targets'
    verdicts (when given) and notes."""
    lines = []
    m = result.machine
    lines.append(
        f"attn bench - torch {m['torch']}, transformers {m.get('transformers') or 'not installed'}, "
        f"{m['cpu']} ({m['logical_cpus']} logical CPUs), cache policy {m['cache_policy']}, "
        f"huge pages for tensors {'on' if m.get('huge_pages') else 'off'} (THP_MEM_ALLOC_ENABLE), "
        f"huge pages for attn's weights, caches and the read probe "
        f"{'available' if m.get('attn_huge_pages') else 'not available'} "
        "(attn.place_in_huge_pages, setup_caches, attn.bench.measure.probe_buffer), "
        f"GLIBC_TUNABLES {m.get('glibc_tunables') or 'not set'}"
    )
    lines.append(
        f"load average before {_load(m.get('load_average_before'))}, after {_load(m.get('load_average_after'))}"
    )
    header = (
        f"  {'contender':<24} {'decode tok/s med [min-max]':>28} {'xHF-st':>6} {'%mem':>5} {'%roof':>5} "
        f"{'TTFT ms':>8} {'peak MB':>8} {'compile s':>9} {'graphs/re':>9}  check"
    )
    for info in result.cells:
        lines.append("")
        samples = info.read_bandwidth_samples
        lines.append(
            f"{info.label}: prompt {info.prompt_len}, new {info.new_tokens}; read bandwidth "
            f"{info.read_bandwidth_gb_s:.1f} GB/s ({info.probe_mb} MiB read; median of {len(samples)} samples "
            "between the runs, "
            f"{min(samples):.1f}-{max(samples):.1f}; fastest pass {info.read_bandwidth_best_gb_s:.1f}); "
            f"memory-bound limit {info.limit_tokens_per_s:.0f} tok/s "
            f"({info.weight_bytes_per_step / 1e6:.0f} MB weights + {info.kv_bytes_per_step / 1e6:.1f} MB cache "
            f"read per step); weights {info.weights_mb:.0f} MiB, cache {info.cache_mb:.1f} MiB"
        )
        peaks = info.compute_gflops_samples
        products = f"{info.dtype} 1024^3 products"
        if info.dtype == "bf16":  # attn.bench.measure.matmul_peak
            products += " or fp32 ones, where faster: a CPU without bf16 arithmetic widens bf16"
        lines.append(
            f"  compute: {info.compute_gflops:.0f} GFLOP/s ({products}, {info.threads} "
            f"thread(s); samples {min(peaks):.0f}-{max(peaks):.0f}); compute-bound limit "
            f"{info.compute_limit_tokens_per_s:.0f} tok/s ({info.flops_per_step / 1e9:.2f} GFLOP per step); "
            f"roofline {info.roofline_tokens_per_s:.0f} tok/s, {info.bound}-bound"
        )
        lines.append(header)
        for row in result.rows_of(info.label).values():
            if row.skipped:
                lines.append(f"  {row.contender:<24} skipped: {row.skipped}")
                continue
            graphs = "-" if row.graphs is None else f"{row.graphs}/{row.recompiles_during_timed_runs}"
            ttft = None if row.ttft_s is None else row.ttft_s.median * 1e3
            fraction = None if row.fraction_of_limit is None else row.fraction_of_limit * 100
            roof = None if row.fraction_of_roofline is None else row.fraction_of_roofline * 100
            check = ("ok: " if row.check_ok else "FAILED: ") + row.check
            lines.append(
                f"  {row.contender:<24} {_fmt_stats(row):>28} {_num(row.vs_hf_static, '.2f'):>6} "
                f"{_num(fraction, '.0f'):>5} {_num(roof, '.0f'):>5} {_num(ttft, '.0f'):>8} "
                f"{_num(row.peak_rss_mb, '.0f'):>8} "
                f"{_num(row.compile_s, '.1f'):>9} {graphs:>9}  {check}"
            )
        lines.extend(
            f"  {row.contender}: {row.note}" for row in result.rows_of(info.label).values() if row.note is not None
        )
        lines.extend(_cell_notes(info, result.rows_of(info.label)))
    summary = compiled_summary(result)
    if summary:
        lines.append("")
        lines.append("attn-compiled per cell:")
        lines.extend(summary)
    if targets is not None:
        lines.append("")
        lines.append("targets (--targets):")
        lines.extend(check_targets(result, targets) or ["  nothing to check: attn-compiled did not run"])
    failed = [r for r in result.rows if r.check_ok is False]
    lines.append("")
    if failed:
        lines.append(f"CORRECTNESS: {len(failed)} contender(s) FAILED the check; their speed means nothing:")
        lines.extend(f"  {r.cell} {r.contender}: {r.check}" for r in failed)
    else:
        checked = sum(r.check_ok is True for r in result.rows)
        lines.append(f"correctness: all {checked} checked contender runs agree with the reference")
    lines.append(
        "columns: decode tok/s over all rows of the batch, after the first token; xHF-st = vs hf-static "
        "(the median of the rounds' ratios: each round runs every contender once, in turn); "
        "%mem = share of the memory-bound limit (bytes that must be read per step / read bandwidth); "
        "%roof = share of the roofline (the lower of that and the compute-bound limit: FLOPs per step / "
        "measured matrix-product speed); "
        "TTFT = time to first token; peak MB = " + result.machine.get("memory_measurement", "")
    )
    lines.append(
        "compile s = first decode step minus a normal one; graphs/re = decode graphs compiled / "
        "compiled during the timed runs (0 = no recompiles)"
    )
    lines.extend(result.notes)
    return "\n".join(lines)


def _load(value: object) -> str:
    if not value:
        return "?"
    return "/".join(f"{v:.2f}" for v in value)  # type: ignore[union-attr]


def _cell_notes(info: CellInfo, rows: dict[str, Row]) -> list[str]:
    notes = []
    nocache = rows.get("attn-nocache")
    if nocache and nocache.latency_ms:
        first, last = nocache.latency_ms[0], nocache.latency_ms[-1]
        notes.append(
            f"  no cache: {1e3 * info.batch_size / first:.1f} tok/s at {nocache.positions[0]} tokens, "
            f"{1e3 * info.batch_size / last:.1f} tok/s at {nocache.positions[-1]} tokens"
        )
    return notes


def compiled_summary(result: BenchResult) -> list[str]:
    """One line per cell on ``attn-compiled``: its decode speed against every other contender
    that ran, share of the memory-bound limit (also at the fastest bandwidth sample),
    compiles, peak RSS against hf-static's, and its check."""
    out = []
    for info in result.cells:
        rows = result.rows_of(info.label)
        compiled, hf = rows.get("attn-compiled"), rows.get("hf-static")
        if compiled is None or compiled.decode_tokens_per_s is None:
            continue
        ratios = [
            f"{compiled.speedup_over(row)[0]:.2f}x {name}"
            for name, row in rows.items()
            if name != "attn-compiled" and row.decode_tokens_per_s is not None
        ]
        parts = [", ".join(ratios)] if ratios else []
        if compiled.fraction_of_limit is not None:
            # Against the fastest bandwidth sample too: the limit on a machine with no neighbours.
            quiet = compiled.fraction_of_limit * info.read_bandwidth_gb_s / max(info.read_bandwidth_samples)
            parts.append(
                f"{compiled.fraction_of_limit:.0%} of the memory-bound limit ({quiet:.0%} at the fastest sample)"
            )
        if compiled.fraction_of_roofline is not None:
            parts.append(f"{compiled.fraction_of_roofline:.0%} of the roofline ({info.bound}-bound)")
        if compiled.graphs is not None:
            recompiled = compiled.recompiles_during_timed_runs
            flag = "" if compiled.graphs <= 1 and recompiled == 0 else " RECOMPILED"  # 0: its steps ran natively
            parts.append(f"{compiled.graphs} decode graph(s), {recompiled} during timed runs{flag}")
        if hf is not None and hf.peak_rss_mb and compiled.peak_rss_mb:
            parts.append(f"peak RSS {compiled.peak_rss_mb / hf.peak_rss_mb:.2f}x hf-static's")
        if compiled.check_ok is not None:
            parts.append("same answer as attn eager" if compiled.check_ok else f"CHECK FAILED: {compiled.check}")
        out.append(f"  {info.label:<20} " + "; ".join(parts))
    return out


def write_json(result: BenchResult, path: str | Path) -> None:
    """Writes everything measured (rows, cells, machine) as JSON."""
    data = result.to_json()
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_plot(result: BenchResult, path: str | Path) -> str | None:
    """Per-token latency against position, cache against no cache; one panel per cell.

    Returns:
        ``None`` on success, or why no plot was written (matplotlib missing).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install matplotlib (or attn[bench]) to write --plot"
    cells = result.cells
    fig, axes = plt.subplots(len(cells), 1, figsize=(8, 3.6 * len(cells)), squeeze=False)
    for ax, info in zip(axes[:, 0], cells, strict=True):
        for row in result.rows_of(info.label).values():
            if row.latency_ms:
                style = "--" if row.contender == "attn-nocache" else "-"
                ax.plot(row.positions, row.latency_ms, style, label=row.contender, linewidth=1.2)
        ax.set_title(f"{info.label}: latency per token")
        ax.set_xlabel("tokens attended (prompt + generated)")
        ax.set_ylabel("ms per forward pass")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
