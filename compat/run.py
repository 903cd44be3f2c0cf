"""Runs the version matrix: each leg's torch release in its own environment, three checks each.

Usage (from the repository root; standard library only, any python3 >= 3.11)::

    python3 compat/run.py                 # every leg
    python3 compat/run.py 2.6.0 latest    # some legs
    python3 compat/run.py --list          # the legs and what each expects
    python3 compat/run.py --clean [LEG..] # remove leg environments (all when none named)
    python3 compat/run.py --rebuild LEG   # remove, then build and run
    .venv/bin/python compat/run.py --policy-table  # the README's policy table (needs attn installed)

Per leg: resolve the release (``latest``: the newest release the package index serves now;
``nightly``: only when the leg's index variable is set), build or reuse the environment in
``$ATTN_MATRIX_HOME/<leg>`` (default ``~/.cache/attn-matrix``), install torch first with
``==``, then the project editable with its test extra under a constraint that pins that
torch; run compat/legs.py (policy, probe, sequences) and pytest. A table of all legs comes
last. Exit status: 0 when every leg that ran passed, 1 otherwise. A nightly leg that did not
run is reported as NOT RUN, never as passed, and does not change the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix as matrix_data

REPO = Path(__file__).resolve().parent.parent
LEGS_SCRIPT = Path(__file__).resolve().with_name("legs.py")
STAMP = "attn-matrix.json"
PIP_QUIET = ["--quiet", "--progress-bar", "off"]
# torch wheels (2.5 GB each for CUDA builds) skip pip's cache: each leg needs another one.
# The project's other dependencies are the same on every leg and may use it.
NO_CACHE = ["--no-cache-dir"]
# Wall-clock limits of the steps of one leg, in seconds.
INSTALL_TIMEOUT = 40 * 60
CHECKS_TIMEOUT = 20 * 60
TESTS_TIMEOUT = 30 * 60


def say(text: str = "") -> None:
    print(text, flush=True)


def banner(text: str) -> None:
    say("")
    say("=" * 78)
    say(text)
    say("=" * 78)


@dataclass
class LegResult:
    leg: str
    status: str = "FAILED"  # passed | FAILED | NOT RUN
    torch: str = "-"
    policy: str = "-"
    probe: str = "-"
    sequences: str = "-"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class LegError(Exception):
    """A step of a leg failed; the message says which and why."""


# --- running commands -----------------------------------------------------------------------


def run(
    cmd: list[str], *, env: dict | None = None, timeout: float | None = None, capture: bool = False, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Runs a command, streaming its output unless ``capture``; never reads stdin."""
    if not capture:
        say(f"$ {' '.join(cmd)}")
    try:
        return subprocess.run(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.STDOUT if capture else None,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise LegError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc


def base_env() -> dict:
    """The environment legs run in: the leg's default policy, no stray venv or pythonpath."""
    env = dict(os.environ)
    for name in ("ATTN_CACHE_POLICY", "VIRTUAL_ENV", "PYTHONPATH", "PIP_REQUIRE_VIRTUALENV"):
        env.pop(name, None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip_env(leg: matrix_data.Leg) -> dict:
    env = base_env()
    if leg.lift_pip_cap:
        # This machine's pip config caps torch at the release on its disk; this leg needs
        # whatever the index serves, so it reads no pip config file at all.
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


# --- resolving the release ------------------------------------------------------------------

_PLAIN = re.compile(r"^\d+(\.\d+)*$")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def resolve_latest(leg: matrix_data.Leg) -> str:
    """The newest final release of torch the package index serves right now."""
    env = pip_env(leg)
    out = run([sys.executable, "-m", "pip", "index", "versions", "torch"], env=env, capture=True, timeout=300)
    match = re.search(r"Available versions:\s*(.+)", out.stdout or "")
    if out.returncode == 0 and match:
        versions = [v.strip() for v in match.group(1).split(",") if _PLAIN.match(v.strip())]
        if versions:
            return max(versions, key=_key)
    # Fallback: ask the resolver what `pip install torch` would take.
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        out2 = run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "--no-deps",
                "--quiet",
                "--report",
                str(report),
                "torch",
            ],
            env=env,
            capture=True,
            timeout=600,
        )
        if out2.returncode == 0 and report.exists():
            for item in json.loads(report.read_text()).get("install", []):
                if item.get("metadata", {}).get("name", "").lower() == "torch":
                    return item["metadata"]["version"].split("+")[0]
    raise LegError(
        "could not resolve the newest torch release from the package index:\n"
        f"pip index versions: {(out.stdout or '').strip()[-800:]}"
    )


# --- environments ---------------------------------------------------------------------------


