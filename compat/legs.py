"""The checks one leg of the version matrix runs inside its own environment.

Run by compat/run.py with the leg's python (torch of the leg's release, attn installed)::

    python compat/legs.py LEG [--out result.json] [--only policy,probe,stale-graph]

Checks:

- ``policy``: ``attn.compat.cache_policy()`` resolves, by default, to the leg's policy in
  compat/matrix.toml, and ``release_support()`` gives the same policy and traces flag.
- ``probe``: ``attn.compat.probe_is_inference_trace(backend)`` (fullgraph) traces exactly
  where the leg says, on every backend of ``probe_backends``; the error text is recorded and
  must contain the leg's ``probe_error``.
- ``stale-graph`` (legs with ``stale_graph = true``): with the INFERENCE policy forced, the
  library's own model and ``attn.generate`` run each sequence below eagerly and compiled
  (every backend of ``stale_graph_backends``, with and without fullgraph), and the cache
  fill positions (``KVCache.size``) and tokens are compared step by step. Sequences:

  - ``no_grad->decode``: a no_grad pass over token ids created under inference mode, then
    an ordinary inference-mode generation by a hand-written decode loop;
  - ``no_grad->generate``: the same no_grad pass, then ``attn.generate``;
  - ``decode->no_grad`` and ``generate->no_grad``: the reverse orders.

  Verdict: ``inference`` if compiled equals eager in every sequence, else ``flag``; the
  verdict must equal the leg's policy.

Exit status 0 when every check passed, 1 when one failed, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrix as matrix_data

# The leg runs under its default policy: nothing may override it from outside.
os.environ.pop("ATTN_CACHE_POLICY", None)

import torch

import attn
from attn import compat

PROMPT = [5, 17, 3, 42, 8, 23, 11]
NEW_TOKENS = 6


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__module__}.{type(error).__name__}: {text.splitlines()[0] if text else ''}"


# --- check 1: the policy --------------------------------------------------------------------


def check_policy(leg: matrix_data.Leg) -> dict:
    decision = compat.cache_policy()
    row = compat.release_support()
    problems = []
    if decision.policy.value != leg.policy:
        problems.append(f"cache_policy() resolved to {decision.policy.value!r}, the leg expects {leg.policy!r}")
    if decision.source != "default":
        problems.append(f"cache_policy() came from {decision.source!r}, not the release default")
    if row.default_policy.value != leg.policy:
        problems.append(
            f"release_support() row {row.label!r} says default_policy={row.default_policy.value!r}, "
            f"the leg expects {leg.policy!r}"
        )
    if row.traces_is_inference != leg.traces_is_inference:
        problems.append(
            f"release_support() row {row.label!r} says traces_is_inference={row.traces_is_inference}, "
            f"the leg expects {leg.traces_is_inference}"
        )
    return {
        "ok": not problems,
        "problems": problems,
        "policy": decision.policy.value,
        "source": decision.source,
        "row": row.label,
        "row_traces_is_inference": row.traces_is_inference,
        "reason": decision.reason,
    }


# --- check 2: the probe ---------------------------------------------------------------------


def check_probe(leg: matrix_data.Leg, backends: tuple[str, ...]) -> dict:
    row = compat.release_support()
    results = []
    problems = []
    for backend in backends:
        torch._dynamo.reset()  # no graph of an earlier backend is reused
        start = time.monotonic()
        try:
            result = compat.probe_is_inference_trace(backend)
            traced, error = result.traced, result.error
        except Exception as exc:  # the probe itself must not raise; record it if it does
            traced, error = False, f"probe raised {_first_line(exc)}"
            problems.append(f"{backend}: probe_is_inference_trace raised instead of returning: {error}")
        seconds = round(time.monotonic() - start, 1)
        results.append({"backend": backend, "traced": traced, "error": error, "seconds": seconds})
        if traced != leg.traces_is_inference:
            problems.append(
                f"{backend}: probe traced={traced} ({error or 'no error'}), the leg expects "
                f"traces_is_inference={leg.traces_is_inference}"
            )
        if traced != row.traces_is_inference:
            problems.append(
                f"{backend}: probe traced={traced}, release_support() row {row.label!r} says "
                f"traces_is_inference={row.traces_is_inference}"
            )
        if not traced and leg.probe_error and leg.probe_error not in (error or ""):
            problems.append(f"{backend}: error text {error!r} does not contain {leg.probe_error!r}")
    return {"ok": not problems, "problems": problems, "backends": results}


# --- check 3: the stale-graph sequences -----------------------------------------------------


def _build_model(seed: int = 0) -> torch.nn.Module:
    config = attn.DecoderConfig(
        vocab_size=64,
        embed_dim=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        hidden_dim=64,
        max_seq_len=64,
    )
    torch.manual_seed(seed)
    model = attn.TransformerDecoder(config).eval()
    model.setup_caches(1, 64)
    return model


def _cache_sizes(model: torch.nn.Module) -> list[int]:
    return [m.size for m in model.modules() if isinstance(m, attn.KVCache)]


def _no_grad_pass(call, model, log) -> None:
    """A no_grad forward over token ids that were created under inference mode."""
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = call(ids)
    log.append(("no_grad pass: argmax", logits.argmax(-1).tolist()))
    log.append(("no_grad pass: cache sizes", _cache_sizes(model)))


def _decode_loop(call, model, log) -> None:
    """An ordinary inference-mode generation, one token at a time, greedy."""
    model.reset_caches()
    prompt = torch.tensor([PROMPT])  # normal ids, passed in under inference mode
    with torch.inference_mode():
        logits = call(prompt)
        log.append(("decode prefill: cache sizes", _cache_sizes(model)))
        token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        tokens = [int(token)]
        for step in range(NEW_TOKENS - 1):
            logits = call(token)
            log.append((f"decode step {step + 1}: cache sizes", _cache_sizes(model)))
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
    log.append(("decode: tokens", tokens))


def _generate(call, model, log) -> None:
    """attn.generate with the model's own caches (it resets them first)."""
    out = attn.generate(call, [PROMPT], max_new_tokens=NEW_TOKENS)
    log.append(("generate: tokens", out.generated.tolist()))
    log.append(("generate: cache sizes after", _cache_sizes(model)))


