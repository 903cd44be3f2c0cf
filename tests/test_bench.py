"""attn/bench: the benchmark runs on tiny sizes, its JSON has the fields, and its correctness
check fails when a contender's answer is wrong. No timing assertions: the machine is shared.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attn
from attn import bench, huge_pages
from attn.bench import run as run_module
from attn.bench import targets as targets_module
from attn.bench.check import check_logits, check_tokens
from attn.bench.contenders import (
    DEFAULT_CONTENDERS,
    LLAMA_CPP_INSTALL,
    AttnEager,
    Cell,
    CellContext,
    Generated,
    LlamaCpp,
    _Timed,
    llama_cpp_available,
    transformers_available,
)
from attn.bench.measure import Stats
from attn.bench.rl import SMOLLM2_135M as SMOLLM2
from attn.bench.run import BenchSpec, Row, run_benchmark
from attn.bench.targets import Targets
from attn.policy import CachePolicy
from attn.rope import RopeScaling

from .conftest import needs_bf16_matvec, tiny_model

TINY = dict(vocab_size=97, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=48)
TINY_JSON = json.dumps(TINY)
ARGS = ["--prompt-len", "6", "--new-tokens", "5", "--repeats", "2", "--no-memory"]


def tiny_cell(dtype: torch.dtype = torch.float32, batch_size: int = 2) -> Cell:
    config = attn.DecoderConfig(max_seq_len=64, **TINY)
    return Cell("tiny", config, dtype, batch_size, 1, 6, 5)


class WrongAnswer(AttnEager):
    """attn eager, but the last generated token of row 0 is off by one: must be caught."""

    def __init__(self) -> None:
        super().__init__("attn-wrong", CachePolicy.FLAG, "deliberately wrong", memory_probe=False)

    def generate(self, ctx: CellContext, new_tokens: int, want_logits: bool) -> Generated:
        run = super().generate(ctx, new_tokens, want_logits)
        run.tokens[0, -1] = (run.tokens[0, -1] + 1) % ctx.cell.config.vocab_size
        return run


TARGETS = {
    "share_of_limit": {"fp32": 50.0},  # 5000%: never met
    "share_of_roofline": {"fp32": 0.0001},  # 0.01%: always met
    "faster_than": ["attn-eager", "hf-static"],
    "peak_rss_at_most": {"hf-static": 1.1},
}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, str]]:
    """One full command-line run (every default contender, compiled one included), with a
    targets file: its JSON and its printed report."""
    before = attn.policy._decision
    folder = tmp_path_factory.mktemp("bench")
    path, targets = folder / "bench.json", folder / "targets.json"
    targets.write_text(json.dumps(TARGETS))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = bench.main(["--config", TINY_JSON, *ARGS, "--json", str(path), "--targets", str(targets)])
    assert status == 0
    yield json.loads(path.read_text()), printed.getvalue()
    attn.policy._decision = before


@pytest.fixture(scope="module")
def result_json(bench_run: tuple[dict, str]) -> dict:
    return bench_run[0]


@pytest.mark.slow  # a full command-line bench run, compile included (10 s)
@pytest.mark.llama_cpp  # llama.cpp is one of the default contenders
def test_report_relates_attn_compiled_to_every_contender_and_checks_the_targets(bench_run: tuple[dict, str]) -> None:
    data, report = bench_run
    runs = {
        r["contender"]: dict(zip(r["rounds"], r["decode_tokens_per_s"]["values"], strict=True))
        for r in data["rows"]
        if r["decode_tokens_per_s"]
    }
    compiled = runs.pop("attn-compiled")

    def speedup(name: str) -> tuple[float, str]:  # the median of the rounds' ratios (capped ones: fewer rounds)
        ratios = [compiled[r] / speed for r, speed in runs[name].items()]
        return statistics.median(ratios), f"median of {len(ratios)} rounds' ratios"

    summary = report.split("attn-compiled per cell:")[1].split("\n")[1]
    for name in runs:
        assert f"{speedup(name)[0]:.2f}x {name}" in summary, (name, summary)
    verdicts = report.split("targets (--targets):")[1]
    share = next(r["fraction_of_limit"] for r in data["rows"] if r["contender"] == "attn-compiled")
    assert f"{share:.0%} of the memory-bound limit (target >= 5000%): NOT MET" in verdicts
    for name in ("attn-eager", "hf-static"):
        if name in runs:
            ratio, how = speedup(name)
            met = "met" if ratio > 1 else "NOT MET"
            assert f"{ratio:.2f}x {name} ({how}) (target > 1.00x): {met}" in verdicts
    assert "peak RSS against hf-static: not measured" in verdicts  # --no-memory
    (cell,) = data["cells"]
    roof = next(r["fraction_of_roofline"] for r in data["rows"] if r["contender"] == "attn-compiled")
    assert f"{roof:.0%} of the roofline ({cell['bound']}-bound) (target >= 0%): met" in verdicts
    assert f"roofline {cell['roofline_tokens_per_s']:.0f} tok/s, {cell['bound']}-bound" in report
    assert "%roof" in report and f"{roof:.0%} of the roofline" in summary


@given(
    mine=st.lists(st.integers(50, 150), min_size=1, max_size=5),
    theirs=st.lists(st.integers(50, 150), min_size=1, max_size=5),
    capped=st.booleans(),
)
def test_faster_than_verdicts_read_the_rounds_ratios_and_say_where_the_runs_overlap(mine, theirs, capped) -> None:
    """The verdict is the median over the rounds both contenders ran of their runs' ratio (a
    round's runs met the same machine); with no round in common, the ratio of the medians. Where
    the two contenders' runs overlap in speed, the line says the verdict is within the machine's
    spread."""
    their_rounds = [len(mine) + i for i in range(len(theirs))] if capped else list(range(len(theirs)))
    rows = {
        name: Row("cell", name, "", decode_tokens_per_s=Stats.of([float(v) for v in speeds]), rounds=rounds)
        for name, speeds, rounds in (
            ("attn-compiled", mine, list(range(len(mine)))),
            ("llama.cpp", theirs, their_rounds),
        )
    }
    info = types.SimpleNamespace(dtype="bf16", bound="memory")
    wanted = Targets(faster_than=("llama.cpp",))
    (line,) = targets_module._cell_checks(info, rows, rows["attn-compiled"], wanted)
    shared = range(min(len(mine), len(theirs)))
    if capped:  # no round in common
        ratio, how = statistics.median(mine) / statistics.median(theirs), "ratio of the medians: no round ran both"
    else:
        ratio, how = statistics.median([mine[r] / theirs[r] for r in shared]), f"median of {len(shared)} rounds' ratios"
    verdict = "met" if ratio > 1 else "NOT MET"
    assert line.startswith(f"{ratio:.2f}x llama.cpp ({how}) (target > 1.00x): {verdict}"), line
    overlap = min(mine) <= max(theirs) and min(theirs) <= max(mine)
    assert ("within this machine's spread" in line) == overlap, line


def test_a_round_paired_speedup_follows_the_rounds_not_the_order() -> None:
    """Runs pair by the round they ran in: a contender that drifted with the machine (both slow
    in round 1) reads the same against its peer in every round, whatever the medians say."""
    mine = Row("cell", "a", "", decode_tokens_per_s=Stats.of([200.0, 100.0, 220.0]), rounds=[0, 1, 2])
    theirs = Row("cell", "b", "", decode_tokens_per_s=Stats.of([110.0, 50.0]), rounds=[2, 1])
    assert mine.speedup_over(theirs) == (2.0, 2)  # round 1: 100 / 50, round 2: 220 / 110
    assert theirs.speedup_over(mine) == (0.5, 2)
    with pytest.raises(ValueError, match="a row without timed runs"):
        mine.speedup_over(Row("cell", "c", ""))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1]", r"expected a JSON object, got list"),
        ('{"fastest": 1}', r"unknown keys \['fastest'\]"),
        ('{"share_of_limit": {"fp32": -1}}', r"share_of_limit must map names to positive numbers"),
        ('{"faster_than": "hf-static"}', r"faster_than must be a list of contender names"),
        ('{"faster_than": ["llama-cpp"]}', r"\['llama-cpp'\] not contenders .* use names from .*'llama.cpp'"),
        ('{"peak_rss_at_most": {"attn-compiled": 1.0}}', r"\['attn-compiled'\] not contenders"),
        ("{", r"cannot read a JSON object"),
    ],
)
def test_bad_targets_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "targets.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        bench.Targets.from_file(path)


@pytest.mark.slow  # a full command-line bench run, compile included (10 s)
@pytest.mark.llama_cpp  # llama.cpp is one of the default contenders
def test_json_has_every_field(result_json: dict) -> None:
    assert {"machine", "cells", "rows", "notes"} <= set(result_json)
    assert {"torch", "cpu", "load_average_before", "load_average_after", "memory_measurement", "huge_pages"} <= set(
        result_json["machine"]
    )
    assert result_json["machine"]["glibc_tunables"] == (os.environ.get("GLIBC_TUNABLES") or None)
    (cell,) = result_json["cells"]
    assert cell["read_bandwidth_gb_s"] > 0 and cell["limit_tokens_per_s"] > 0
    samples = cell["read_bandwidth_samples"]
    assert len(samples) == 2 + 2  # before the warm-up, each of the 2 rounds, after the last
    assert cell["read_bandwidth_gb_s"] == pytest.approx((sorted(samples)[1] + sorted(samples)[2]) / 2)  # median
    assert cell["weight_bytes_per_step"] > 0 and cell["kv_bytes_per_step"] > 0
    assert cell["flops_per_step"] > 0 and len(cell["compute_gflops_samples"]) == 2  # before and after the runs
    assert cell["roofline_tokens_per_s"] == min(cell["limit_tokens_per_s"], cell["compute_limit_tokens_per_s"])
    assert cell["probe_mb"] == 256  # a tiny model's step reads less than the smallest probe
    rows = {row["contender"]: row for row in result_json["rows"]}
    assert set(rows) == set(DEFAULT_CONTENDERS)  # every default contender ran, or said why not
    for name, row in rows.items():
        if name.startswith("hf-") and not transformers_available():
            assert "transformers is not installed" in row["skipped"]
            continue
        if name == "llama.cpp" and not llama_cpp_available():
            assert f"llama-cpp-python is not installed ({LLAMA_CPP_INSTALL} builds it" in row["skipped"]
            continue
        assert row["skipped"] is None, row
        assert row["check_ok"] is True, row["check"]
        stats = row["decode_tokens_per_s"]
        assert stats["min"] <= stats["median"] <= stats["max"] and len(stats["values"]) >= 1
        assert row["ttft_s"]["median"] > 0 and row["fraction_of_limit"] > 0
        assert row["fraction_of_roofline"] == pytest.approx(stats["median"] / cell["roofline_tokens_per_s"])
        assert len(row["positions"]) == len(row["latency_ms"]) == 4  # 5 new tokens: 4 decode steps
        assert len(row["rounds"]) == len(stats["values"]) and row["rounds"] == sorted(set(row["rounds"]))
    compiled = rows["attn-compiled"]
    assert compiled["graphs"] == 1 and compiled["recompiles_during_timed_runs"] == 0
    layers = 1 if attn.compat.compile_regions_supported() else 2  # one compiled for both, or each
    assert compiled["compile_s"] is not None
    assert f"{layers} attention call(s)" in compiled["note"] and "rewritten for few rows" in compiled["note"]
    assert rows["attn-eager"]["graphs"] is None
    assert len(rows["attn-nocache"]["decode_tokens_per_s"]["values"]) == 1  # capped at one run
    if transformers_available():
        assert rows["hf-static"]["vs_hf_static"] == pytest.approx(1.0)


def test_flops_of_a_step_counted_by_hand() -> None:
    matrices = 576 * 576 * 2 + 2 * 192 * 576 + 3 * 576 * 1536  # q, o; k, v; gate, up, down
    attention = 2 * 9 * 64 * 192 * 2  # 9 heads of 64: scores over 192 keys, then the weighted sum
    per_row = 30 * (2 * matrices + attention) + 2 * 49152 * 576  # a multiply-add is 2 FLOPs; the head
    assert run_module.flops_per_step(SMOLLM2, 16, 192) == 16 * per_row  # 4.3 GFLOP for 16 rows


@given(
    bandwidth=st.floats(1.0, 100.0),
    gflops=st.floats(1.0, 2000.0),
    batch=st.integers(1, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_the_roofline_is_the_lower_limit(bandwidth: float, gflops: float, batch: int, dtype: torch.dtype) -> None:
    cell = Cell("smollm2", SMOLLM2, dtype, batch, 2, 128, 64)
    info = run_module.cell_info(cell, [(bandwidth, bandwidth * 1.1)] * 3, [(gflops, gflops * 1.1)] * 2)
    weights, kv = run_module.bytes_per_step(SMOLLM2, dtype, batch, 128 + 32)
    memory = batch / ((weights + kv) / (bandwidth * 1e9))  # rows per step over the time to read a step's bytes
    compute = batch / (run_module.flops_per_step(SMOLLM2, batch, 128 + 32) / (gflops * 1e9))
    assert info.limit_tokens_per_s == pytest.approx(memory)
    assert info.compute_limit_tokens_per_s == pytest.approx(compute)
    assert info.roofline_tokens_per_s == pytest.approx(min(memory, compute))
    assert info.bound == ("memory" if memory <= compute else "compute")


def test_matmul_peak_is_a_positive_rate_with_its_best_sample() -> None:
    median, best = bench.measure.matmul_peak(torch.float32, 1, size=128, repeats=3)
    assert 0 < median <= best


ICE_LAKE = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 106
model name\t: Intel(R) Xeon(R) Processor @ 2.60GHz
cache size\t: 49152 KB
flags\t\t: fpu sse avx2 avx512f avx512_vnni

processor\t: 1
vendor_id\t: GenuineIntel
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16
"""


