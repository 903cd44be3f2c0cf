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


def _leg_claims(leg) -> tuple:
    return (leg.policy, leg.traces_is_inference, leg.decides_in_graph, leg.graph_breaks_per_forward)


def _row_claims(row) -> tuple:
    return (compat.DEFAULT_POLICY.value, row.traces_is_inference, row.decides_in_graph, row.graph_breaks_per_forward)


@pytest.mark.parametrize("leg", FIXED, ids=[leg.name for leg in FIXED])
def test_fixed_leg_agrees_with_release_table(leg) -> None:
    row = release_support(leg.fixed_version)
    assert _leg_claims(leg) == _row_claims(row), (
        f"compat/matrix.toml leg {leg.name} claims (policy, traces, decides in graph, graph breaks) "
        f"{_leg_claims(leg)}, but RELEASES row {row.label!r} gives {_row_claims(row)}"
    )


@pytest.mark.parametrize("leg", FLOATING, ids=[leg.name for leg in FLOATING])
def test_floating_leg_agrees_with_open_ended_row(leg) -> None:
    # `latest` and `nightly` are newer than every release the table names: the last,
    # open-ended row covers them.
    open_ended = [row for row in RELEASES if row.last is None]
    assert len(open_ended) == 1
    assert _leg_claims(leg) == _row_claims(open_ended[0])


@pytest.mark.parametrize("row", RELEASES, ids=[row.label for row in RELEASES])
def test_every_release_row_is_proven_on_a_leg(row) -> None:
    versions = [compat.parse_torch_version(leg.fixed_version) for leg in FIXED]
    assert any(row.contains(version) for version in versions), (
        f"RELEASES row {row.label!r} has no leg in compat/matrix.toml: add one for a release it covers"
    )


def test_the_default_policy_is_the_same_on_every_leg() -> None:
    assert {leg.policy for leg in MATRIX.legs} == {compat.DEFAULT_POLICY.value}


def test_matrix_names_the_required_legs() -> None:
    names = {leg.name for leg in MATRIX.legs}
    assert {"2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.13.0", "latest", "nightly"} <= names


def test_matrix_rejects_a_bad_policy(tmp_path: Path) -> None:
    text = (REPO / "compat" / "matrix.toml").read_text().replace('policy = "inference"', 'policy = "flagg"', 1)
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
