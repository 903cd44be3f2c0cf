"""The checks one leg of the version matrix runs inside its own environment.

Run by the leg's nox session (compat/noxfile.py) with the leg's python (torch of the leg's
release, attn installed)::

    python compat/legs.py LEG [--out result.json] [--only policy,probe,sequences]

What the release must do is its row of ``attn.compat.RELEASES``, ``release_support()`` (the
installed torch); compat/matrix.toml only names the release. Checks:

- ``policy``: the installed torch is the leg's release (the open-ended row for ``latest`` and
  ``nightly``), and ``attn.policy.cache_policy()`` resolves, by default, to
  ``attn.policy.DEFAULT_POLICY``.
- ``probe``: ``attn.compat.probe_is_inference_trace(backend)`` (fullgraph) traces, and keeps
  a sound guard over the stale-graph sequences, exactly where the row says, on every backend
  of ``probe_backends``; where it fails to trace, the error must contain the leg's
  ``probe_error``.
- ``sequences``: under the default policy, attn's own model runs each sequence below eagerly
  and compiled without fullgraph (``sequence_backends``: eager and aot_eager run every sequence
  but ``stale``, inductor runs ``stale`` only), and cache fill positions, cache contents and tokens must match eager at
  every step; passes that must leave the cache alone must leave it bit-for-bit. The graph
  breaks of the first compiled forward must equal the row's ``graph_breaks_per_forward``, and
  ``attn.cached_inference`` with ``fullgraph=True`` must compile the decode step once and
  never again over further steps. Sequences:

  - ``no_grad->decode``: a no_grad pass over token ids created under inference mode, then a
    hand-written decode loop under plain ``torch.inference_mode()``;
  - ``no_grad->generate``: the same no_grad pass, then ``attn.generate``;
  - ``decode->no_grad`` and ``generate->no_grad``: the reverse orders;
  - ``stateful``: inference-mode prefill, no_grad over inference-made ids, inference-mode
    decode, a grad pass with backward, a no_grad pass, inference-mode decode;
  - ``stale`` (inductor only): the same without the grad pass, whose backward is the costly
    compile.

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
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import attn
from attn import compat

PROMPT = [5, 17, 3, 42, 8, 23, 11]
NEW_TOKENS = 6


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__module__}.{type(error).__name__}: {text.splitlines()[0] if text else ''}"


# --- check 1: the policy --------------------------------------------------------------------


def check_policy(leg: matrix_data.Leg, row: compat.ReleaseSupport) -> dict:
    decision = attn.policy.cache_policy()
    installed = compat.torch_version()
    problems = []
    if leg.fixed_version and installed.release != compat.parse_torch_version(leg.fixed_version).release:
        problems.append(f"torch {installed} is installed, the leg names {leg.fixed_version}")
    if leg.floating and row.last is not None:
        problems.append(f"torch {installed} falls in the bounded row {row.label!r}; {leg.torch} must be newer")
    if decision.policy is not attn.policy.DEFAULT_POLICY:
        problems.append(
            f"cache_policy() resolved to {decision.policy.value!r}, the default is {attn.policy.DEFAULT_POLICY.value!r}"
        )
    if decision.source != "default":
        problems.append(f"cache_policy() came from {decision.source!r}, not the release default")
    return {
        "ok": not problems,
        "problems": problems,
        "policy": decision.policy.value,
        "source": decision.source,
        "row": row.label,
        "reason": row.reason,
    }


# --- check 2: the probe ---------------------------------------------------------------------


def check_probe(leg: matrix_data.Leg, row: compat.ReleaseSupport, backends: tuple[str, ...]) -> dict:
    results = []
    problems = []
    for backend in backends:
        start = time.monotonic()
        try:
            result = compat.probe_is_inference_trace(backend)
            traced, decides, error = result.traced, result.decides_in_graph, result.error
        except Exception as exc:  # the probe itself must not raise; record it if it does
            traced, decides, error = False, False, f"probe raised {_first_line(exc)}"
            problems.append(f"{backend}: probe_is_inference_trace raised instead of returning: {error}")
        seconds = round(time.monotonic() - start, 1)
        results.append(
            {"backend": backend, "traced": traced, "decides_in_graph": decides, "error": error, "seconds": seconds}
        )
        for what, measured, row_says in (
            ("traced", traced, row.traces_is_inference),
            ("decides_in_graph", decides, row.decides_in_graph),
        ):
            if measured != row_says:
                problems.append(
                    f"{backend}: probe {what}={measured} ({error or 'no error'}); "
                    f"RELEASES row {row.label!r} says {row_says}"
                )
        if not traced and leg.probe_error and leg.probe_error not in (error or ""):
            problems.append(f"{backend}: error text {error!r} does not contain {leg.probe_error!r}")
    return {"ok": not problems, "problems": problems, "backends": results}


# --- check 3: the sequences -----------------------------------------------------------------


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


def _snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.clone() for c in model.kv_caches() for t in (c.k_cache, c.v_cache, c.cache_pos)]


def _cache(model, log, label: str) -> None:
    """Logs the fill positions and the cache contents (compared with a tolerance)."""
    log.append((f"{label}: cache sizes", [c.size for c in model.kv_caches()]))
    log.append((f"{label}: cache contents", _snapshot(model)))


def _untouched(call, model, log, label: str, run) -> torch.Tensor:
    """Runs a pass that must leave the cache bit-for-bit alone, and logs whether it did."""
    before = _snapshot(model)
    out = run()
    after = _snapshot(model)
    log.append((f"{label}: cache untouched", all(torch.equal(a, b) for a, b in zip(before, after, strict=True))))
    return out


def _no_grad_pass(call, model, log) -> None:
    """A no_grad forward over token ids that were created under inference mode."""
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = _untouched(call, model, log, "no_grad pass", lambda: call(ids))
    log.append(("no_grad pass: argmax", logits.argmax(-1).tolist()))


def _grad_pass(call, model, log) -> None:
    """A training forward and backward."""
    ids = torch.tensor([PROMPT])
    logits = _untouched(call, model, log, "grad pass", lambda: call(ids))
    logits.float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)


def _decode_steps(call, model, log, token: torch.Tensor, steps: int, label: str) -> torch.Tensor:
    tokens = []
    with torch.inference_mode():
        for step in range(steps):
            logits = call(token)
            _cache(model, log, f"{label} step {step + 1}")
            token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
            tokens.append(int(token))
    log.append((f"{label}: tokens", tokens))
    return token.clone()


def _prefill(call, model, log) -> torch.Tensor:
    model.reset_caches()
    with torch.inference_mode():
        logits = call(torch.tensor([PROMPT]))  # normal ids, passed in under inference mode
    _cache(model, log, "prefill")
    return logits[:, -1].argmax(-1, keepdim=True).clone()  # (1, 1)


def _decode_loop(call, model, log) -> None:
    """An ordinary inference-mode generation, one token at a time, greedy."""
    _decode_steps(call, model, log, _prefill(call, model, log), NEW_TOKENS, "decode")


def _generate(call, model, log) -> None:
    """attn.generate with the model's own caches (it resets them first)."""
    out = attn.generate(call, [PROMPT], max_new_tokens=NEW_TOKENS)
    log.append(("generate: tokens", out.generated.tolist()))
    _cache(model, log, "generate")


