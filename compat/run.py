"""Runs the version matrix (compat/noxfile.py, one nox session per leg), then prints a table of all legs.

Usage, from the repository root, with a python that has nox (``pip install -e '.[matrix]'``;
``--list``, ``--clean`` and ``--list-json`` need only the standard library)::

    .venv/bin/python compat/run.py                 # every leg
    .venv/bin/python compat/run.py 2.6.0 latest    # some legs
    .venv/bin/python compat/run.py --list          # the legs, what each must show, where its environment is
    .venv/bin/python compat/run.py --clean [LEG..] # remove leg environments (all when none named)
    .venv/bin/python compat/run.py --rebuild LEG   # recreate the leg's environment, then run it
    .venv/bin/python compat/run.py --jobs 1        # one leg at a time (default: matrix.toml's jobs)
    .venv/bin/python compat/run.py --policy-table  # the README's policy table

Exit status: 0 when every leg that ran passed, 1 otherwise. A nightly leg that did not run
is NOT RUN, never passed, and does not change the exit status.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix as matrix_data

NOXFILE = Path(__file__).resolve().with_name("noxfile.py")
STATUS = {"success": "passed", "skipped": "NOT RUN"}  # nox's result -> the table's; anything else FAILED


def run_legs(data: matrix_data.Matrix, legs: list[matrix_data.Leg], rebuild: bool, jobs: int) -> int:
    if importlib.util.find_spec("nox") is None:
        print(
            f"the matrix runs on nox, which {sys.executable} lacks: install it with "
            "`pip install -e '.[matrix]'` (e.g. into .venv, then `.venv/bin/python compat/run.py`)"
        )
        return 2
    results = data.settings.home_path / "results"
    results.mkdir(parents=True, exist_ok=True)
    for leg in legs:
        (results / f"{leg.name}.json").unlink(missing_ok=True)
    order = sorted(legs, key=leg_weight, reverse=True)  # longest first: the short ones fill the gaps at the end
    print(
        f"matrix: {len(legs)} leg(s), at most {jobs} at a time, one nox process each, in this order: "
        + ", ".join(leg.name for leg in order)
        + f"; environments in {data.settings.home_path}"
    )
    start = time.monotonic()
    sessions = run_pool(order, jobs, lambda leg: start_leg(leg, results, rebuild, jobs))
    minutes = (time.monotonic() - start) / 60
    outcome = {entry["args"]["name"]: entry for entry in sessions}
    rows = []
    for leg in legs:
        entry = outcome.get(leg.name, {"result": "not reported", "reason": "nox ran no such session", "duration": 0})
        path = results / f"{leg.name}.json"
        measured = json.loads(path.read_text()) if path.exists() else {}
        problems = measured.get("problems", [])
        status = STATUS.get(entry["result"], "FAILED")
        if status == "FAILED" and not problems:
            problems = [f"nox: {entry['reason'] or entry['result']} (the session's log is above)"]
        notes = measured.get("notes", []) + ([entry["reason"]] if status == "NOT RUN" else [])
        rows.append((leg.name, status, measured, entry["duration"], problems, notes))
    print_table(rows)
    counts = {status: sum(row[1] == status for row in rows) for status in ("passed", "FAILED", "NOT RUN")}
    print(f"matrix total: {minutes:.1f} min")
    print(f"legs: {counts['passed']} passed, {counts['FAILED']} failed, {counts['NOT RUN']} skipped")
    return 1 if counts["FAILED"] else 0


def leg_weight(leg: matrix_data.Leg) -> float:
    """A leg's share of the matrix's time, by its tests (measured: a core leg 6-7 min, a list
    of a few files about 2; a leg whose index is not given does not run)."""
    if leg.index_env and not os.environ.get(leg.index_env):
        return 0.0
    return {"all": 6.0, "core": 5.0}.get(leg.tests, 1.5) if isinstance(leg.tests, str) else 1.5


@dataclass
class RunningLeg:
    """A leg's nox process: ``poll()`` is None while it runs; ``finish()`` shows its log and
    returns nox's report of the session."""

    leg: matrix_data.Leg
    process: subprocess.Popen
    log: Path
    report: Path

    def poll(self) -> int | None:
        return self.process.poll()

    def finish(self) -> list[dict]:
        print(f"\n{'-' * 30} {self.log.name} (exit {self.process.returncode}) {'-' * 30}", flush=True)
        print(self.log.read_text(), flush=True)
        return json.loads(self.report.read_text())["sessions"] if self.report.exists() else []


