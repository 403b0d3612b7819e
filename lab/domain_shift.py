"""Issue 53's first goal, end to end: make demo's head follows a new domain after serving it
with capture on and one `distill --from-capture`.

    python -m lab.domain_shift [--head weights/smollm2-135m-eagle3-head-demo] [--served 300] \
        [--held 75] [--max-tokens 96] [--max-steps 600] [--time-budget 9m] [--work .trtspec/domain-shift] \
        [--out lab/results/domain-shift.json]

1. Two specs in --work, copies of make demo's (engine_specs/smollm2-135m-eagle3-demo.yaml: the
   same target, verify prompts and distill: recipe) with absolute paths: `old.yaml` drafts with
   --head and has `serve.capture` on (sample 1: every request is kept, no tenant excluded);
   `new.yaml` drafts with the new head, capture off. Each is built with `trtspec build`.
2. Serving, as a deployment serving in process does (trtspec.runtime.Deployment, docs/capture.md):
   the first --served prompts of lab/domain_shift_prompts.jsonl (code, JSON, SQL and shell
   requests: lab/domain_prompts.py), then the next --held, in order, each request with its
   CaptureTag, at k = 1 (the spec's default), --batch requests at a time. The held-out requests
   are the newest parts of the capture folder: distill --from-capture's --capture-held-out
   (held / (served + held)) holds out exactly them, never trained on.
3. `trtspec distill old.yaml --from-capture DIR --init HEAD -o NEW --max-steps N --time-budget 9m
   --capture-held-out F` (the budget holds the run to the goal's 10 minutes with its final
   scoring; on a loaded machine it cuts steps: the result says how many ran and what stopped
   them), in a process of its own; its CPU time (user + system, from wait4) is
   recorded. Its report: k=1 acceptance of the old and new heads on the held-out captured
   requests, on the spec's verify prompts and on every unseen chat prompt (those and the head
   recipe's eval prompts, trtspec/bench/prompts.jsonl), teacher-forced as distill scores heads.
4. Live acceptance, as served (the loop's accepted / drafted at k=1, greedy): the old head's
   from step 2 on the held-out requests, then both heads on the same held-out prompts, on the
   code prompts of lab/auto_mixed_prompts.jsonl (written by others, never served: the "far"
   set) and on the spec's verify prompts (verify.max_tokens).

Writes --out (a result file: command, machine, time, values) and prints the figures. The lab
reaches trtspec only through its commands and documented entry points.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lab._common import ROOT, Result, command_line

DEMO_SPEC = ROOT / "engine_specs" / "smollm2-135m-eagle3-demo.yaml"
PROMPTS = ROOT / "lab" / "domain_shift_prompts.jsonl"
FAR = ROOT / "lab" / "auto_mixed_prompts.jsonl"
TRTSPEC = [sys.executable, "-m", "trtspec"]


def read_prompts(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def far_prompts() -> list[dict]:
    """lab/auto_mixed_prompts.jsonl's code and config requests ("Here is FILE:")."""
    return [dict(r, kind="far") for r in read_prompts(FAR) if r["prompt"].startswith("Here is ")]


def write_spec(work: Path, source: Path, name: str, head: Path, capture: Path | None, batch: int) -> Path:
    """``source`` (make demo's spec) with absolute paths, drafting with ``head``; serve.capture
    into ``capture``."""
    spec = yaml.safe_load(source.read_text(encoding="utf-8"))
    base = source.parent
    spec["name"] = f"domain-shift-{name}"
    spec["target"]["path"] = str((base / spec["target"]["path"]).resolve())
    spec["draft"]["path"] = str(head.resolve())
    if "eval_prompts" in spec.get("distill", {}):
        spec["distill"]["eval_prompts"] = str((base / spec["distill"]["eval_prompts"]).resolve())
    spec["output_dir"] = str((work / f"engines-{name}").resolve())
    spec["build"]["max_batch_size"] = batch
    if capture is not None:
        spec.setdefault("serve", {})["capture"] = {"dir": str(capture.resolve()), "max_gb": 5, "sample": 1.0}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return path


