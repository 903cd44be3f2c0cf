"""The version matrix on nox: one session per leg of compat/matrix.toml.

From the repository root::

    nox -f compat/noxfile.py                    # every leg
    nox -f compat/noxfile.py -s 'leg(2.6.0)'    # one leg
    nox -f compat/noxfile.py --list

``python3 compat/run.py`` runs these sessions and prints the table of all legs (what .ci/run
does). A session, for the leg it is given:

1. the environment: nox's, in ``$ATTN_MATRIX_HOME/leg-<name>`` (default
   ``~/.cache/attn-matrix``, outside the repo), kept between runs; torch is installed first
   (``torch==X``; ``latest``: the newest release the index serves; ``nightly``: the newest
   pre-release of the index named by the leg's ``index_env``, NOT RUN while it is unset), then
   the project editable with its ``test`` extra under a constraint that pins that torch;
2. the checks: compat/legs.py (policy, probe, sequences) against the release's row of
   ``attn.compat.RELEASES``;
3. the tests: pytest on the leg's selection ("all", "core" or a list of files).

The session fails when any step does; what it measured goes to
``$ATTN_MATRIX_HOME/results/<leg>.json``, which compat/run.py turns into the table.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix as matrix_data

REPO = Path(__file__).resolve().parent.parent
LEGS_SCRIPT = REPO / "compat" / "legs.py"
MATRIX = matrix_data.load()
RESULTS = MATRIX.settings.home_path / "results"

nox.options.envdir = str(MATRIX.settings.home_path)
nox.options.reuse_venv = "yes"  # a leg's environment is kept: torch is 2-6 GB
nox.options.error_on_external_run = True

# Every command of a leg runs under the release's default policy, with no stray path.
CLEAN_ENV = {"ATTN_CACHE_POLICY": None, "PYTHONPATH": None, "PYTHONDONTWRITEBYTECODE": "1"}


@nox.session(venv_backend="uv")  # a cold leg installs in 83 s (pip: 242 s), a warm one in 5 s (pip: 75 s)
@nox.parametrize("name", [nox.param(leg.name, id=leg.name) for leg in MATRIX.legs])
def leg(session: nox.Session, name: str) -> None:
    """One leg: its torch release, the checks of compat/legs.py, then pytest."""
    leg = MATRIX.leg(name)
    location = Path(session.virtualenv.location)
    if location != MATRIX.settings.env_path(leg):
        session.error(f"nox put the environment in {location}, compat/matrix.py's env_path says elsewhere")
    session.chdir(REPO)
    session.env.update(CLEAN_ENV)
    if os.environ.get("PIP_FIND_LINKS"):  # uv reads no pip settings: a wheel folder given to pip is uv's too
        session.env["UV_FIND_LINKS"] = os.environ["PIP_FIND_LINKS"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    result: dict = {"leg": leg.name, "problems": [], "notes": []}
    try:
        install(session, leg, result)
        run_checks(session, leg, result)
        run_tests(session, leg, result)
    except nox.command.CommandFailed as exc:  # installing failed: the leg stops here
        result["problems"].append(f"installing failed ({exc.reason}); uv's output is above")
    finally:
        (RESULTS / f"{leg.name}.json").write_text(json.dumps(result, indent=2))
        free = shutil.disk_usage(location).free / 1e9
        if free < MATRIX.settings.min_free_gb:
            session.log(f"free disk {free:.1f} GB < min_free_gb {MATRIX.settings.min_free_gb:g}: removing {location}")
            shutil.rmtree(location)
    if result["problems"]:
        session.error("; ".join(result["problems"]))


def install(session: nox.Session, leg: matrix_data.Leg, result: dict) -> None:
    """torch first, then the project editable with its test extra under a pin of that torch.

    uv leaves what already satisfies the request alone, so a warm leg installs nothing.
    """
    if leg.torch == "nightly":
        url = os.environ.get(leg.index_env or "", "").strip()
        if not url:
            message = (
                f"NIGHTLY LEG NOT RUN: set {leg.index_env} to a nightly wheel index to run it (never counted as passed)"
            )
            if os.environ.get("GITHUB_ACTIONS") == "true":
                print(f"::warning title=nightly leg not run::{message}")
            session.skip(message)
        torch = ["--prerelease", "allow", "--upgrade-package", "torch", "--extra-index-url", url, "torch"]
    elif leg.torch == "latest":
        torch = ["--upgrade-package", "torch", "torch"]  # the newest release the index serves now
    else:
        torch = [f"torch=={leg.torch}"]
    # torch skips uv's cache (2-6 GB a release; the leg's environment keeps it), the rest uses it.
    session.install("--quiet", "--no-cache", *torch)
    installed = session.run(
        "python", "-c", "import importlib.metadata as m; print(m.version('torch'))", silent=True
    ).strip()
    if leg.torch == "nightly" and not re.search(r"(dev|a|b|rc)\d", installed):
        session.error(f"the nightly index served torch {installed}, which is not a pre-release")
    pin = Path(session.virtualenv.location) / "torch-pin.txt"
    pin.write_text(f"torch=={installed}\n")  # the project can never pull another torch
    # setuptools: inductor's C++ builds import it on torch 2.5 and 2.6 ("No module named
    # 'setuptools'"); a venv made by python -m venv has it, one made by uv has not.
    session.install("--quiet", "-c", str(pin), "-e", f"{REPO}[test]", "setuptools")
    result["torch"] = installed


def run_checks(session: nox.Session, leg: matrix_data.Leg, result: dict) -> None:
    """compat/legs.py in the leg's environment; its JSON gives the policy, probe and sequences columns."""
    out = RESULTS / f"{leg.name}-checks.json"
    out.unlink(missing_ok=True)
    try:
        session.run("python", str(LEGS_SCRIPT), leg.name, "--out", str(out))
    except nox.command.CommandFailed as exc:
        if not out.exists():
            result["problems"].append(f"compat/legs.py wrote no result ({exc.reason})")
            return
    data = json.loads(out.read_text())
    result["policy"] = data.get("policy", {}).get("policy", "-")
    probes = data.get("probe", {}).get("backends", [])
    kinds = {"sound guard" if p["decides_in_graph"] else "stale guard" if p["traced"] else "fails" for p in probes}
    if len(kinds) == 1:
        result["probe"] = kinds.pop()
    elif probes:
        result["probe"] = "MIXED: " + ", ".join(
            f"{p['backend']} {'traces' if p['traced'] else 'fails'}" for p in probes
        )
    result["notes"] += [f"probe error: {error}" for error in sorted({p["error"] for p in probes if p["error"]})]
    runs = data.get("sequences", {}).get("runs", [])
    if runs:
        same = sum(run["matches"] for run in runs)
        breaks = sorted({run["graph_breaks"] for run in runs if run["graph_breaks"] is not None})
        result["sequences"] = f"{same}/{len(runs)} == eager, breaks {breaks}"
    for check in ("policy", "probe", "sequences"):
        result["problems"] += [f"{check}: {problem}" for problem in data.get(check, {}).get("problems", [])]
    if not data.get("ok") and not result["problems"]:
        result["problems"].append("compat/legs.py failed")