SEQUENCES = {
    "no_grad->decode": (_no_grad_pass, _decode_loop),
    "no_grad->generate": (_no_grad_pass, _generate),
    "decode->no_grad": (_decode_loop, _no_grad_pass),
    "generate->no_grad": (_generate, _no_grad_pass),
}


def _run_sequence(name: str, backend: str | None, fullgraph: bool) -> list:
    torch._dynamo.reset()
    model = _build_model()
    call = model if backend is None else torch.compile(model, backend=backend, fullgraph=fullgraph)
    log: list = []
    for step in SEQUENCES[name]:
        step(call, model, log)
    return log


def _first_difference(eager: list, compiled: list) -> str | None:
    for (label, want), (_, got) in zip(eager, compiled, strict=False):  # lengths compared below
        if want != got:
            return f"{label}: eager {want}, compiled {got}"
    if len(eager) != len(compiled):
        return f"eager logged {len(eager)} observations, compiled {len(compiled)}"
    return None


def check_stale_graph(leg: matrix_data.Leg, backends: tuple[str, ...]) -> dict:
    previous = compat.cache_policy()
    compat.set_cache_policy("inference")
    runs = []
    try:
        for name in SEQUENCES:
            eager = _run_sequence(name, None, False)
            for backend in backends:
                for fullgraph in (False, True):
                    start = time.monotonic()
                    entry = {"sequence": name, "backend": backend, "fullgraph": fullgraph}
                    compiled = None
                    try:
                        compiled = _run_sequence(name, backend, fullgraph)
                    except Exception as exc:
                        entry.update(matches=False, error=_first_line(exc), difference=None)
                    else:
                        difference = _first_difference(eager, compiled)
                        entry.update(matches=difference is None, error=None, difference=difference)
                    entry["seconds"] = round(time.monotonic() - start, 1)
                    entry["eager"] = eager
                    entry["compiled"] = None if entry["error"] else compiled
                    runs.append(entry)
    finally:
        compat.set_cache_policy(None if previous.source != "override" else previous.policy)
        torch._dynamo.reset()
    verdict = "inference" if all(run["matches"] for run in runs) else "flag"
    problems = []
    if verdict != leg.policy:
        failing = [run for run in runs if not run["matches"]]
        detail = "; ".join(
            f"{r['sequence']} [{r['backend']}, fullgraph={r['fullgraph']}]: {r['error'] or r['difference']}"
            for r in failing[:4]
        )
        problems.append(
            f"the stale-graph check decides {verdict!r} (compiled == eager in every sequence: "
            f"{verdict == 'inference'}), the leg expects {leg.policy!r}" + (f"; {detail}" if detail else "")
        )
    return {"ok": not problems, "problems": problems, "verdict": verdict, "runs": runs}


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("leg", help="leg name in compat/matrix.toml")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--only", default="policy,probe,stale-graph", help="comma-separated checks")
    parser.add_argument("--matrix", type=Path, default=matrix_data.MATRIX_FILE)
    parser.add_argument(
        "--stale-graph-backends", help="override the matrix's stale_graph_backends (e.g. eager,aot_eager,inductor)"
    )
    args = parser.parse_args(argv)
    data = matrix_data.load(args.matrix)
    try:
        leg = data.leg(args.leg)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    warnings.simplefilter("ignore", compat.CompatWarning)
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    result: dict = {
        "leg": leg.name,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "attn_file": attn.__file__,
    }
    checks = [
        ("policy", lambda: check_policy(leg)),
        ("probe", lambda: check_probe(leg, data.settings.probe_backends)),
    ]
    if leg.stale_graph:
        backends = data.settings.stale_graph_backends
        if args.stale_graph_backends:
            backends = tuple(b.strip() for b in args.stale_graph_backends.split(",") if b.strip())
        checks.append(("stale-graph", lambda: check_stale_graph(leg, backends)))
    ok = True
    for name, run in checks:
        if name not in only:
            continue
        start = time.monotonic()
        try:
            outcome = run()
        except Exception as exc:  # a crashing check is a failed check, with its traceback
            outcome = {
                "ok": False,
                "problems": [f"check crashed: {_first_line(exc)}"],
                "traceback": traceback.format_exc(),
            }
        outcome["seconds"] = round(time.monotonic() - start, 1)
        result[name] = outcome
        ok = ok and outcome["ok"]
        status = "ok" if outcome["ok"] else "FAILED"
        print(f"[{leg.name}] {name}: {status} ({outcome['seconds']} s)")
        for problem in outcome.get("problems", []):
            print(f"[{leg.name}]   - {problem}")
        if "traceback" in outcome:
            print(outcome["traceback"])
    _print_details(leg, result)
    result["ok"] = ok
    if args.out:
        args.out.write_text(json.dumps(result, indent=2, default=str))
    return 0 if ok else 1


def _print_details(leg: matrix_data.Leg, result: dict) -> None:
    if "policy" in result and "policy" in result["policy"]:
        p = result["policy"]
        print(f"[{leg.name}] torch {result['torch']}: policy {p['policy']} ({p['source']}), row {p['row']}")
    for entry in result.get("probe", {}).get("backends", []):
        outcome = "traced" if entry["traced"] else f"did not trace: {entry['error']}"
        print(f"[{leg.name}] probe {entry['backend']}: {outcome} ({entry['seconds']} s)")
    stale = result.get("stale-graph", {})
    for run in stale.get("runs", []):
        outcome = "same as eager" if run["matches"] else f"DIFFERS: {run['error'] or run['difference']}"
        print(
            f"[{leg.name}] stale-graph {run['sequence']:<18} {run['backend']:<9} "
            f"fullgraph={run['fullgraph']!s:<5} {outcome} ({run['seconds']} s)"
        )
    if "verdict" in stale:
        print(f"[{leg.name}] stale-graph verdict: {stale['verdict']} (leg expects {leg.policy})")


if __name__ == "__main__":
    sys.exit(main())