def test_cpu_description_names_the_kind_from_the_first_processor() -> None:
    assert run_module.cpu_description(ICE_LAKE) == (
        "Intel(R) Xeon(R) Processor @ 2.60GHz [GenuineIntel 6/106; AVX2, AVX-512, no AVX512-BF16, no AMX; 48 MiB cache]"
    )
    zen4 = ICE_LAKE.replace("GenuineIntel", "AuthenticAMD").replace("avx512_vnni", "avx512_bf16").replace("106", "17")
    assert "AuthenticAMD 6/17; AVX2, AVX-512, AVX512-BF16, no AMX;" in run_module.cpu_description(zen4)
    zen1 = ICE_LAKE.replace(" avx512f ", " ").replace("106", "1")  # AVX2 kernels only (attn::avx2_linear)
    assert "6/1; AVX2, no AVX-512, no AVX512-BF16, no AMX;" in run_module.cpu_description(zen1)
    # No vendor (another platform's cpuinfo, or none): the name alone.
    assert run_module.cpu_description("model name\t: Some CPU\n") == "Some CPU"
    assert run_module.cpu_description("")


@pytest.mark.parametrize("cpu_bf16", [True, False])
def test_bf16_peak_is_the_fp32_one_where_the_cpu_widens_bf16(monkeypatch: pytest.MonkeyPatch, cpu_bf16: bool) -> None:
    rates = {torch.bfloat16: (50.0, 55.0), torch.float32: (200.0, 210.0)}
    monkeypatch.setattr(bench.measure, "_product_rate", lambda dtype, threads, size, repeats: rates[dtype])
    monkeypatch.setattr(bench.measure, "bf16_arithmetic", lambda: cpu_bf16)
    assert bench.measure.matmul_peak(torch.bfloat16, 2) == (rates[torch.bfloat16] if cpu_bf16 else rates[torch.float32])
    assert bench.measure.matmul_peak(torch.float32, 2) == rates[torch.float32]