def run_tests(session: nox.Session, leg: matrix_data.Leg, result: dict) -> None:
    """pytest on the leg's selection; the counts come from its JUnit report."""
    files = MATRIX.test_files(leg)
    selection: list[str] = []
    if files is not None:
        selection = [f for f in files if (REPO / f).exists()]
        missing = [f for f in files if f not in selection]
        if missing:
            result["notes"].append(f"absent test files: {', '.join(missing)}")
        if not selection:
            result["problems"].append("none of the leg's test files exist")
            return
    junit = RESULTS / f"{leg.name}-junit.xml"
    junit.unlink(missing_ok=True)
    code = 0
    try:
        session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *selection)
    except nox.command.CommandFailed as exc:
        code = exc.return_code
    if junit.exists():
        suites = list(ET.parse(junit).getroot().iter("testsuite"))
        count = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
        result["failed"] = count["failures"] + count["errors"]
        result["skipped"] = count["skipped"]
        result["passed"] = count["tests"] - result["failed"] - result["skipped"]
    if code == 5:
        result["problems"].append("pytest collected no tests (exit 5)")
    elif code:
        result["problems"].append(f"pytest exited {code} ({result.get('failed', '?')} failed)")
    elif not result.get("passed"):
        result["problems"].append("pytest passed no test")
