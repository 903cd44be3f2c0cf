"""Targets the benchmark checks ``attn-compiled`` against, read from a JSON file the user gives
(``python -m attn bench --targets FILE``), never from code.

File format (every key optional)::

    {
      "share_of_limit": {"fp32": 0.90, "bf16": 0.75},   # least share of the memory-bound limit, by dtype
      "share_of_roofline": {"fp32": 0.70},              # least share of the roofline (memory or compute), by dtype
      "faster_than": ["hf-static", "llama.cpp"],        # contenders it must out-decode, in every cell they ran
      "peak_rss_at_most": {"hf-static": 1.10}           # largest peak RSS ratio to these contenders
    }
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn.bench.contenders import CONTENDERS
from attn.bench.run import BenchResult, CellInfo, Row

__all__ = ["Targets", "check_targets"]

SUBJECT = "attn-compiled"


@dataclass(frozen=True)
class Targets:
    """What ``attn-compiled`` must reach in each cell (see the module docstring)."""

    share_of_limit: dict[str, float] = field(default_factory=dict)
    share_of_roofline: dict[str, float] = field(default_factory=dict)
    faster_than: tuple[str, ...] = ()
    peak_rss_at_most: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_file(cls, path: str | Path) -> Targets:
        """Reads a targets file; raises ``ValueError`` naming the key that is wrong."""
        try:
            data: Any = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--targets {path}: cannot read a JSON object: {error}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--targets {path}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"share_of_limit", "share_of_roofline", "faster_than", "peak_rss_at_most"})
        if unknown:
            raise ValueError(f"--targets {path}: unknown keys {unknown}; see python -m attn bench --help")
        share, rss = data.get("share_of_limit", {}), data.get("peak_rss_at_most", {})
        roof = data.get("share_of_roofline", {})
        faster = data.get("faster_than", [])
        for key, table in (("share_of_limit", share), ("share_of_roofline", roof), ("peak_rss_at_most", rss)):
            if not isinstance(table, dict) or not all(isinstance(v, (int, float)) and v > 0 for v in table.values()):
                raise ValueError(f"--targets {path}: {key} must map names to positive numbers, got {table!r}")
        if not isinstance(faster, list) or not all(isinstance(name, str) for name in faster):
            raise ValueError(f"--targets {path}: faster_than must be a list of contender names, got {faster!r}")
        unknown = sorted((set(faster) | set(rss)) - (set(CONTENDERS) - {SUBJECT}))
        if unknown:
            raise ValueError(
                f"--targets {path}: {unknown} not contenders attn-compiled is compared with; "
                f"use names from {sorted(set(CONTENDERS) - {SUBJECT})}"
            )
        return cls(
            share_of_limit={k: float(v) for k, v in share.items()},
            share_of_roofline={k: float(v) for k, v in roof.items()},
            faster_than=tuple(faster),
            peak_rss_at_most={k: float(v) for k, v in rss.items()},
        )


def check_targets(result: BenchResult, targets: Targets) -> list[str]:
    """One line per target and cell: the measured value, the target, and met or NOT MET."""
    lines = []
    for info in result.cells:
        rows = result.rows_of(info.label)
        subject = rows.get(SUBJECT)
        if subject is None or subject.decode_tokens_per_s is None:
            continue
        lines.extend(f"  {info.label}: {text}" for text in _cell_checks(info, rows, subject, targets))
    return lines


def _cell_checks(info: CellInfo, rows: dict[str, Row], subject: Row, targets: Targets) -> list[str]:
    out = []
    shares = (
        (targets.share_of_limit, subject.fraction_of_limit, "the memory-bound limit"),
        (targets.share_of_roofline, subject.fraction_of_roofline, f"the roofline ({info.bound}-bound)"),
    )
    for wanted_by_dtype, share, of_what in shares:
        wanted = wanted_by_dtype.get(info.dtype)
        if wanted is not None and share is not None:
            out.append(_verdict(f"{share:.0%} of {of_what}", f">= {wanted:.0%}", share >= wanted))
    for name in targets.faster_than:
        peer = rows.get(name)
        if peer is None or peer.decode_tokens_per_s is None or subject.decode_tokens_per_s is None:
            why = f"skipped: {peer.skipped}" if peer is not None and peer.skipped else "not run"
            out.append(f"faster than {name}: not measured ({why})")
            continue
        ratio, rounds = subject.speedup_over(peer)
        how = f"median of {rounds} rounds' ratios" if rounds else "ratio of the medians: no round ran both"
        out.append(_verdict(f"{ratio:.2f}x {name} ({how})", "> 1.00x", ratio > 1.0) + _overlap(subject, peer))
    for name, most in targets.peak_rss_at_most.items():
        peer = rows.get(name)
        if peer is None or not peer.peak_rss_mb or not subject.peak_rss_mb:
            out.append(f"peak RSS against {name}: not measured")
            continue
        ratio = subject.peak_rss_mb / peer.peak_rss_mb
        out.append(_verdict(f"peak RSS {ratio:.2f}x {name}'s", f"<= {most:.2f}x", ratio <= most))
    return out


def _overlap(subject: Row, peer: Row) -> str:
    """Where the two contenders' timed runs overlap in speed: a note that the verdict is within
    the machine's run-to-run spread (on a shared VM two contenders running the same code have
    read 0.76x in one run); else nothing."""
    mine, theirs = subject.decode_tokens_per_s, peer.decode_tokens_per_s
    if mine is None or theirs is None or mine.min > theirs.max or mine.max < theirs.min:
        return ""
    return (
        f" (runs overlap: {mine.min:.1f}-{mine.max:.1f} against {theirs.min:.1f}-{theirs.max:.1f} tok/s,"
        " within this machine's spread)"
    )


def _verdict(measured: str, target: str, met: bool) -> str:
    return f"{measured} (target {target}): {'met' if met else 'NOT MET'}"
