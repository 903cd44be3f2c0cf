"""The version matrix as data: loads compat/matrix.toml and renders the README's policy table.

A leg names a torch release and how to test it; what the release must do is its row of
``attn.compat.RELEASES`` (``release_support(version)``), never restated here. Standard
library only: compat/noxfile.py and compat/run.py import it with whatever python runs them,
before any leg environment exists, and the tests import it by path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport, same API
    import tomli as tomllib

MATRIX_FILE = Path(__file__).with_name("matrix.toml")
FLOATING = ("latest", "nightly")  # legs whose release is resolved when the run starts

TABLE_START = "<!-- policy-table:start -->"
TABLE_END = "<!-- policy-table:end -->"


@dataclass(frozen=True)
class Leg:
    """One torch release of the matrix and how to test it (what it must do: attn.compat.RELEASES)."""

    name: str
    torch: str
    tests: str | tuple[str, ...] = "core"
    probe_error: str | None = None
    index_env: str | None = None
    why: str = ""

    @property
    def session(self) -> str:
        """The leg's nox session: ``nox -f compat/noxfile.py -s 'leg(2.6.0)'``."""
        return f"leg({self.name})"

    @property
    def floating(self) -> bool:
        """Is the release resolved at run time (``latest``, ``nightly``)?"""
        return self.torch in FLOATING

    @property
    def fixed_version(self) -> str | None:
        return None if self.floating else self.torch


@dataclass(frozen=True)
class Settings:
    home: str = "~/.cache/attn-matrix"
    min_free_gb: float = 15.0
    jobs: int = 1
    probe_backends: tuple[str, ...] = ("eager", "aot_eager")
    sequence_backends: tuple[str, ...] = ("eager", "inductor")
    core_tests: tuple[str, ...] = field(default_factory=tuple)

    @property
    def home_path(self) -> Path:
        return Path(os.path.expanduser(os.environ.get("ATTN_MATRIX_HOME") or self.home))

    def env_path(self, leg: Leg) -> Path:
        """The leg's environment: nox names it after the session, ``leg(2.6.0)`` -> ``leg-2-6-0``
        (the noxfile checks that nox agrees)."""
        return self.home_path / re.sub(r"[^0-9A-Za-z_]+", "-", leg.session).strip("-").lower()


@dataclass(frozen=True)
class Matrix:
    settings: Settings
    legs: tuple[Leg, ...]

    def leg(self, name: str) -> Leg:
        for leg in self.legs:
            if leg.name == name:
                return leg
        names = ", ".join(leg.name for leg in self.legs)
        raise KeyError(f"no leg named {name!r} in {MATRIX_FILE.name}; legs: {names}")

    def test_files(self, leg: Leg) -> tuple[str, ...] | None:
        """The test files a leg runs, or ``None`` for the whole suite."""
        if leg.tests == "all":
            return None
        if leg.tests == "core":
            return self.settings.core_tests
        return tuple(leg.tests)


_VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def load(path: Path = MATRIX_FILE) -> Matrix:
    """Reads and validates the matrix; raises ValueError naming the bad field."""
    with open(path, "rb") as handle:
        data = tomllib.load(handle)
    raw_settings = data.get("settings", {})
    settings = Settings(
        home=raw_settings.get("home", Settings.home),
        min_free_gb=float(raw_settings.get("min_free_gb", Settings.min_free_gb)),
        jobs=int(raw_settings.get("jobs", Settings.jobs)),
        probe_backends=tuple(raw_settings.get("probe_backends", Settings.probe_backends)),
        sequence_backends=tuple(raw_settings.get("sequence_backends", Settings.sequence_backends)),
        core_tests=tuple(raw_settings.get("core_tests", ())),
    )
    legs = []
    known = set(Leg.__dataclass_fields__)
    for index, raw in enumerate(data.get("leg", [])):
        where = f"{path.name} leg #{index + 1} ({raw.get('name', '?')})"
        unknown = set(raw) - known
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}. What a release must do "
                "is not a leg field: it is the release's row of attn.compat.RELEASES (release_support(version))"
            )
        missing = {"name", "torch"} - set(raw)
        if missing:
            raise ValueError(f"{where}: missing field(s) {sorted(missing)}")
        if raw["torch"] not in FLOATING and not _VERSION.match(raw["torch"]):
            raise ValueError(f"{where}: torch is {raw['torch']!r}; use X.Y.Z, 'latest' or 'nightly'")
        if raw["torch"] == "nightly" and not raw.get("index_env"):
            raise ValueError(f"{where}: a nightly leg needs index_env (the variable naming its index)")
        tests = raw.get("tests", "core")
        if not isinstance(tests, str):
            tests = tuple(tests)
        elif tests not in ("all", "core"):
            raise ValueError(f"{where}: tests is {tests!r}; use 'all', 'core' or a list of files")
        legs.append(Leg(**{**raw, "tests": tests}))
    names = [leg.name for leg in legs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path.name}: leg names repeat: {names}")
    return Matrix(settings, tuple(legs))


def render_policy_table(matrix: Matrix | None = None, releases=None) -> str:
    """The README's policy table (markers included): one row per ``attn.compat.RELEASES`` row.

    Each row says what the release can do with the inference-mode test under compile, what
    it costs, the matrix legs that prove it (compat/matrix.toml), and why. ``releases``
    defaults to ``attn.compat.RELEASES`` (imported here, so this needs torch and attn).
    """
    matrix = matrix or load()
    if releases is None:
        from attn.compat import RELEASES as releases
    from attn.policy import DEFAULT_POLICY

    lines = [
        TABLE_START,
        "| torch | default policy | fullgraph traces `x.is_inference()` | ... with a sound guard "
        "| graph breaks per compiled forward that tests inference mode | proven on (compat/ legs) | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in releases:
        legs = [
            leg.name if not leg.floating else f"`{leg.name}`"
            for leg in matrix.legs
            if (leg.floating and row.last is None)
            or (
                not leg.floating
                and row.first <= _release(leg.torch)
                and (row.last is None or _release(leg.torch) < row.last)
            )
        ]
        traces = "yes" if row.traces_is_inference else "no"
        guarded = "yes" if row.decides_in_graph else "no"
        lines.append(
            f"| {row.label} | `{DEFAULT_POLICY.value}` | {traces} | {guarded} | {row.graph_breaks_per_forward} "
            f"| {', '.join(legs) or 'none'} | {row.reason} |"
        )
    lines.append(TABLE_END)
    return "\n".join(lines)


def _release(version: str) -> tuple[int, int, int]:
    major, minor, micro = (int(part) for part in version.split("."))
    return (major, minor, micro)


def readme_policy_table(readme_text: str) -> str | None:
    """The policy table block found in README text (markers included), or None."""
    start = readme_text.find(TABLE_START)
    end = readme_text.find(TABLE_END)
    if start < 0 or end < start:
        return None
    return readme_text[start : end + len(TABLE_END)]
