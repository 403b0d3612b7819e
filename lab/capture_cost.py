"""What serve.capture costs a deployment's tokens/s: the same requests with capture on and off.

    python -m lab.capture_cost --out lab/results/capture-cost.json   # make demo's eagle3 pair, -c 1,4

One deployment in process (trtspec.runtime.Deployment) of make demo's eagle3 spec with
serve.capture on (--sample 1, the default: every request kept, the most capture can cost), into a temporary
folder removed afterwards. The requests are the first --prompts of
lab/domain_shift_prompts.jsonl, --max-tokens each. Per concurrency and round, the whole set runs
once with every request allowing capture and once with every request opting out (the
CaptureTag's flag, as a client's `capture: false`), the order alternating between rounds. A
captured run's time includes writing its parts: in process a request is kept after it is
answered, on the same cores, so this is capture's whole CPU cost (served, the engine model keeps
requests on a thread of its own, on the same cores).

Writes --out (a result file) and prints, per concurrency, tokens/s of both and their ratio.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from lab._common import ROOT, command_line, write_result
from lab.domain_shift import DEMO_SPEC, PROMPTS, deployment, read_prompts, run_cli, write_spec


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--spec",
        type=Path,
        default=DEMO_SPEC,
        help="an eagle3 spec whose head exists (built again with capture on, in a temporary folder)",
    )
    ap.add_argument("--prompts", type=int, default=16, help="how many of lab/domain_shift_prompts.jsonl")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-c", "--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sample", type=float, default=1.0, help="serve.capture's sample: the share of requests kept")
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "capture-cost.json")
    return ap.parse_args(argv)


def timed_set(dep, prompts: list[str], max_tokens: int, c: int, allowed: bool, first_id: int) -> tuple[int, float]:
    """(tokens, seconds) of ``prompts`` in groups of ``c``, each request tagged ``allowed``."""
    from trtspec.speculative.capture import CaptureTag

    tokens, start = 0, time.perf_counter()
    for lo in range(0, len(prompts), c):
        group = prompts[lo : lo + c]
        reqs = [dep.request(dep.encode(p), max_tokens) for p in group]
        dep.forget_prefixes()
        tags = [CaptureTag(f"cost-{first_id + lo + i:05d}", allowed=allowed) for i in range(len(group))]
        tokens += sum(len(r.output_ids) for r in dep.generate(reqs, tags=tags))
    return tokens, time.perf_counter() - start


def measure(dep, prompts: list[str], args: argparse.Namespace, folder: Path) -> dict:
    """Per concurrency: tokens and seconds of both settings summed over the rounds, their ratio."""
    out: dict[str, dict] = {}
    levels = [int(x) for x in args.concurrency.split(",")]
    ident = 0
    for c in levels:
        for allowed in (True, False):  # warm-up: this batch shape met once, capture's own forward too
            timed_set(dep, prompts[:c], 8, c, allowed, 0)
        sums = {"on": [0, 0.0], "off": [0, 0.0]}
        for r in range(args.rounds):
            for allowed in (True, False) if r % 2 == 0 else (False, True):
                ident += len(prompts)
                n, secs = timed_set(dep, prompts, args.max_tokens, c, allowed, ident)
                key = "on" if allowed else "off"
                sums[key][0] += n
                sums[key][1] += secs
                print(f"  c={c} round {r + 1}: capture {key}: {n / secs:.1f} tok/s", file=sys.stderr, flush=True)
        on, off = (sums[k][0] / sums[k][1] for k in ("on", "off"))
        out[str(c)] = {"on_tok_s": round(on, 2), "off_tok_s": round(off, 2), "ratio": round(on / off, 4)}
    parts = list(folder.glob("capture-*.safetensors"))
    out["captured"] = {"parts": len(parts), "bytes": sum(p.stat().st_size for p in parts)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = [r["prompt"] for r in read_prompts(PROMPTS)][: args.prompts]
    work = Path(tempfile.mkdtemp(prefix="trtspec-capture-cost-"))
    try:
        folder = work / "captured"
        spec = write_spec(work, args.spec, "capture-cost", _head(args.spec), folder, 4)
        _set_sample(spec, args.sample)
        run_cli(["build", str(spec)], work / "build.log")
        dep = deployment(spec, 4)
        values = measure(dep, prompts, args, folder)
        values |= {"prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds, "sample": args.sample}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, command_line(__file__, argv), values)
    for c, v in values.items():
        if isinstance(v, dict) and "ratio" in v:
            print(f"c={c}: capture on {v['on_tok_s']} tok/s, off {v['off_tok_s']} tok/s: {v['ratio']:.3f}x")
    print(f"wrote {args.out}")
    return 0


def _head(spec: Path) -> Path:
    import yaml

    data = yaml.safe_load(spec.read_text(encoding="utf-8"))
    return (spec.parent / data["draft"]["path"]).resolve()


def _set_sample(spec: Path, share: float) -> None:
    import yaml

    data = yaml.safe_load(spec.read_text(encoding="utf-8"))
    data["serve"]["capture"]["sample"] = share
    spec.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
