"""The distill recipe, one change at a time: each variant makes one change to the default
recipe (reverts one of its choices, or tries one it does not make), trains on the same data
with the same seed, the same number of steps and the same batches (so the same training
tokens; never the same wall time, which depends on the machine's load), and is scored on
prompts no head saw (the spec's verify prompts and trtspec/bench/prompts.jsonl).

    python -m lab.distill_ablation engine_specs/smollm2-135m-eagle3-demo.yaml --steps 400 \
        --out lab/results/ablation [--variants all,no-anchor,...]

The first variant ("all", the current defaults) generates and captures the data; the others
reuse its capture (hard links into their work folders), except "trt-layers", whose features are
other layers. --capture DIR reuses an earlier run's capture (e.g. make demo's head's work folder)
instead. Writes ablation.json, ablation.md (the table) and prints the table; --result NAME also
merges the rows into lab/results/NAME.json (runs at other step counts or into other --out
folders add rows to the same file).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lab._common import RESULTS, ROOT, Result, command_line, write_result

TRTSPEC = str(Path(sys.executable).with_name("trtspec"))

# name -> (its one change from the default recipe, extra distill flags)
VARIANTS = {
    "all": ("nothing: the default recipe", []),
    "hard": ("hard labels: cross-entropy on the target's greedy token (default: soft)", ["--labels", "hard"]),
    "noise": ("uniform feature noise in [-0.05, 0.05]", ["--feature-noise", "0.05"]),
    "ttt3": ("3 training-time-test steps, weights 0.8^j (EAGLE-3's)", ["--ttt-steps", "3", "--step-decay", "0.8"]),
    "ttt3-decay-0.5": (
        "3 training-time-test steps, weights 0.5^j (1, 0.5, 0.25): the first draft weighted more",
        ["--ttt-steps", "3", "--step-decay", "0.5"],
    ),
    "ttt3-reach": (
        "3 training-time-test steps (0.8^j), a deeper step's positions weighted by the head's probability that its chain reaches them",
        ["--ttt-steps", "3", "--step-decay", "0.8", "--ttt-reach"],
    ),
    "ttt3-phase": (
        "3 training-time-test steps (0.8^j) after a depth-1 phase of half the steps",
        ["--ttt-steps", "3", "--step-decay", "0.8", "--ttt-phase", "0.5"],
    ),
    "lk": (
        "LK loss: -log of the acceptance rate sum_x min(p_x, q_x) over the target's top-32 (default: KL to it)",
        ["--loss", "lk"],
    ),
    "lk-ttt3": (
        "LK loss and 3 training-time-test steps, weights 0.5^j (against ttt3-decay-0.5: the loss alone)",
        ["--ttt-steps", "3", "--step-decay", "0.5", "--loss", "lk"],
    ),
    "norms": ("EAGLE-3.1's norms (speculators' default: before fc, before the residual, on the output)", ["--norms"]),
    "norms-ttt3": (
        "EAGLE-3.1's norms and 3 training-time-test steps (0.8^j): speculators' depth",
        ["--norms", "--ttt-steps", "3", "--step-decay", "0.8"],
    ),
    "norms-ttt3-no-anchor": (
        "EAGLE-3.1's norms, 3 training-time-test steps and no anchoring: speculators' start as well",
        ["--norms", "--ttt-steps", "3", "--step-decay", "0.8", "--no-anchor"],
    ),
    "no-anchor": ("random fc and layer, norm 1 (no anchoring)", ["--no-anchor"]),
    "dropout-0.1": ("dropout 0.1 on the fused input and the attention output (default: none)", ["--dropout", "0.1"]),
    "start-decay-20": (
        "the weights pulled back toward the anchored start by lr x 20 a step (L2-SP; default: no pull)",
        ["--start-decay", "20"],
    ),
    "start-decay-5": (
        "the weights pulled back toward the anchored start by lr x 5 a step (L2-SP; default: no pull)",
        ["--start-decay", "5"],
    ),
    "label-t2": (
        "soft labels at temperature 2: the target's and the head's logits over 2, the KL x 4 (default: 1)",
        ["--label-temperature", "2"],
    ),
    "label-t4": (
        "soft labels at temperature 4: the target's and the head's logits over 4, the KL x 16 (default: 1)",
        ["--label-temperature", "4"],
    ),
    "dropout-0.2": ("dropout 0.2 on the fused input and the attention output (default: none)", ["--dropout", "0.2"]),
    "trt-layers": ("TensorRT-LLM's default layers {1, L//2-1, L-4}", ["--layers", "1,14,26"]),
    "lm-head-trained": ("the LM head trained too", ["--train-lm-head"]),
    "ttt3-equal": ("3 training-time-test steps weighted equally", ["--ttt-steps", "3", "--step-decay", "1.0"]),
    "constant-lr": ("a constant learning rate", ["--schedule", "constant"]),
    "ema-0.99": (
        "the written head is the running average of the weights, decay 0.99 a step (default: the last weights)",
        ["--ema", "0.99"],
    ),
    "ema-0.998": (
        "the written head is the running average of the weights, decay 0.998 a step (default: the last weights)",
        ["--ema", "0.998"],
    ),
    "lr-2x": ("twice the learning rate (2e-3; default 1e-3)", ["--lr", "2e-3"]),
    "lr-4x": ("four times the learning rate (4e-3; default 1e-3)", ["--lr", "4e-3"]),
    "none": (
        "the earlier recipe: every revert above (no anchor, TensorRT-LLM's layers, LM head trained, 3 equal TTT steps, constant lr, hard labels)",
        [
            "--labels",
            "hard",
            "--no-anchor",
            "--layers",
            "1,14,26",
            "--train-lm-head",
            "--ttt-steps",
            "3",
            "--step-decay",
            "1.0",
            "--schedule",
            "constant",
        ],
    ),
}


def link_capture(src_work: Path, dst_work: Path) -> None:
    dst_work.mkdir(parents=True, exist_ok=True)
    for f in src_work.iterdir():
        if f.name.startswith(("features-", "data-")) and not (dst_work / f.name).exists():
            os.link(f, dst_work / f.name)


def run(spec: str, out: Path, name: str, flags: list[str], steps: int, common: list[str], reuse: bool) -> dict:
    head = out / name
    cmd = [TRTSPEC, "distill", spec, "-o", str(head), "--force", "--max-steps", str(steps), *common, *flags]
    cmd += ["--json-file", str(out / f"{name}.json")]
    t0 = time.monotonic()
    if not (reuse and (head / "trtspec-head.json").is_file()):
        with open(out / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        if rc != 0:
            raise SystemExit(f"{name}: distill exited {rc}; see {out / f'{name}.log'}")
    manifest = json.loads((head / "trtspec-head.json").read_text())
    m = manifest["metrics"]
    return {
        "variant": name,
        "change": VARIANTS[name][0],
        "k1_acceptance": round(m["unseen_accepted"][0], 3),
        "acceptance_length_k3": round(m["unseen_acceptance_length"], 3),
        "per_position": [round(a, 3) for a in m["unseen_accepted"]],
        "top_r": [[round(a, 3) for a in d] for d in m.get("unseen_top_r", [])],
        "unseen_chains": m["unseen_chains"],
        "steps": manifest["steps"],
        "train_response_tokens": manifest["data"]["train_response_tokens"],
        # wall time under whatever load the machine had: not a speed figure
        "seconds": manifest["elapsed_s"] if reuse else round(time.monotonic() - t0, 1),
        # this process's CPU seconds in the training loop (a resumed run's count only since it resumed: none)
        "train_cpu_s": None if manifest["run"].get("resume") else manifest.get("train_cpu_s"),
        "command": " ".join(cmd[1:]),
        "head": str(head.resolve()),  # where it is (a link given as --out/NAME: the head it points to)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "ablation")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reuse", action="store_true", help="read a variant's finished head instead of training it again")
    ap.add_argument(
        "--resume", action="store_true", help="continue each variant's interrupted run from its checkpoint (distill --resume)"
    )
    ap.add_argument("--result", help="also merge the rows into lab/results/RESULT.json (the documents' figures)")
    ap.add_argument(
        "--capture",
        type=Path,
        help="a distill work folder (a head's .NAME.distill) whose capture every variant of the default layers reuses "
        "(hard links), instead of the one 'all' makes",
    )
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.capture:
        if not args.capture.is_dir() or not any(f.name.startswith("features-") for f in args.capture.iterdir()):
            raise SystemExit(f"--capture {args.capture}: no features-* files there; give a head's .NAME.distill folder")
        link_capture(args.capture, out / ".all.distill")
    # on top of the spec's distill: block, what every variant shares: the steps (given per run),
    # no time budget (the same steps whatever the load) and no data-scaling curve
    common = ["--max-tokens", str(args.max_tokens), "--weight-decay", "0.01", "--time-budget", "none", "--scaling", "none"]
    common += ["--eval-prompts", str(ROOT / "trtspec" / "bench" / "prompts.jsonl")] + (["--resume"] if args.resume else [])
    rows = []
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
        # the capture of the same layers, made by an earlier variant
        source = out / (".trt-layers.distill" if "--layers" in VARIANTS[name][1] else ".all.distill")
        if source.is_dir() and source.name != f".{name}.distill":
            link_capture(source, out / f".{name}.distill")
        print(f"running {name} ...", flush=True)
        rows.append(run(args.spec, out, name, VARIANTS[name][1], args.steps, common, args.reuse))
        (out / "ablation.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = markdown_table(rows)
    (out / "ablation.md").write_text(table + "\n")
    print(table)
    if args.result:
        print(f"wrote {record(args.result, rows)}")


def markdown_table(rows: list[dict]) -> str:
    table = [
        "| variant | change from the default recipe | steps | k=1 acceptance | acceptance length k=3 | per position | top-3 recall per depth |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        per = "/".join(f"{a:.2f}" for a in r["per_position"])
        top3 = "/".join(f"{d[-1]:.2f}" for d in r["top_r"])
        table.append(
            f"| {r['variant']} | {r['change']} | {r['steps']} | {r['k1_acceptance']:.3f} | {r['acceptance_length_k3']:.2f} | {per} | {top3} |"
        )
    return "\n".join(table)


RESULT_COLUMNS = ["variant", "change", "steps", "k=1 acceptance", "acceptance length k=3", "per position (k=3)", "training CPU s"]


def record(name: str, rows: list[dict]) -> Path:
    """Merge ``rows`` into lab/results/NAME.json (one row per variant and step count, a later
    run replacing an earlier one; this command added to the file's), with the table the
    documents show (lab/figures.py) and this machine's description."""
    path = RESULTS / f"{name}.json"
    old = Result.read(path) if path.is_file() else None
    new = {(r["variant"], r["steps"]) for r in rows}
    kept = [r for r in (old.values["rows"] if old else []) if (r["variant"], r["steps"]) not in new]
    merged = sorted(kept + rows, key=lambda r: (r["steps"], r["variant"]))
    table = {
        "columns": RESULT_COLUMNS,
        "rows": [
            [
                r["variant"],
                r["change"],
                r["steps"],
                f"{r['k1_acceptance']:.3f}",
                f"{r['acceptance_length_k3']:.3f}",
                " / ".join(f"{a:.2f}" for a in r["per_position"]),
                "not recorded" if r.get("train_cpu_s") is None else f"{r['train_cpu_s']:.0f}",
            ]
            for r in merged
        ],
    }
    commands = (old.command.splitlines() if old else []) + [command_line("distill_ablation.py")]
    return write_result(path, "\n".join(dict.fromkeys(commands)), {"rows": merged, "table": table})


if __name__ == "__main__":
    main()