def _stateful(call, model, log) -> None:
    token = _prefill(call, model, log)
    _no_grad_pass(call, model, log)
    token = _decode_steps(call, model, log, token, 3, "decode")
    _grad_pass(call, model, log)
    _no_grad_pass(call, model, log)
    _decode_steps(call, model, log, token, 3, "decode again")


def _stale(call, model, log) -> None:
    """The stale-graph orders in one run, without the grad pass (its backward is the costly
    compile under inductor): prefill, no_grad, decode, no_grad, decode."""
    token = _prefill(call, model, log)
    _no_grad_pass(call, model, log)
    token = _decode_steps(call, model, log, token, 2, "decode")
    _no_grad_pass(call, model, log)
    _decode_steps(call, model, log, token, 2, "decode again")


SEQUENCES = {
    "no_grad->decode": (_no_grad_pass, _decode_loop),
    "no_grad->generate": (_no_grad_pass, _generate),
    "decode->no_grad": (_decode_loop, _no_grad_pass),
    "generate->no_grad": (_generate, _no_grad_pass),
    "stateful": (_stateful,),
    "stale": (_stale,),
}
CHEAP_BACKENDS = ("eager", "aot_eager")  # inductor compiles for seconds a graph: it runs "stale" only


def _run_sequence(name: str, backend: str | None) -> tuple[list, int | None]:
    """The sequence's log, and the graph breaks of the first compiled forward."""
    torch._dynamo.reset()
    counters.clear()
    model = _build_model()
    call = model if backend is None else torch.compile(model, backend=backend)
    breaks = None
    if backend is not None:  # count the first forward's breaks: an inference-mode prefill
        with torch.inference_mode():
            call(torch.tensor([PROMPT]))
        breaks = sum(counters["graph_break"].values())
    log: list = []
    for step in SEQUENCES[name]:
        step(call, model, log)
    return log, breaks


def _same(want, got) -> bool:
    if isinstance(want, list) and want and isinstance(want[0], torch.Tensor):
        return len(want) == len(got) and all(
            torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5) for a, b in zip(want, got, strict=True)
        )
    return want == got


