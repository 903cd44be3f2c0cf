"""compat/cuda_parity_check.py, the prepared GPU check, run on the CPU: it must work as
written before a GPU machine runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "compat" / "cuda_parity_check.py"


@pytest.mark.slow  # a 30-layer model generates twice and trains once: about a minute on two cores
def test_the_gpu_parity_check_runs_on_the_cpu_and_finds_parity_exact() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "cpu"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cpu bf16 parity   max |diff| 0;" in done.stdout
    assert "parity mode: bitwise" in done.stdout