def test_probe_reads_at_least_what_a_step_reads() -> None:
    # A SmolLM2-135M-shaped model: 30 layers, tied 49,152 x 576 embedding, 9/3 heads of 64.
    config = SMOLLM2
    layer = 576 * 576 * 2 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576  # q, o; k, v; gate, up, down; two norms
    weights = (30 * layer + 576 + 49152 * 576 + 576) * 4  # layers, final norm, head, one embedding row; fp32
    kv = 2 * 30 * 3 * 64 * (128 + 64) * 4  # keys and values of the mean context (prompt 128, half of 128 new)
    cell = Cell("smollm2", config, torch.float32, 1, 1, 128, 128)
    assert run_module.probe_megabytes(cell) == -(-(weights + kv) // 2**20)  # 522 MiB, more than a 256 MiB probe
    assert run_module.probe_megabytes(tiny_cell()) == 256


@pytest.mark.parametrize("offered", [True, False])
def test_the_read_probe_reads_ones_from_huge_pages_where_the_system_offers_them(
    offered: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attn's weights and caches live in huge pages where there are any: the probe reads as they
    are read (from 4 KiB pages one thread read half as fast), every page written first."""
    if offered and not huge_pages.huge_pages_available():
        pytest.skip("this system offers no transparent huge pages")
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: offered)
    buffer = bench.measure.probe_buffer(8)
    assert buffer.dtype == torch.float32 and buffer.numel() == 8 * 2**20 // 4
    assert float(buffer.sum()) == buffer.numel()
    assert (huge_pages.huge_page_bytes(buffer) >= huge_pages.HUGE_PAGE) == offered


def test_llama_cpp_says_why_it_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    contender = LlamaCpp()
    monkeypatch.setattr("attn.bench.contenders.llama_cpp_available", lambda: False)
    assert "llama-cpp-python is not installed" in (contender.skip_reason(CellContext(tiny_cell(batch_size=1))) or "")
    monkeypatch.setattr("attn.bench.contenders.llama_cpp_available", lambda: True)
    assert contender.skip_reason(CellContext(tiny_cell(batch_size=1))) is None
    assert "batch 2: llama-cpp-python's Llama holds one sequence" in (
        contender.skip_reason(CellContext(tiny_cell(batch_size=2))) or ""
    )
    config = attn.DecoderConfig(max_seq_len=64, qk_norm=True, **TINY)
    reason = contender.skip_reason(CellContext(Cell("qk", config, torch.float32, 1, 1, 6, 5))) or ""
    assert reason.startswith("cannot export to GGUF: the config has q/k norms")


LLAMA_CPP_CONFIGS = {
    "gqa": {},
    "tied-biases-llama3": dict(
        tie_embeddings=True,
        qkv_bias=True,
        out_bias=True,
        rope_base=100_000.0,
        rope_scaling=RopeScaling("llama3", factor=8.0, original_max_seq_len=16),
    ),
    "yarn-head-dim": dict(head_dim=16, rope_scaling=RopeScaling("yarn", factor=4.0, original_max_seq_len=8)),
}


@pytest.mark.slow
@pytest.mark.llama_cpp  # needs llama-cpp-python, a source build (LLAMA_CPP_INSTALL)
@pytest.mark.parametrize("fields", LLAMA_CPP_CONFIGS.values(), ids=LLAMA_CPP_CONFIGS.keys())
def test_llama_cpp_generates_attns_greedy_tokens_and_logits(fields: dict) -> None:
    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed: pip install 'attn[llama-cpp]' (builds from source)")
    config = attn.DecoderConfig(max_seq_len=64, **{**TINY, **fields})
    ctx = CellContext(Cell("tiny", config, torch.float32, 1, 1, 12, 20), init_std=0.1)
    for parameter in ctx.reference_model.parameters():  # norms and biases away from 1 and 0
        if parameter.dim() == 1:
            parameter.data.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    reference = AttnEager("attn-eager", None, "").generate(ctx, 20, want_logits=True)
    contender = LlamaCpp()
    assert contender.skip_reason(ctx) is None
    contender.setup(ctx)
    got = contender.generate(ctx, 20, want_logits=True)
    assert check_tokens(reference.tokens, got.tokens, reference.logits).ok, (got.tokens, reference.tokens)
    torch.testing.assert_close(got.logits, reference.logits, rtol=1e-4, atol=1e-4)
    assert len(got.stamps) == 20 and got.stamps == sorted(got.stamps) and got.ttft > 0
    again = contender.generate(ctx, 20, want_logits=False)  # a second generation starts afresh
    assert torch.equal(again.tokens, got.tokens) and again.logits is None


@pytest.mark.slow
@pytest.mark.llama_cpp  # needs llama-cpp-python, a source build (LLAMA_CPP_INSTALL)
def test_llama_cpp_bf16_passes_the_logits_check() -> None:
    if not llama_cpp_available():
        pytest.skip("llama-cpp-python is not installed: pip install 'attn[llama-cpp]' (builds from source)")
    ctx = CellContext(Cell("tiny", attn.DecoderConfig(max_seq_len=64, **TINY), torch.bfloat16, 1, 1, 12, 20))
    contender = LlamaCpp()
    contender.setup(ctx)
    got = contender.generate(ctx, 20, want_logits=True)
    verdict = check_logits(ctx.reference_model, ctx.prompts, got.tokens, got.logits)
    assert verdict.ok, verdict.detail


@pytest.mark.slow  # inductor compiles the prefill and decode graphs
def test_torch_compiled_model_generates_eagers_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """The contender for users who compile the obvious way: ``torch.compile(model)``, then
    ``attn.generate``; its greedy tokens are eager's."""
    status = bench.main(["--cells", "tiny:fp32:1:1", *ARGS, "--contenders", "attn-eager,attn-torch-compile"])
    out = capsys.readouterr().out
    assert status == 0 and "attn-torch-compile" in out
    assert "correctness: all 2 checked contender runs agree" in out


def test_table_reports_the_check(capsys: pytest.CaptureFixture[str]) -> None:
    status = bench.main(["--cells", "tiny:fp32:1:1", *ARGS, "--contenders", "attn-eager,attn-nocache"])
    out = capsys.readouterr().out
    assert status == 0
    assert "attn-nocache" in out and "identical greedy tokens (5)" in out
    assert "correctness: all 2 checked contender runs agree" in out


def test_wrong_contender_fails_the_check() -> None:
    spec = BenchSpec(cells=[tiny_cell()], contenders=["attn-eager", WrongAnswer()], repeats=1, memory=False)
    result = run_benchmark(spec)
    rows = result.rows_of(result.cells[0].label)
    assert rows["attn-eager"].check_ok is True
    assert rows["attn-wrong"].check_ok is False
    assert "MISMATCH: 1 of 10 tokens differ; first at row 0, step 4" in rows["attn-wrong"].check
    table = bench.format_table(result)
    assert "CORRECTNESS: 1 contender(s) FAILED the check" in table


def test_check_tokens() -> None:
    reference = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert check_tokens(reference, reference.clone()).ok
    logits = torch.zeros(2, 3, 10)
    logits[1, 1, 5], logits[1, 1, 7] = 2.0, 1.5
    verdict = check_tokens(reference, torch.tensor([[1, 2, 3], [4, 7, 6]]), logits)
    assert not verdict.ok and "first at row 1, step 1 (7 instead of 5)" in verdict.detail
    assert "preferred its token by 0.5 logits" in verdict.detail
    assert not check_tokens(reference, reference[:, :2]).ok


def test_bf16_logits_check_passes_bf16_and_fails_a_wrong_answer() -> None:
    cell = tiny_cell(torch.bfloat16)
    ctx = CellContext(cell)
    run = AttnEager("attn-eager", CachePolicy.FLAG, "").generate(ctx, cell.new_tokens, want_logits=True)
    assert ctx.model.tok_embeddings.weight.dtype == torch.bfloat16
    assert check_logits(ctx.reference_model, ctx.prompts, run.tokens, run.logits).ok
    shuffled = run.logits.roll(1, dims=-1)  # plausible-looking numbers, wrong answer
    verdict = check_logits(ctx.reference_model, ctx.prompts, run.tokens, shuffled)
    assert not verdict.ok and verdict.detail.startswith("MISMATCH")
    assert not check_logits(ctx.reference_model, ctx.prompts, run.tokens, None).ok


@pytest.mark.slow  # a fresh process
def test_memory_probe_runs_in_a_fresh_process() -> None:
    from attn.bench.run import _run_probe

    spec = BenchSpec(cells=[], contenders=[], memory=True)
    # 5 s alone; once, in CI beside the matrix's legs, it ran past 300 s (the cause unproven: a
    # wait on a build of the kernels in another process is the likeliest). The error names the
    # phase it was in, and a wait on another process's build says so.
    probe, error = _run_probe(tiny_cell(), "attn-eager", spec, timeout=600)
    assert probe is not None, error
    assert probe["peak_rss_process_mb"] > 50  # torch alone is more than that
    if probe["peak_reset"]:
        assert probe["rss_before_mb"] <= probe["peak_rss_mb"] <= probe["peak_rss_process_mb"]  # reset: phase peak


def test_a_memory_probe_out_of_time_says_where_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from attn.bench.run import _run_probe

    real_run = subprocess.run
    stuck = (  # a probe that named its warm-up, then hung in it (a build elsewhere, a slow compile)
        "import sys, time\n"
        "print('memory probe: setting up the model', file=sys.stderr, flush=True)\n"
        "print('memory probe: the warm-up generation', file=sys.stderr, flush=True)\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setattr(
        run_module.subprocess, "run", lambda command, **kw: real_run([sys.executable, "-c", stuck], **kw)
    )
    started = time.monotonic()
    probe, error = _run_probe(tiny_cell(), "attn-eager", BenchSpec(cells=[], contenders=[]), timeout=3)
    assert probe is None and time.monotonic() - started < 60
    assert error == "memory probe timed out after 3 s; its last words: memory probe: the warm-up generation"


def test_the_memory_probe_names_each_phase_as_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    spec = BenchSpec(cells=[], contenders=[])
    payload = {
        "cell": run_module.cell_to_dict(tiny_cell()),
        "contender": "attn-eager",
        "seed": spec.seed,
        "init_std": spec.init_std,
        "checkpoint": None,
        "max_rows": spec.max_rows,
    }
    with warnings.catch_warnings():  # the probe sets its process's filters
        probe = run_module.memory_probe(payload)
    assert probe["peak_rss_process_mb"] > 50
    assert capsys.readouterr().err.splitlines() == [
        "memory probe: setting up the model",
        "memory probe: the warm-up generation (kernels built or loaded, steps compiled)",
        "memory probe: the timed generation",
    ]


def test_plot_or_a_clear_message(tmp_path: Path) -> None:
    spec = BenchSpec(cells=[tiny_cell()], contenders=["attn-eager", "attn-nocache"], repeats=1, memory=False)
    result = run_benchmark(spec)
    problem = bench.write_plot(result, tmp_path / "latency.png")
    if problem is None:
        assert (tmp_path / "latency.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in problem


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--contenders", "attn-eager,nonsense"])
    assert exit_info.value.code == 2
    assert "unknown --contenders ['nonsense']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--config", "no-such-config"])
    with pytest.raises(SystemExit):
        bench.main(["--cells", "small:fp64:1:1"])
    assert "is not CONFIG:DTYPE:BATCH:THREADS" in capsys.readouterr().err


def test_workloads_run_both_sides_and_check_them(capsys: pytest.CaptureFixture[str]) -> None:
    from attn.bench.workloads import WorkloadSpec, format_workloads, run_workloads

    spec = WorkloadSpec(
        config=attn.DecoderConfig(max_seq_len=8, **TINY),  # run_workloads widens it to fit
        grpo=(2, 3, 7, 4),  # B, G, P, N
        scoring=(2, 3, 9, 2),  # Q, K, C, m
        repeats=1,
    )
    results = run_workloads(spec)
    assert [r.name for r in results] == ["grpo", "scoring"]
    assert all(r.agree for r in results), [r.detail for r in results]
    assert all(r.ours_s.median > 0 and r.theirs_s.median > 0 for r in results)
    table = format_workloads(results, "test machine")
    assert "grpo: B=2 x G=3, prompt 7, 4 new" in table and "6/6 rows equal" in table
    assert "scoring: 2 questions x 3 choices, context 9, continuation 2" in table


def test_bf16_scoring_is_checked_against_an_fp32_copy() -> None:
    """In bf16 the two scoring paths' kernels differ by more than fp32's tolerance; each is
    checked against the fp32 copy's scores instead, and the detail says how far each is."""
    from attn.bench.workloads import WorkloadSpec, run_workloads

    spec = WorkloadSpec(
        config=attn.DecoderConfig(max_seq_len=8, **TINY),
        grpo=(1, 2, 5, 2),
        scoring=(3, 3, 9, 3),
        repeats=1,
        dtype=torch.bfloat16,
    )
    scoring = run_workloads(spec)[1]
    assert scoring.agree, scoring.detail
    assert "from an fp32 copy's scores: ours" in scoring.detail


def test_workloads_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--workloads", "--config", "tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "read bandwidth" in out and "speedup" in out and "DIFFER" not in out


def test_rl_runs_every_comparison_and_parity_is_exact(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["--rl", "--config", "tiny", "--rl-shape", "2,3,16,8", "--repeats", "1", "--threads", "1"]
    assert bench.main([*args, "--json", str(tmp_path / "rl.json")]) == 0
    document = json.loads((tmp_path / "rl.json").read_text())
    assert [c["name"] for c in document["comparisons"]] == ["logprobs", "policy step"]
    assert {g["mode"] for g in document["parity_gap"] if g["max_abs"] == 0.0} >= {"attn parity"}
    out = capsys.readouterr().out
    assert "logprobs: log-probs agree" in out and "target >= 3.0x" in out and "target >= 1.5x" in out
    assert "peak RSS" in out and "read bandwidth" in out
    for phase in ("prefill (2 x 16)", "decode step (6 rows)", "policy step"):
        assert f"  {phase}" in out
    assert "attn parity          bf16 max |diff| 0;" in out and "attn parity          fp32 max |diff| 0;" in out
    assert "transformers" in out


def test_rl_refuses_a_bad_shape(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--rl", "--config", "tiny", "--rl-shape", "2,3,16"])
    assert "--rl-shape takes four positive ints B,G,P,N, got [2, 3, 16]" in capsys.readouterr().err


@needs_bf16_matvec
def test_a_timed_generation_stamps_every_pass_of_the_native_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where attn::decode_loop runs many passes a call, each pass still gets a stamp (an even
    share of its call's time), so the decode speed counts every pass."""
    model = tiny_model(head_dim=16, hidden_dim=64).to(torch.bfloat16)
    calls: list[int] = []
    op = torch.ops.attn.decode_loop
    monkeypatch.setattr(torch.ops.attn, "decode_loop", lambda *args: calls.append(op(*args)) or calls[-1])
    timed = _Timed(model)
    start = time.perf_counter()
    attn.generate(timed, [[1, 2, 3]], max_new_tokens=40)
    end = time.perf_counter()
    assert sum(calls) == 39 and len(calls) > 1  # the loop ran the decode passes, in several calls
    assert len(timed.stamps) == 40  # the prefill's and one a decode pass
    assert start < timed.stamps[0] and timed.stamps == sorted(timed.stamps) and timed.stamps[-1] <= end
    generated = Generated(torch.zeros(1, 40), None, start, timed.stamps)
    assert generated.decode_tokens_per_s(1) == pytest.approx(39 / (timed.stamps[-1] - timed.stamps[0]))
