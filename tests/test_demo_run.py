"""The whole demo in process (attn/demo/run.py, attn/demo/report.py): it must fail loudly.

A demo that reports success whatever happens proves nothing, so these tests break the patterns
on purpose and check that the demo notices, names the pass, and exits 1.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import attn
from attn import cli
from attn.demo import patterns
from attn.demo.report import summary, table
from attn.demo.run import DemoOptions, run_demo
from attn.demo.watch import base_model

pytestmark = pytest.mark.usefixtures("restore_policy")


def test_run_demo_reports_every_pass(capsys: pytest.CaptureFixture) -> None:
    lines: list[str] = []
    result = run_demo(DemoOptions(steps=5, batch_size=8, speed_tokens=8), say=lines.append)
    assert result.ok, result.violations()
    assert len(result.records) == 20 and all(r.ok for r in result.records)
    assert result.caches_still_setup
    text = "\n".join(lines) + "\n" + table(result) + "\n" + summary(result)
    for expected in ("1. train", "2. eval", "3. PPO", "4. LoRA-PPO", "VIOLATION", "ok: all 20 blocks"):
        assert (expected in text) == (expected != "VIOLATION"), expected
    assert "training: 100%" in capsys.readouterr().err  # tqdm's bar, to stderr
    json.dumps(result.to_dict())  # JSON-serialisable as it is


@pytest.mark.slow  # a whole demo run (3-4 s)
def test_demo_fails_loudly_when_generation_skips_the_cache(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """Generation on a copy of the model (which makes its own cache) leaves the model's cache
    empty where it should have filled: the demo must exit 1 and say which pass."""

    def generate_elsewhere(model: torch.nn.Module, prompts: list, **kwargs: object) -> attn.GenerationOutput:
        elsewhere = copy.deepcopy(base_model(model))
        elsewhere.teardown_caches()  # generate sets up a cache of its own on the copy
        return attn.generate(elsewhere, prompts, **kwargs)

    monkeypatch.setattr(patterns, "generate", generate_elsewhere)
    path = tmp_path / "out.json"
    assert cli.main(["demo", "--steps", "3", "--json", str(path)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "VIOLATION" in captured.out
    assert "eval: generation task: attn.generate: should have used the cache" in captured.out
    assert "attn demo: FAILED" in captured.err
    result = json.loads(path.read_text())
    assert result["ok"] is False and result["violations"]


@pytest.mark.slow  # a whole demo run (3-4 s)
def test_demo_fails_loudly_when_scoring_writes_the_cache(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A scoring pass under plain inference mode (not no_grad) writes the cache under the
    default policy (the bug this library exists to prevent): the demo must catch it."""
    loglikelihood_task = patterns.loglikelihood_task

    def forgetful(model: torch.nn.Module, task: object, problems: list) -> tuple[float, torch.Tensor]:
        with torch.inference_mode():
            model(task.teacher_forcing(problems)[0])  # one row per problem: the cache's batch size
        return loglikelihood_task(model, task, problems)

    monkeypatch.setattr(patterns, "loglikelihood_task", forgetful)
    assert cli.main(["demo", "--steps", "3", "--policy", "inference"]) == 1
    out = capsys.readouterr().out
    assert "eval: log-likelihood task: torch.no_grad(): should have left the cache untouched" in out
    assert "fill positions [10, 10] -> [21, 21]" in out


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"DemoOptions.steps must be a positive int, got 0"):
        DemoOptions(steps=0)
    with pytest.raises(ValueError, match=r"DemoOptions.policy must be None, 'inference' or 'flag', got 'x'"):
        DemoOptions(policy="x")
