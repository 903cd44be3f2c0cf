"""compat/gpu_bench.py, the prepared GPU benchmark, in its CPU smoke mode: it must run as
written before a GPU machine runs it, and report every figure the README's GPU row needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "compat" / "gpu_bench.py"


@pytest.mark.slow  # compiles a tiny model twice with aot_eager, and runs transformers: about 15 s
def test_the_gpu_bench_runs_its_smoke_shape_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    one = figures["batch_1"]
    assert figures["read_bandwidth_gb_s"] > 0 and one["tokens_per_s"] > 0 and one["bytes_per_step"] > 0
    assert one["share_of_read_bandwidth"] == pytest.approx(
        one["bytes_per_step"] * one["tokens_per_s"] / (figures["read_bandwidth_gb_s"] * 1e9)
    )
    assert one["greedy_tokens_equal_to_eager"] == figures["new_tokens"]  # the compiled step decodes as eager does
    many = figures["batch_4"]
    assert many["attn eager"]["tokens_per_s"] > 0 and many["attn torch.compile"]["tokens_per_s"] > 0
    assert "transformers static" in many
    assert "of the read bandwidth (goal 80%:" in done.stdout
