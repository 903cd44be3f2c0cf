"""attn/compat.py: version parsing, the release table, policy resolution, warnings, probe."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attn import compat
from attn.compat import TorchVersion, parse_torch_version, release_support


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.13.0+cpu", TorchVersion(2, 13, 0, None, "cpu")),
        ("2.16.0.dev20261101", TorchVersion(2, 16, 0, "dev20261101", None)),
        ("2.6.0a0+git1234", TorchVersion(2, 6, 0, "a0", "git1234")),
        ("2.7.0rc1", TorchVersion(2, 7, 0, "rc1", None)),
        ("2.8.0+cu128", TorchVersion(2, 8, 0, None, "cu128")),
        ("2.5.1", TorchVersion(2, 5, 1, None, None)),
        ("2.10", TorchVersion(2, 10, 0, None, None)),
        ("2.9.0a0.dev20250101+gitabc", TorchVersion(2, 9, 0, "a0.dev20250101", "gitabc")),
    ],
)
def test_parse_torch_version(text: str, expected: TorchVersion) -> None:
    assert parse_torch_version(text) == expected


@pytest.mark.parametrize("text", ["", "two.six", "2", "2.x.0", "2.6.0 extra"])
def test_parse_torch_version_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse torch version"):
        parse_torch_version(text)


@given(
    st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30)),
    st.tuples(st.integers(0, 30), st.integers(0, 30), st.integers(0, 30)),
)
def test_versions_compare_as_numbers(a: tuple[int, int, int], b: tuple[int, int, int]) -> None:
    va, vb = parse_torch_version("{}.{}.{}+cpu".format(*a)), parse_torch_version("{}.{}.{}".format(*b))
    assert (va.release < vb.release) == (a < b)
    assert parse_torch_version(str(va)) == va


def test_two_ten_is_newer_than_two_eight() -> None:
    assert parse_torch_version("2.10.0").release > parse_torch_version("2.8.0").release
    assert release_support("2.10.0") is release_support("2.8.0")


@pytest.mark.parametrize(
    ("version", "traces"),
    [
        ("2.4.1", False),
        ("2.5.1", False),
        ("2.6.0", True),
        ("2.6.0a0+git1234", True),
        ("2.7.1", True),
        ("2.8.0", False),
        ("2.10.0", False),
        ("2.13.0+cpu", False),
        ("2.16.0.dev20261101", False),
        ("3.0.0", False),
    ],
)
def test_release_table(version: str, traces: bool) -> None:
    row = release_support(version)
    assert row.traces_is_inference is traces
    # Where it traces (2.6, 2.7) the guard is unsound: no release decides inside the graph.
    assert not row.decides_in_graph and row.graph_breaks_per_forward == 1
    assert row.reason


def test_release_table_is_contiguous_and_total() -> None:
    rows = compat.RELEASES
    assert rows[0].first == (0, 0, 0) and rows[-1].last is None
    for earlier, later in itertools.pairwise(rows):
        assert earlier.last == later.first
    assert all(r.traces_is_inference for r in rows if r.guards_is_inference)  # a guard needs a trace


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_probe_agrees_with_release_table(backend: str) -> None:
    result = compat.probe_is_inference_trace(backend)
    row = release_support()
    assert result.traced is row.traces_is_inference, result.error
    assert result.decides_in_graph is row.decides_in_graph, result.error
    assert (result.error is None) is result.decides_in_graph


def test_report_names_the_version_and_its_row() -> None:
    report = compat.compat_report()
    row = compat.release_support()
    assert torch.__version__ in report and row.label in report and row.reason in report
