"""What serve.capture costs a deployment's tokens/s: the same requests with capture on, opted
out, and on a deployment without serve.capture.

    python -m lab.capture_cost --out lab/results/capture-cost.json   # make demo's eagle3 pair, -c 1,4

One deployment in process (trtspec.runtime.Deployment) of make demo's eagle3 spec with
serve.capture on (--sample 1, the default: every request kept, the most capture can cost), into a temporary
folder removed afterwards. The requests are the first --prompts of
lab/domain_shift_prompts.jsonl, --max-tokens each. Per concurrency and round, the whole set runs
three times, the order rotating between rounds: with every request allowing capture ("on"),
with every request opting out (the CaptureTag's flag, as a client's `capture: false`: "off"),
and with serve.capture switched off ("none": no writer and no label store, what a deployment of
the same spec without serve.capture runs; the target keeps its features either way, the head
reads them). A captured run's time includes writing its parts: the writer's thread is drained
before its clock stops, so this is capture's whole CPU cost on the cores that serve.

Writes --out (a result file) and prints, per concurrency, tokens/s of the three and the ratios:
on / none (what a deployment pays for turning capture on: the goal's ratio) and on / off.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
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
    ap.add_argument("--rounds", type=int, default=3, help="each arm runs first, second and third once in 3")
    ap.add_argument("--sample", type=float, default=1.0, help="serve.capture's sample: the share of requests kept")
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "capture-cost.json")
    return ap.parse_args(argv)


def timed_set(dep, prompts: list[str], max_tokens: int, c: int, allowed: bool, first_id: int) -> tuple[int, float]:
    """(tokens, seconds) of ``prompts`` in groups of ``c``, each request tagged ``allowed``; the
    seconds include writing their parts (the capture writer drained)."""
    from trtspec.speculative.capture import CaptureTag

    tokens, start = 0, time.perf_counter()
    for lo in range(0, len(prompts), c):
        group = prompts[lo : lo + c]
        reqs = [dep.request(dep.encode(p), max_tokens) for p in group]
        dep.forget_prefixes()
        tags = [CaptureTag(f"cost-{first_id + lo + i:05d}", allowed=allowed) for i in range(len(group))]
        tokens += sum(len(r.output_ids) for r in dep.generate(reqs, tags=tags))
    if dep.capture is not None:
        dep.capture.flush()
    return tokens, time.perf_counter() - start


@contextlib.contextmanager
def without_capture(dep) -> Iterator[None]:
    """``dep`` as a deployment of its spec without serve.capture: no writer and no label store
    (the eagle3 target keeps its features either way). The store comes back empty: the rows
    computed meanwhile were never forgotten in it."""
    writer, store = dep.capture, dep.target.labels
    dep.capture = dep.target.labels = None
    try:
        yield
    finally:
        store.ids.fill_(-1)
        dep.capture, dep.target.labels = writer, store


ARMS = ("on", "off", "none")  # capture allowed, every request opted out, serve.capture off


def timed_arm(dep, arm: str, prompts: list[str], max_tokens: int, c: int, first_id: int) -> tuple[int, float]:
    if arm == "none":
        with without_capture(dep):
            return timed_set(dep, prompts, max_tokens, c, True, first_id)
    return timed_set(dep, prompts, max_tokens, c, arm == "on", first_id)


def measure(dep, prompts: list[str], args: argparse.Namespace, folder: Path) -> dict:
    """Per concurrency: tokens/s of the three arms over the rounds and the ratios on / none
    (``goal_ratio``) and on / off (``ratio``)."""
    out: dict[str, dict] = {}
    ident = 0
    for c in (int(x) for x in args.concurrency.split(",")):
        for arm in ARMS:  # warm-up: this batch shape met once in each setting
            timed_arm(dep, arm, prompts[:c], 8, c, 0)
        sums = {arm: [0, 0.0] for arm in ARMS}
        for r in range(args.rounds):
            for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
                ident += len(prompts)
                n, secs = timed_arm(dep, arm, prompts, args.max_tokens, c, ident)
                sums[arm][0] += n
                sums[arm][1] += secs
                print(f"  c={c} round {r + 1}: capture {arm}: {n / secs:.1f} tok/s", file=sys.stderr, flush=True)
        on, off, none = (sums[arm][0] / sums[arm][1] for arm in ARMS)
        out[str(c)] = {
            "on_tok_s": round(on, 2),
            "off_tok_s": round(off, 2),
            "ratio": round(on / off, 4),
            "no_capture_tok_s": round(none, 1),
            "goal_ratio": round(on / none, 3),
        }
    parts = list(folder.glob("capture-*.safetensors"))
    out["captured"] = {"parts": len(parts), "bytes": sum(p.stat().st_size for p in parts), "dropped": dep.capture.dropped}
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
        try:
            values = measure(dep, prompts, args, folder)
        finally:
            dep.close()
        values |= {"prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds, "sample": args.sample}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_result(args.out, command_line(__file__, argv), values)
    for c, v in values.items():
        if isinstance(v, dict) and "ratio" in v:
            print(
                f"c={c}: capture on {v['on_tok_s']} tok/s, opted out {v['off_tok_s']}, without serve.capture "
                f"{v['no_capture_tok_s']}: on / none {v['goal_ratio']:.3f}x, on / opted out {v['ratio']:.3f}x"
            )
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
