"""The command line (attn/cli.py, attn/__main__.py): demo, info, bench, and usage errors."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest

import attn
from attn import cli

ROOT = Path(__file__).resolve().parents[1]


def run_attn(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != attn.compat.ENV_VAR}
    return subprocess.run(
        [sys.executable, "-m", "attn", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_demo_subprocess_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "demo.json"
    proc = run_attn("demo", "--steps", "20", "--seed", "3", "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "training [" in proc.stderr  # the progress bar
    for section in ("1. train", "2. eval", "3. PPO", "4. LoRA-PPO", "5. every kind of pass", "tokens/s"):
        assert section in proc.stdout, section
    result = json.loads(path.read_text())
    assert result["ok"] is True and result["violations"] == []
    assert result["options"]["steps"] == 20 and result["options"]["seed"] == 3
    assert result["policy"]["policy"] == attn.compat.DEFAULT_POLICY.value
    assert result["environment"]["torch"] == __import__("torch").__version__
    passes = result["passes"]
    assert len(passes) == 20  # the speed comparison times each way 3 times
    for record in passes:
        assert record["ok"] and record["used_cache"] == record["expect_cache"], record
        assert len(record["fill_before"]) == 2  # one per layer
        if not record["expect_cache"]:
            assert record["fill_before"] == record["fill_after"] and not record["buffers_changed"], record
    kinds = {(p["pattern"], p["expect_cache"]) for p in passes}
    assert {("train", False), ("eval", True), ("eval", False), ("ppo", True), ("ppo", False)} <= kinds
    assert {("lora-ppo", True), ("lora-ppo", False), ("speed", True), ("speed", False)} <= kinds
    assert result["train"]["steps"] == 20 and result["train"]["passes"][0]["count"] == 20
    assert result["eval"]["scores_match"] and result["eval"]["scores_bit_identical_to_never_cached_copy"]
    assert result["ppo"]["generated_tokens_are_inference_tensors"] is False
    assert result["speed"]["cached_tokens_per_s"] > 0 and result["speed"]["uncached_tokens_per_s"] > 0
    assert result["speed"]["same_tokens"] is True
    assert result["seconds"]["total"] > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["dance"], "invalid choice: 'dance'"),
        (["demo", "--steps", "0"], "--steps: expected a positive integer, got 0"),
        (["demo", "--steps", "many"], "--steps: expected a positive integer, got 'many'"),
        (["demo", "--seed", "x"], "--seed: expected an integer, got 'x'"),
        (["demo", "--policy", "always"], "--policy: invalid choice: 'always'"),
        (["demo", "--backend", "eager"], "--backend only applies with --compile"),
        (["demo", "--json", "/no/such/folder/out.json"], "folder /no/such/folder does not exist"),
        (["demo", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["info", "--probe", "yes"], "unrecognized arguments: yes"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: attn" in err and message in err, err
    assert "Traceback" not in err


def test_python_dash_m_attn_exits_with_the_usage_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``python -m attn`` (attn/__main__.py) exits with main()'s status: 2, no traceback."""
    monkeypatch.setattr(sys, "argv", ["attn", "demo", "--steps", "-5"])
    monkeypatch.delitem(sys.modules, "attn.__main__", raising=False)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("attn", run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: attn demo" in err and "expected a positive integer, got -5" in err


def test_help_and_version(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "info" in out and "bench" in out and "lm-eval" in out
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--compile", "--policy", "--seed", "--steps", "--json"):
        assert option in out
    assert cli.main(["--version"]) == 0
    assert attn.__version__ in capsys.readouterr().out


def test_info(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    decision = attn.compat.cache_policy()
    assert f"torch:               {__import__('torch').__version__}" in out
    assert f"cache policy:        {decision.policy.value}" in out
    assert decision.reason in out
    assert "traces is_inference:" in out and "python:" in out and "platform:" in out
    assert "probe" not in out


def test_info_probe(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["info", "--probe"]) == 0
    out = capsys.readouterr().out
    decides = attn.compat.release_support().decides_in_graph
    assert "probe (fullgraph):" in out and "agrees" in out and "DISAGREES" not in out
    assert ("probe (fullgraph):   yes" in out) == decides


def test_bench_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    fake = types.ModuleType("attn.bench")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "attn.bench", fake)
    assert cli.main(["bench", "--help", "--steps", "3"]) == 7
    assert seen == [["--help", "--steps", "3"]]


def test_bench_without_the_module_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "attn.bench", None)  # as if attn/bench.py did not exist
    assert cli.main(["bench"]) == 1
    err = capsys.readouterr().err
    assert "attn.bench is not part of this installation" in err and "Traceback" not in err


def test_lm_eval_without_the_harness_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-evaluation-harness were not installed
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)
    assert cli.main(["lm-eval", "run", "--model", "attn"]) == 1
    err = capsys.readouterr().err
    assert "lm-evaluation-harness is not installed; pip install 'attn[lm-eval]'" in err


def test_lm_eval_help_is_the_harness_help_and_restores_argv(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("lm_eval")
    before = list(sys.argv)
    assert cli.main(["lm-eval", "run", "--help"]) == 0
    assert "--model_args" in capsys.readouterr().out
    assert sys.argv == before
