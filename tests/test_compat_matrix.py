"""The version matrix (compat/) names releases; attn.compat.RELEASES says what each must do.

Each leg of compat/matrix.toml names a torch release, and the runner proves, on that release,
the row of ``attn.compat.RELEASES`` that covers it. Here, on whatever release is installed:
every row has a leg, the matrix restates no row (one table, no copy to drift), the runner
lists the matrix's legs, and the README's policy table is the one the two render.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn import compat
from attn.compat import RELEASES

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def _load_compat_module(file: str):
    """A script of compat/, imported by path (compat/ is not a package of the distribution;
    run.py puts compat/ on sys.path for its own imports)."""
    name = f"attn_compat_{Path(file).stem}"
    spec = importlib.util.spec_from_file_location(name, REPO / "compat" / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


matrix_data = _load_compat_module("matrix.py")
MATRIX = matrix_data.load()
FIXED = [leg for leg in MATRIX.legs if leg.fixed_version]


@pytest.mark.parametrize("row", RELEASES, ids=[row.label for row in RELEASES])
def test_every_release_row_is_proven_on_a_leg(row) -> None:
    versions = [compat.parse_torch_version(leg.fixed_version) for leg in FIXED]
    assert any(row.contains(version) for version in versions), (
        f"RELEASES row {row.label!r} has no leg in compat/matrix.toml: add one for a release it covers"
    )


def test_floating_legs_have_the_open_ended_row() -> None:
    # `latest` and `nightly` are newer than every release the table names: compat/legs.py
    # holds them to the one open-ended row.
    assert [row.last for row in RELEASES].count(None) == 1
    assert {leg.name for leg in MATRIX.legs if leg.floating} == {"latest", "nightly"}


def test_matrix_names_the_required_legs() -> None:
    names = {leg.name for leg in MATRIX.legs}
    assert {"2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.13.0", "latest", "nightly"} <= names


@pytest.mark.parametrize(
    "claim", ["traces_is_inference = true", 'policy = "inference"', "graph_breaks_per_forward = 1"]
)
def test_matrix_refuses_a_leg_that_restates_the_release_table(tmp_path: Path, claim: str) -> None:
    text = (REPO / "compat" / "matrix.toml").read_text().replace('name = "2.6.0"', f'name = "2.6.0"\n{claim}', 1)
    bad = tmp_path / "matrix.toml"
    bad.write_text(text)
    field = claim.split(" ")[0]
    with pytest.raises(
        ValueError, match=rf"leg #2 \(2\.6\.0\): unknown field\(s\) \['{field}'\].*attn\.compat\.RELEASES"
    ):
        matrix_data.load(bad)


def test_matrix_rejects_a_bad_test_selection(tmp_path: Path) -> None:
    text = (REPO / "compat" / "matrix.toml").read_text().replace('tests = "core"', 'tests = "cor"', 1)
    bad = tmp_path / "matrix.toml"
    bad.write_text(text)
    with pytest.raises(ValueError, match="tests is 'cor'"):
        matrix_data.load(bad)


def test_runner_lists_the_legs_with_the_standard_library_alone() -> None:
    out = subprocess.run(
        [sys.executable, "-I", str(REPO / "compat" / "run.py"), "--list-json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == [leg.name for leg in MATRIX.legs]


def test_readme_policy_table_matches_matrix() -> None:
    path = REPO / "README.md"
    readme = path.read_text(encoding="utf-8") if path.exists() else ""
    block = matrix_data.readme_policy_table(readme)
    expected = matrix_data.render_policy_table(MATRIX, RELEASES)
    assert block is not None, (
        "README.md has no policy table; paste the output of `.venv/bin/python compat/run.py --policy-table`"
    )
    assert block == expected, (
        "README.md's policy table differs from attn.compat.RELEASES and compat/matrix.toml's legs; replace it "
        "with the output of `.venv/bin/python compat/run.py --policy-table`"
    )


class FakeLeg:
    """Stands in for a leg's nox process: it ends after ``polls`` polls."""

    def __init__(self, leg, polls: int, log: dict) -> None:
        self.leg, self.polls, self.log = leg, polls, log
        log["running"].add(leg.name)
        log["most"] = max(log["most"], len(log["running"]))
        log["started"].append(leg.name)

    def poll(self) -> int | None:
        self.polls -= 1
        return 0 if self.polls < 0 else None

    def finish(self) -> list[dict]:
        self.log["running"].remove(self.leg.name)
        return [{"args": {"name": self.leg.name}, "result": "success"}]


@given(
    picks=st.lists(st.sampled_from(MATRIX.legs), unique_by=lambda leg: leg.name, min_size=1),
    jobs=st.integers(1, 8),
    durations=st.lists(st.integers(0, 5), min_size=len(MATRIX.legs), max_size=len(MATRIX.legs)),
)
def test_the_runner_runs_every_leg_once_from_a_queue_at_most_jobs_at_a_time(
    picks: list, jobs: int, durations: list[int]
) -> None:
    log: dict = {"running": set(), "most": 0, "started": []}
    polls = dict(zip((leg.name for leg in MATRIX.legs), durations, strict=True))

    def start(leg) -> FakeLeg:
        # a leg starts only when a slot is free, and no slot stays free while legs wait
        assert len(log["running"]) < jobs
        return FakeLeg(leg, polls[leg.name], log)

    sessions = _load_compat_module("run.py").run_pool(picks, jobs, start, poll_seconds=0)
    assert log["started"] == [leg.name for leg in picks]  # in the queue's order
    assert sorted(entry["args"]["name"] for entry in sessions) == sorted(leg.name for leg in picks)
    assert log["most"] == min(jobs, len(picks)) and not log["running"]


def test_the_longest_legs_start_first() -> None:
    """The queue's order: the core legs, then the short ones, so they fill the gaps at the end."""
    runner = _load_compat_module("run.py")
    order = sorted(MATRIX.legs, key=runner.leg_weight, reverse=True)
    weights = [runner.leg_weight(leg) for leg in order]
    assert all(leg.tests in ("core", "all") for leg in order[: sum(w >= 5 for w in weights)])
    assert weights == sorted(weights, reverse=True) and weights[0] > weights[-1]