def env_dir(settings: matrix_data.Settings, leg: matrix_data.Leg) -> Path:
    return settings.home_path / leg.name


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _pyproject_digest() -> str:
    return hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]


_INSPECT = r"""
import importlib.metadata as md, json
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
out = {"torch": version("torch"), "pytest": version("pytest"), "hypothesis": version("hypothesis")}
try:
    text = md.distribution("attn").read_text("direct_url.json")
    out["attn_url"] = json.loads(text) if text else None
except md.PackageNotFoundError:
    out["attn_url"] = None
print(json.dumps(out))
"""


def inspect_env(path: Path) -> dict | None:
    python = venv_python(path)
    if not python.exists():
        return None
    out = run([str(python), "-c", _INSPECT], env=base_env(), capture=True, timeout=120)
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _torch_matches(installed: str | None, wanted: str) -> bool:
    return installed is not None and installed.split("+")[0] == wanted


def _project_current(info: dict, path: Path) -> bool:
    url = info.get("attn_url") or {}
    editable = (url.get("dir_info") or {}).get("editable", False)
    here = url.get("url", "") in (REPO.as_uri(), f"file://{REPO}")
    stamp = path / STAMP
    digest_ok = stamp.exists() and json.loads(stamp.read_text()).get("pyproject") == _pyproject_digest()
    return bool(editable and here and digest_ok and info.get("pytest") and info.get("hypothesis"))


def remove_env(path: Path, why: str) -> None:
    if path.exists():
        size = _du_gb(path)
        shutil.rmtree(path)
        say(f"removed environment {path} ({size:.1f} GB): {why}")


def _du_gb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file removed while we count
                total += os.lstat(os.path.join(root, name)).st_size
    return total / 1e9


def free_gb(path: Path) -> float:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free / 1e9


def ensure_env(
    settings: matrix_data.Settings, leg: matrix_data.Leg, version: str | None, nightly_url: str | None
) -> tuple[Path, str]:
    """Builds or reuses the leg's environment; returns its path and the installed torch."""
    path = env_dir(settings, leg)
    env = pip_env(leg)
    info = inspect_env(path)
    if info is not None and version is not None and not _torch_matches(info.get("torch"), version):
        remove_env(path, f"it holds torch {info.get('torch')}, the leg needs {version}")
        info = None
    elif info is None and path.exists():
        remove_env(path, "it is not a working environment")
    python = str(venv_python(path))
    if info is None:
        say(f"building environment {path} (free disk {free_gb(settings.home_path):.0f} GB)")
        path.parent.mkdir(parents=True, exist_ok=True)
        done = run([sys.executable, "-m", "venv", str(path)], env=base_env(), timeout=600)
        if done.returncode != 0:
            raise LegError(f"python -m venv {path} failed (exit {done.returncode})")
    else:
        say(f"reusing environment {path} (torch {info.get('torch')})")
    if nightly_url is not None:
        start = time.monotonic()
        done = run(
            [
                python,
                "-m",
                "pip",
                "install",
                *PIP_QUIET,
                *NO_CACHE,
                "--pre",
                "--upgrade",
                "--extra-index-url",
                nightly_url,
                "torch",
            ],
            env=env,
            timeout=INSTALL_TIMEOUT,
        )
        if done.returncode != 0:
            raise LegError(f"installing nightly torch failed (exit {done.returncode})")
        say(f"torch nightly: checked in {time.monotonic() - start:.0f} s")
    elif info is None:
        start = time.monotonic()
        done = run(
            [python, "-m", "pip", "install", *PIP_QUIET, *NO_CACHE, f"torch=={version}"],
            env=env,
            timeout=INSTALL_TIMEOUT,
        )
        if done.returncode != 0:
            raise LegError(f"pip install torch=={version} failed (exit {done.returncode})")
        say(f"torch {version}: installed in {time.monotonic() - start:.0f} s")
    info = inspect_env(path) or {}
    installed = info.get("torch")
    if installed is None:
        raise LegError("torch is not installed in the leg environment after installing it")
    if nightly_url is not None and not re.search(r"(dev|a|b|rc)\d", installed):
        raise LegError(f"the nightly index served torch {installed}, which is not a pre-release")
    if version is not None and not _torch_matches(installed, version):
        raise LegError(f"torch {installed} is installed, the leg needs {version}")
    if _project_current(info, path):
        say(f"project already installed editable from {REPO}")
    else:
        start = time.monotonic()
        constraints = path / "torch-pin.txt"
        constraints.write_text(f"torch=={installed}\n")  # never let the project pull another torch
        done = run(
            [python, "-m", "pip", "install", *PIP_QUIET, "-c", str(constraints), "-e", f"{REPO}[test]"],
            env=env,
            timeout=INSTALL_TIMEOUT,
        )
        if done.returncode != 0:
            raise LegError(f"installing the project into the leg environment failed (exit {done.returncode})")
        after = (inspect_env(path) or {}).get("torch")
        if after != installed:
            raise LegError(f"installing the project changed torch from {installed} to {after}")
        (path / STAMP).write_text(json.dumps({"pyproject": _pyproject_digest(), "torch": installed}))
        say(f"project installed in {time.monotonic() - start:.0f} s")
    return path, installed