def run_cli(args: list[str], log: Path) -> float:
    """One trtspec command, its output appended to ``log``; its CPU seconds (user + system)."""
    with log.open("a", encoding="utf-8") as out:
        out.write(f"$ trtspec {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen([*TRTSPEC, *args], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"trtspec {args[0]} exited {proc.returncode}; see {log}")
    return usage.ru_utime + usage.ru_stime


def deployment(spec: Path, batch: int):
    """The spec's built engines in process (trtspec.runtime.Deployment), ``batch`` slots."""
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    loaded = load_spec(spec)
    return Deployment(loaded, loaded.output_dir(), slots=batch)


def serve(dep, rows: list[dict], max_tokens: int | None, batch: int, capture: bool, first_id: int = 0) -> list[dict]:
    """Generate ``rows`` at the spec's k, ``batch`` at a time; per request its live acceptance
    (drafted, accepted), tokens and kind. ``capture``: each request carries its CaptureTag
    (request id ``domain-<n>``), so serve.capture keeps it."""
    from trtspec.speculative.capture import CaptureTag

    tokens = max_tokens or dep.spec.verify.max_tokens
    out = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        reqs = [dep.request(dep.encode(r["prompt"]), tokens) for r in chunk]
        ids = [f"domain-{first_id + start + i:04d}" for i in range(len(chunk))]
        tags = [CaptureTag(i) for i in ids] if capture else None
        for r, req, res, rid in zip(chunk, reqs, dep.generate(reqs, tags=tags), ids, strict=True):
            m = res.metrics
            row = {"id": rid, "kind": r.get("kind", "chat"), "prompt_tokens": len(req.prompt_ids)}
            out.append(row | {"output_tokens": len(res.output_ids), "drafted": m.drafted, "accepted": m.accepted})
        print(f"  {min(start + batch, len(rows))}/{len(rows)} requests", flush=True)
    return out


def acceptance(runs: list[dict], kind: str | None = None) -> dict:
    """Accepted / drafted over ``runs`` (of one kind), with the counts."""
    sel = [r for r in runs if kind is None or r["kind"] == kind]
    drafted, accepted = sum(r["drafted"] for r in sel), sum(r["accepted"] for r in sel)
    return {"k1": round(accepted / drafted, 4) if drafted else None, "requests": len(sel), "drafted": drafted}


def live_table(old: dict[str, list[dict]], new: dict[str, list[dict]]) -> dict:
    """Per set (and per kind of the held-out set): old and new heads' live acceptance."""
    table = {}
    for name in old:
        table[name] = {"old": acceptance(old[name]), "new": acceptance(new[name])}
    for kind in ("code", "json", "sql", "shell"):
        table[f"held_out_{kind}"] = {"old": acceptance(old["held_out"], kind), "new": acceptance(new["held_out"], kind)}
    return table


def captured_figures(folder: Path) -> dict:
    """What the capture folder holds: requests, tokens (prompt, response), bytes."""
    from trtspec.speculative.capture import read_capture

    kept = read_capture(folder)
    resp = sum(int(c.sample.response_mask().sum()) for c in kept)
    total = sum(len(c.sample.tokens) for c in kept)
    size = sum(c.path.stat().st_size for c in kept)
    return {"requests": len(kept), "tokens": total, "response_tokens": resp, "bytes": size}


def head_manifest(head: Path) -> dict:
    m = json.loads((head / "trtspec-head.json").read_text(encoding="utf-8"))
    return {k: m.get(k) for k in ("steps", "stopped_by", "continued", "comparison", "recipe")}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", type=Path, default=DEMO_SPEC, help="the spec whose head --head is (make demo's)")
    ap.add_argument("--head", type=Path, default=ROOT / "weights" / "smollm2-135m-eagle3-head-demo")
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument("--served", type=int, default=300, help="requests served with capture on before the held-out ones")
    ap.add_argument("--held", type=int, default=75, help="the newest requests, held out (never trained on)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per domain request")
    ap.add_argument("--max-steps", type=int, default=600, help="distill --from-capture's training steps")
    ap.add_argument(
        "--time-budget",
        default="9m",
        help="distill --from-capture's --time-budget: the goal's 10 minutes, less the final scoring",
    )
    ap.add_argument("--batch", type=int, default=8, help="requests served at once")
    ap.add_argument("--work", type=Path, default=ROOT / ".trtspec" / "domain-shift")
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "domain-shift.json")
    return ap.parse_args()


def stage(path: Path, make):
    """``make()``'s JSON, kept at ``path``: a rerun in the same --work reuses a finished stage."""
    if path.is_file():
        print(f"reusing {path}", flush=True)
        return json.loads(path.read_text(encoding="utf-8"))
    value = make()
    path.write_text(json.dumps(value), encoding="utf-8")
    return value


def serve_sets(dep, args, held_rows: list[dict], far: list[dict]) -> dict[str, list[dict]]:
    """Live runs (uncaptured) of the held-out prompts, the far set and the verify prompts."""
    verify = [{"prompt": p} for p in dep.loaded.verify_prompts()]
    return {
        "held_out": serve(dep, held_rows, args.max_tokens, args.batch, capture=False, first_id=args.served),
        "far": serve(dep, far, args.max_tokens, args.batch, capture=False, first_id=10_000),
        "verify": serve(dep, verify, None, args.batch, capture=False, first_id=20_000),
    }


def capture_stage(args, rows: list[dict], far: list[dict]) -> dict:
    """Build old.yaml and serve the domain with capture on (served, then held-out requests, in
    order); the old head's live runs: those, the far set and the verify prompts."""
    capture = args.work / "captured"
    if capture.exists() and any(capture.iterdir()):
        raise SystemExit(f"{capture} is not empty: pass a fresh --work (the held-out requests must be the newest parts)")
    old_spec = write_spec(args.work, args.spec, "old", args.head, capture, args.batch)
    run_cli(["build", str(old_spec)], args.work / "log.txt")
    dep = deployment(old_spec, args.batch)
    runs = serve(dep, rows[: args.served + args.held], args.max_tokens, args.batch, capture=True)
    sets = serve_sets(dep, args, [], far)
    dep.close()  # the capture writer's thread writes the parts it still holds
    return {"served": runs[: args.served], "held_out": runs[args.served :], "far": sets["far"], "verify": sets["verify"]}


def distill_stage(args) -> dict:
    """One `distill --from-capture` of the old spec's capture, from --head; its CPU seconds."""
    held_share = f"{(args.held - 0.5) / (args.served + args.held):.6f}"  # ceil(share x n) = --held exactly
    cmd = ["distill", str(args.work / "old.yaml"), "--from-capture", str(args.work / "captured")]
    cmd += ["--init", str(args.head), "-o", str(args.work / "head-new"), "--force", "--max-steps", str(args.max_steps)]
    cmd += ["--time-budget", args.time_budget, "--capture-held-out", held_share, "--json-file", str(args.work / "distill.json")]
    cpu = run_cli(cmd, args.work / "log.txt")
    report = json.loads((args.work / "distill.json").read_text(encoding="utf-8"))
    return {"cpu_s": round(cpu, 1), "command": "trtspec " + " ".join(cmd), "report": report}


def new_stage(args, rows: list[dict], far: list[dict]) -> dict:
    new_spec = write_spec(args.work, args.spec, "new", args.work / "head-new", None, args.batch)
    run_cli(["build", str(new_spec)], args.work / "log.txt")
    return serve_sets(deployment(new_spec, args.batch), args, rows[args.served : args.served + args.held], far)


def figures(args, old: dict, distilled: dict, new: dict) -> dict:
    sets = ("held_out", "far", "verify")
    return {
        "served_requests": args.served,
        "held_out_requests": args.held,
        "max_tokens": args.max_tokens,
        "captured": captured_figures(args.work / "captured"),
        "distill_cpu_s": distilled["cpu_s"],
        "distill_command": distilled["command"],
        "distill_max_steps": args.max_steps,
        "distill_report": {k: distilled["report"].get(k) for k in ("steps", "old", "new")},
        "new_head": head_manifest(args.work / "head-new"),
        "live_k1": live_table({k: old[k] for k in sets}, {k: new[k] for k in sets}),
        "served_live_k1_old": acceptance(old["served"]),
        "runs": {"old": old, "new": new},
    }


def main() -> int:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    rows, far = read_prompts(args.prompts), far_prompts()
    if len(rows) < args.served + args.held:
        raise SystemExit(f"{args.prompts} holds {len(rows)} prompts; --served + --held needs {args.served + args.held}")
    old = stage(args.work / "old-runs.json", lambda: capture_stage(args, rows, far))
    distilled = stage(args.work / "distill-run.json", lambda: distill_stage(args))
    new = stage(args.work / "new-runs.json", lambda: new_stage(args, rows, far))
    values = figures(args, old, distilled, new)
    from trtspec.machine import description

    when = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = Result(command_line(__file__), description(), when, values)
    args.out.write_text(json.dumps(result.to_dict(), indent=1), encoding="utf-8")
    print(json.dumps({k: values[k] for k in ("captured", "distill_cpu_s", "distill_report", "live_k1")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
