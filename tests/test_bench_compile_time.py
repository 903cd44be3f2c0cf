"""``python -m attn bench --compile-time``: cold and warm, each in a fresh process."""

from __future__ import annotations

import re

import pytest

from attn import bench, compat


@pytest.mark.slow  # two fresh processes, each compiling a decode step
def test_compile_time_measures_a_cold_and_a_warm_process(capsys: pytest.CaptureFixture[str]) -> None:
    status = bench.main(["--compile-time", "--cells", "tiny:fp32:1:1", "--prompt-len", "6", "--new-tokens", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0, lines
    row = next(line for line in lines if line.lstrip().startswith("tiny fp32 b1 t1"))
    # setup cold, warm; cold (inductor), warm (inductor); warm as run (setup not apart)
    numbers = [float(n) for n in re.findall(r"\d+\.\d+", row)]
    assert len(numbers) == 7, row
    # every figure a time; the warm process's inductor share may round to 0.0 (its cache hit)
    assert all(n > 0 for i, n in enumerate(numbers) if i != 5) and numbers[5] >= 0, row
    assert numbers[1] < numbers[0], row  # the warm process finds the ISA probes cached
    assert numbers[3] <= numbers[2] and numbers[5] <= numbers[4], row  # inductor's share of each
    layers = "one, for every layer" if compat.compile_regions_supported() else "every layer"
    assert row.rstrip().endswith(layers), row