# --- checks and tests -----------------------------------------------------------------------


def run_checks(path: Path, leg: matrix_data.Leg, result: LegResult, out_dir: Path) -> None:
    out = out_dir / f"{leg.name}-checks.json"
    out.unlink(missing_ok=True)
    done = run(
        [str(venv_python(path)), str(LEGS_SCRIPT), leg.name, "--out", str(out)], env=base_env(), timeout=CHECKS_TIMEOUT
    )
    if not out.exists():
        raise LegError(f"compat/legs.py wrote no result (exit {done.returncode})")
    data = json.loads(out.read_text())
    policy = data.get("policy", {})
    result.policy = policy.get("policy", "-")
    probes = data.get("probe", {}).get("backends", [])
    if probes:
        kinds = {"sound guard" if p["decides_in_graph"] else "stale guard" if p["traced"] else "fails" for p in probes}
        result.probe = (
            kinds.pop()
            if len(kinds) == 1
            else "MIXED: " + ", ".join(f"{p['backend']} {'traces' if p['traced'] else 'fails'}" for p in probes)
        )
        errors = sorted({p["error"] for p in probes if p["error"]})
        for error in errors:
            result.notes.append(f"probe error: {error}")
    sequences = data.get("sequences")
    if sequences and "runs" in sequences:
        good = [r for r in sequences["runs"] if r["matches"]]
        breaks = sorted({r["graph_breaks"] for r in sequences["runs"] if r["graph_breaks"] is not None})
        result.sequences = f"{len(good)}/{len(sequences['runs'])} == eager, breaks {breaks}"
    for name in ("policy", "probe", "sequences"):
        for problem in data.get(name, {}).get("problems", []):
            result.problems.append(f"{name}: {problem}")
    if done.returncode != 0 and not result.problems:
        result.problems.append(f"compat/legs.py exited {done.returncode}")


