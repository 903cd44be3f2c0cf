"""The version matrix (compat/matrix.toml) and the package's release table agree.

Each leg of the matrix states the policy and tracing support its release must show; the
runner proves them on that release. Here, on whatever release is installed, every leg's
statement is checked against ``attn.compat.RELEASES`` (so the two cannot drift apart), and
the README's policy table against the matrix (so the README cannot drift either).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from attn import compat
from attn.compat import RELEASES, release_support

REPO = Path(__file__).resolve().parent.parent


def _load_matrix_module():
    """compat/matrix.py, imported by path (compat/ is not a package of the distribution)."""
    name = "attn_version_matrix"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "compat" / "matrix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


matrix_data = _load_matrix_module()
MATRIX = matrix_data.load()
FIXED = [leg for leg in MATRIX.legs if leg.fixed_version]
FLOATING = [leg for leg in MATRIX.legs if leg.floating]


@pytest.mark.parametrize("leg", FIXED, ids=[leg.name for leg in FIXED])
def test_fixed_leg_agrees_with_release_table(leg) -> None:
    row = release_support(leg.fixed_version)
    assert row.default_policy.value == leg.policy, (
        f"compat/matrix.toml leg {leg.name} expects policy {leg.policy!r}, but RELEASES row "
        f"{row.label!r} gives {row.default_policy.value!r}"
    )
    assert row.traces_is_inference == leg.traces_is_inference, (
        f"compat/matrix.toml leg {leg.name} expects traces_is_inference={leg.traces_is_inference}, but "
        f"RELEASES row {row.label!r} says {row.traces_is_inference}"
    )


@pytest.mark.parametrize("leg", FLOATING, ids=[leg.name for leg in FLOATING])
def test_floating_leg_agrees_with_open_ended_row(leg) -> None:
    # `latest` and `nightly` are newer than every release the table names: the last,
    # open-ended row covers them.
    open_ended = [row for row in RELEASES if row.last is None]
    assert len(open_ended) == 1
    row = open_ended[0]
    assert (row.default_policy.value, row.traces_is_inference) == (leg.policy, leg.traces_is_inference)


@pytest.mark.parametrize("row", RELEASES, ids=[row.label for row in RELEASES])
def test_every_release_row_is_proven_on_a_leg(row) -> None:
    versions = [compat.parse_torch_version(leg.fixed_version) for leg in FIXED]
    assert any(row.contains(version) for version in versions), (
        f"RELEASES row {row.label!r} has no leg in compat/matrix.toml: add one for a release it covers"
    )


def test_stale_graph_check_runs_wherever_tracing_succeeds() -> None:
    # The stale-graph check decides the default policy of a release that can trace
    # is_inference(); elsewhere compiled code never sees the branch.
    for leg in MATRIX.legs:
        assert leg.stale_graph == leg.traces_is_inference, leg.name


def test_policy_inference_only_where_tracing_succeeds() -> None:
    for leg in MATRIX.legs:
        if leg.policy == "inference":
            assert leg.traces_is_inference, f"leg {leg.name}: INFERENCE by default needs is_inference() to trace"


def test_matrix_names_the_required_legs() -> None:
    names = {leg.name for leg in MATRIX.legs}
    assert {"2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.13.0", "latest", "nightly"} <= names


def test_matrix_rejects_a_bad_policy(tmp_path: Path) -> None:
    text = (REPO / "compat" / "matrix.toml").read_text().replace('policy = "flag"', 'policy = "flagg"', 1)
    bad = tmp_path / "matrix.toml"
    bad.write_text(text)
    with pytest.raises(ValueError, match="policy is 'flagg'"):
        matrix_data.load(bad)


def test_readme_policy_table_matches_matrix() -> None:
    path = REPO / "README.md"
    readme = path.read_text(encoding="utf-8") if path.exists() else ""
    block = matrix_data.readme_policy_table(readme)
    expected = matrix_data.render_policy_table(MATRIX, RELEASES)
    assert block is not None, (
        "README.md has no policy table; paste the output of `.venv/bin/python compat/run.py --policy-table`"
    )
    assert block == expected, (
        "README.md's policy table differs from compat/matrix.toml; replace it with the output of "
        "`.venv/bin/python compat/run.py --policy-table`"
    )