def _first_difference(eager: list, compiled: list) -> str | None:
    for (label, want), (_, got) in zip(eager, compiled, strict=False):  # lengths compared below
        if not _same(want, got):
            if label.endswith("contents"):
                return f"{label}: compiled differs from eager beyond rtol 1e-4"
            return f"{label}: eager {want}, compiled {got}"
        if label.endswith("untouched") and not got:
            return f"{label}: the pass changed the cache"
    if len(eager) != len(compiled):
        return f"eager logged {len(eager)} observations, compiled {len(compiled)}"
    return None


def _fullgraph_decode_compiles_once() -> str | None:
    """cached_inference + fullgraph: prefill and decode compile once each, then never again."""
    torch._dynamo.reset()
    model = _build_model()
    counter = CompileCounter()
    call = torch.compile(model, backend=counter, fullgraph=True)
    with attn.cached_inference(model):
        token = call(torch.tensor([PROMPT]))[:, -1].argmax(-1, keepdim=True)
        for step in range(2 * NEW_TOKENS):
            token = call(token)[:, -1].argmax(-1, keepdim=True)
            if step == 1 and counter.frame_count != 2:
                return f"after prefill and two decode steps: {counter.frame_count} compiles, expected 2"
    if counter.frame_count != 2:
        return f"{2 * NEW_TOKENS} decode steps recompiled: {counter.frame_count} compiles, expected 2"
    return None


def check_sequences(row: compat.ReleaseSupport, backends: tuple[str, ...]) -> dict:
    runs = []
    problems = []
    for name in SEQUENCES:
        eager, _ = _run_sequence(name, None)
        for backend in backends:
            if (backend in CHEAP_BACKENDS) == (name == "stale"):
                continue
            start = time.monotonic()
            entry: dict = {"sequence": name, "backend": backend}
            try:
                compiled, breaks = _run_sequence(name, backend)
            except Exception as exc:
                entry.update(matches=False, error=_first_line(exc), difference=None, graph_breaks=None)
            else:
                difference = _first_difference(eager, compiled)
                entry.update(matches=difference is None, error=None, difference=difference, graph_breaks=breaks)
                if breaks != row.graph_breaks_per_forward:
                    problems.append(
                        f"{name} [{backend}]: the first compiled forward took {breaks} graph breaks, "
                        f"RELEASES row {row.label!r} says {row.graph_breaks_per_forward}"
                    )
            entry["seconds"] = round(time.monotonic() - start, 1)
            runs.append(entry)
            if not entry["matches"]:
                problems.append(f"{name} [{backend}]: {entry['error'] or entry['difference']}")
    fullgraph = _fullgraph_decode_compiles_once()
    if fullgraph:
        problems.append(f"cached_inference with fullgraph=True: {fullgraph}")
    torch._dynamo.reset()
    return {"ok": not problems, "problems": problems, "runs": runs, "fullgraph": fullgraph or "compiles once"}


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("leg", help="leg name in compat/matrix.toml")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--only", default="policy,probe,sequences", help="comma-separated checks")
    parser.add_argument("--matrix", type=Path, default=matrix_data.MATRIX_FILE)
    parser.add_argument("--sequence-backends", help="override the matrix's sequence_backends (e.g. eager,aot_eager)")
    args = parser.parse_args(argv)
    data = matrix_data.load(args.matrix)
    try:
        leg = data.leg(args.leg)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    warnings.simplefilter("ignore", attn.policy.CompatWarning)
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    result: dict = {
        "leg": leg.name,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "attn_file": attn.__file__,
    }
    backends = data.settings.sequence_backends
    if args.sequence_backends:
        backends = tuple(b.strip() for b in args.sequence_backends.split(",") if b.strip())
    row = compat.release_support()  # what this release must do: the one table
    checks = [
        ("policy", lambda: check_policy(leg, row)),
        ("probe", lambda: check_probe(leg, row, data.settings.probe_backends)),
        ("sequences", lambda: check_sequences(row, backends)),
    ]
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
        if entry["decides_in_graph"]:
            outcome = "traced, sound guard"
        else:
            outcome = f"{'traced, stale guard' if entry['traced'] else 'did not trace'}: {entry['error']}"
        print(f"[{leg.name}] probe {entry['backend']}: {outcome} ({entry['seconds']} s)")
    sequences = result.get("sequences", {})
    for run in sequences.get("runs", []):
        outcome = "same as eager" if run["matches"] else f"DIFFERS: {run['error'] or run['difference']}"
        print(
            f"[{leg.name}] sequence {run['sequence']:<18} {run['backend']:<9} graph breaks {run['graph_breaks']}, "
            f"{outcome} ({run['seconds']} s)"
        )
    if "fullgraph" in sequences:
        print(f"[{leg.name}] cached_inference fullgraph decode: {sequences['fullgraph']}")


if __name__ == "__main__":
    sys.exit(main())