def run_tests(path: Path, data: matrix_data.Matrix, leg: matrix_data.Leg, result: LegResult, out_dir: Path) -> None:
    files = data.test_files(leg)
    selection: list[str] = []
    if files is not None:
        missing = [f for f in files if not (REPO / f).exists()]
        selection = [f for f in files if (REPO / f).exists()]
        if missing:
            say(f"NOTE: leg {leg.name}: test files named in compat/matrix.toml but absent: {', '.join(missing)}")
            result.notes.append(f"absent test files: {', '.join(missing)}")
        if not selection:
            raise LegError("none of the leg's test files exist")
    junit = out_dir / f"{leg.name}-junit.xml"
    junit.unlink(missing_ok=True)
    done = run(
        [str(venv_python(path)), "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *selection],
        env=base_env(),
        timeout=TESTS_TIMEOUT,
    )
    if junit.exists():
        root = ET.parse(junit).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        tests = sum(int(s.get("tests", 0)) for s in suites)
        failures = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
        skipped = sum(int(s.get("skipped", 0)) for s in suites)
        result.passed, result.failed, result.skipped = tests - failures - skipped, failures, skipped
    if done.returncode == 5:
        result.problems.append("pytest collected no tests (exit 5)")
    elif done.returncode != 0:
        result.problems.append(f"pytest exited {done.returncode} ({result.failed} failed)")
    elif result.passed == 0:
        result.problems.append("pytest passed no test")


def run_leg(data: matrix_data.Matrix, leg: matrix_data.Leg, out_dir: Path, rebuild: bool) -> LegResult:
    result = LegResult(leg.name)
    start = time.monotonic()
    banner(
        f"leg {leg.name}: torch {leg.torch}, expects policy {leg.policy}, traces_is_inference={leg.traces_is_inference}"
    )
    path = env_dir(data.settings, leg)
    try:
        nightly_url = None
        version: str | None = leg.torch
        if leg.torch == "nightly":
            nightly_url = os.environ.get(leg.index_env or "", "").strip() or None
            if nightly_url is None:
                result.status = "NOT RUN"
                message = (
                    f"NIGHTLY LEG NOT RUN: set {leg.index_env} to a nightly wheel index to run it. "
                    "It is not counted as passed."
                )
                result.notes.append(message)
                say("!" * 78)
                say(f"!!! {message}")
                say("!" * 78)
                if os.environ.get("GITHUB_ACTIONS") == "true":
                    say(f"::warning title=nightly leg not run::{message}")
                return result
            version = None
        elif leg.torch == "latest":
            version = resolve_latest(leg)
            say(f"latest torch on the package index: {version}")
        if rebuild:
            remove_env(path, "--rebuild")
        path, installed = ensure_env(data.settings, leg, version, nightly_url)
        result.torch = installed
        run_checks(path, leg, result, out_dir)
        run_tests(path, data, leg, result, out_dir)
        result.status = "passed" if not result.problems else "FAILED"
    except LegError as exc:
        result.problems.append(str(exc))
        result.status = "FAILED"
    finally:
        result.seconds = time.monotonic() - start
        free = free_gb(data.settings.home_path)
        if result.status != "NOT RUN" and free < data.settings.min_free_gb:
            remove_env(path, f"free disk is {free:.1f} GB, under min_free_gb = {data.settings.min_free_gb:g}")
    say(f"leg {leg.name}: {result.status} in {result.seconds:.0f} s")
    for problem in result.problems:
        say(f"  - {problem}")
    return result


# --- reporting ------------------------------------------------------------------------------


def print_table(results: list[LegResult]) -> None:
    headers = ["leg", "torch", "status", "policy", "probe", "sequences", "passed", "failed", "skipped", "time"]
    rows = [
        [
            r.leg,
            r.torch,
            r.status,
            r.policy,
            r.probe,
            r.sequences,
            str(r.passed),
            str(r.failed),
            str(r.skipped),
            f"{r.seconds / 60:.1f} min",
        ]
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    banner("version matrix")
    say("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    say("  ".join("-" * w for w in widths))
    for row in rows:
        say("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    for r in results:
        for line in r.problems:
            say(f"{r.leg}: FAILED: {line}")
        for line in r.notes:
            say(f"{r.leg}: {line}")


def _stop(signum: int, _frame: object) -> None:
    # subprocess.run kills its child when an exception interrupts it: end the leg's
    # pip or pytest with the runner, instead of leaving it running.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stop)
    parser = argparse.ArgumentParser(description="Run the torch version matrix (compat/matrix.toml).")
    parser.add_argument("legs", nargs="*", help="legs to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the legs and exit")
    parser.add_argument("--list-json", action="store_true", help="print the leg names as a JSON list and exit")
    parser.add_argument(
        "--clean", action="store_true", help="remove the named legs' environments (all when none) and exit"
    )
    parser.add_argument("--rebuild", action="store_true", help="remove each leg's environment before running it")
    parser.add_argument("--policy-table", action="store_true", help="print the README's policy table and exit")
    parser.add_argument(
        "--results", type=Path, help="folder for per-leg JSON and junit files (default: $ATTN_MATRIX_HOME/results)"
    )
    args = parser.parse_args(argv)

    data = matrix_data.load()
    if args.policy_table:
        try:
            say(matrix_data.render_policy_table(data))
        except ImportError as exc:
            say(
                f"--policy-table reads attn.compat.RELEASES ({exc}); run it with a python that has attn "
                "installed, e.g. .venv/bin/python compat/run.py --policy-table"
            )
            return 2
        return 0
    if args.list_json:
        say(json.dumps([leg.name for leg in data.legs]))
        return 0
    try:
        legs = [data.leg(name) for name in args.legs] if args.legs else list(data.legs)
    except KeyError as exc:
        say(exc.args[0])
        return 2
    if args.list:
        for leg in legs:
            say(
                f"{leg.name:<8} torch {leg.torch:<8} policy {leg.policy:<9} traces={leg.traces_is_inference!s:<5} "
                f"breaks={leg.graph_breaks_per_forward} tests={leg.tests if isinstance(leg.tests, str) else 'list'}  "
                f"env {env_dir(data.settings, leg)}"
            )
            say(f"         {leg.why}")
        return 0
    if args.clean:
        for leg in legs:
            remove_env(env_dir(data.settings, leg), "--clean")
        return 0

    out_dir = args.results or data.settings.home_path / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    say(
        f"matrix: {len(legs)} leg(s): {', '.join(leg.name for leg in legs)}; environments in "
        f"{data.settings.home_path}; free disk {free_gb(data.settings.home_path):.0f} GB"
    )
    start = time.monotonic()
    results = [run_leg(data, leg, out_dir, args.rebuild) for leg in legs]
    (out_dir / "summary.json").write_text(json.dumps([r.__dict__ for r in results], indent=2))
    print_table(results)
    passed = sum(r.status == "passed" for r in results)
    failed = sum(r.status == "FAILED" for r in results)
    not_run = sum(r.status == "NOT RUN" for r in results)
    say(f"matrix total: {(time.monotonic() - start) / 60:.1f} min")
    say(f"legs: {passed} passed, {failed} failed, {not_run} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