def start_leg(leg: matrix_data.Leg, results: Path, rebuild: bool, jobs: int) -> RunningLeg:
    """Starts ``leg``'s nox session in a process of its own, its output in a log of its own.

    With more than one leg at once, each gets an equal share of the cores for torch's threads
    (``OMP_NUM_THREADS``), so two legs do not fight over the same cores.
    """
    env = dict(os.environ)
    if jobs > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    report, log = results / f"nox-report-{leg.name}.json", results / f"nox-{leg.name}.log"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "nox", "-f", str(NOXFILE), "--report", str(report), "-s", leg.session]
    command += ["--reuse-venv=no"] if rebuild else []
    print("$ " + " ".join(command) + f"  > {log}", flush=True)
    with open(log, "w") as handle:  # the child keeps its own descriptor
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT, env=env)
    return RunningLeg(leg, process, log, report)


def run_pool(
    legs: list[matrix_data.Leg], jobs: int, start: Callable[[matrix_data.Leg], RunningLeg], poll_seconds: float = 1.0
) -> list[dict]:
    """Runs every leg once, at most ``jobs`` at a time, each started in ``legs``' order as soon
    as one before it ends (a queue, not fixed groups: a long leg never holds back a free core);
    returns the sessions nox reported, in the order the legs ended."""
    waiting, running, sessions = list(legs), [], []
    while waiting or running:
        while waiting and len(running) < max(1, jobs):
            running.append(start(waiting.pop(0)))
        ended = [item for item in running if item.poll() is not None]
        for item in ended:
            running.remove(item)
            sessions += item.finish()
        if not ended:
            time.sleep(poll_seconds)
    return sessions


def print_table(rows: list[tuple]) -> None:
    headers = ["leg", "torch", "status", "policy", "probe", "sequences", "passed", "failed", "skipped", "time"]
    cells = [
        [name, m.get("torch", "-"), status, m.get("policy", "-"), m.get("probe", "-"), m.get("sequences", "-")]
        + [str(m.get(key, 0)) for key in ("passed", "failed", "skipped")]
        + [f"{seconds / 60:.1f} min"]
        for name, status, m, seconds, _, _ in rows
    ]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    print("\n" + "=" * 78 + "\nversion matrix\n" + "=" * 78)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    for name, _, _, _, problems, notes in rows:
        for line in problems:
            print(f"{name}: FAILED: {line}")
        for line in notes:
            print(f"{name}: {line}")


def list_legs(data: matrix_data.Matrix, legs: list[matrix_data.Leg]) -> None:
    try:  # what each release must show is its row of attn.compat.RELEASES
        from attn.compat import RELEASES, release_support
    except ImportError:
        release_support = None
    for leg in legs:
        tests = leg.tests if isinstance(leg.tests, str) else ", ".join(leg.tests)
        print(f"{leg.name:<8} torch {leg.torch:<8} tests {tests}; env {data.settings.env_path(leg)}")
        if release_support is None:
            print("         must show: its row of attn.compat.RELEASES (run with a python that has attn to see it)")
        else:
            # latest and nightly are newer than every release the table names: the open-ended row
            row = (
                release_support(leg.fixed_version) if leg.fixed_version else next(r for r in RELEASES if r.last is None)
            )
            traces = "traces is_inference()" if row.traces_is_inference else "does not trace is_inference()"
            guard = ", sound guard" if row.decides_in_graph else ""
            print(
                f"         must show: row {row.label!r}: {traces}{guard}, {row.graph_breaks_per_forward} graph break(s)"
            )
        if leg.why:
            print(f"         {leg.why}")


def clean(data: matrix_data.Matrix, legs: list[matrix_data.Leg]) -> None:
    for leg in legs:
        # data.settings.home_path / leg.name: where the runner before nox kept the leg
        for path in (data.settings.env_path(leg), data.settings.home_path / leg.name):
            if path.is_dir():
                shutil.rmtree(path)
                print(f"removed {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the torch version matrix (compat/matrix.toml) on nox.")
    parser.add_argument("legs", nargs="*", help="legs to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the legs and exit")
    parser.add_argument("--list-json", action="store_true", help="print the leg names as a JSON list and exit")
    parser.add_argument("--clean", action="store_true", help="remove the legs' environments (all when none named)")
    parser.add_argument("--rebuild", action="store_true", help="recreate each leg's environment before running it")
    parser.add_argument(
        "--jobs", type=int, default=None, help="legs run at once, one nox process each (default: matrix.toml's jobs)"
    )
    parser.add_argument("--policy-table", action="store_true", help="print the README's policy table and exit")
    args = parser.parse_args(argv)

    data = matrix_data.load()
    if args.policy_table:
        print(matrix_data.render_policy_table(data))  # reads attn.compat.RELEASES: needs attn
        return 0
    if args.list_json:
        print(json.dumps([leg.name for leg in data.legs]))
        return 0
    try:
        legs = [data.leg(name) for name in args.legs] if args.legs else list(data.legs)
    except KeyError as exc:
        print(exc.args[0])
        return 2
    if args.list:
        list_legs(data, legs)
        return 0
    if args.clean:
        clean(data, legs)
        return 0
    return run_legs(data, legs, args.rebuild, args.jobs or data.settings.jobs)


if __name__ == "__main__":
    sys.exit(main())
