"""The co-designed pair against the off-the-shelf ones, on ONE target, in one run.

    python bench/codesign.py                      # SmolLM2 demo: eagle3 vs draft_target vs ngram vs target-only
    python bench/codesign.py --limit 2 --max-tokens 32

Needs both specs built (`trtspec build engine_specs/smollm2-135m-eagle3.yaml` after
`trtspec distill` on it, and `trtspec build engine_specs/smollm2-135m-cpu.yaml`): the eagle3
spec's target engine is the verifier for every method; the draft_target spec contributes only
its draft engine (same target weights). Prints a table; writes JSON (--out). Definitions in
trtspec/bench/methods.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trtspec.bench.measure import machine_description
from trtspec.bench.methods import compare_methods
from trtspec.engines.manifest import check_manifest
from trtspec.engines.torch.engine import TorchEngine
from trtspec.files import write_json_atomic
from trtspec.runtime import Deployment
from trtspec.spec import load_spec, read_prompts_file
from trtspec.speculative.drafters import ModelDrafter, NgramDrafter

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle3", type=Path, default=ROOT / "engine_specs" / "smollm2-135m-eagle3.yaml")
    ap.add_argument("--draft-target", type=Path, default=ROOT / "engine_specs" / "smollm2-135m-cpu.yaml")
    ap.add_argument("--prompts", type=Path, default=None, help="JSONL; default: the eagle3 spec's verify prompts")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=None, help="eagle3 draft length (default: the spec's)")
    ap.add_argument("--k-draft-target", type=int, default=None, help="default: that spec's")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "codesign.json")
    args = ap.parse_args(argv)

    eagle = load_spec(args.eagle3)
    pair = load_spec(args.draft_target)
    dep = Deployment(eagle, eagle.output_dir())
    draft_dir = pair.output_dir() / "draft"
    check_manifest(draft_dir, "draft", pair.spec.build_hash("draft"))
    draft = TorchEngine.load(draft_dir)
    prompts = read_prompts_file(args.prompts) if args.prompts else eagle.verify_prompts()
    prompts = prompts[: args.limit] if args.limit else prompts
    k = args.k or eagle.spec.speculative.default_draft_tokens
    k_dt = args.k_draft_target or pair.spec.speculative.default_draft_tokens
    requests = [dep.request(dep.encode(p), args.max_tokens, 0) for p in prompts]

    def forget():
        dep.forget_prefixes()
        draft.forget_prefixes()

    vocab = min(draft.vocab_size, dep.target.vocab_size)
    drafters = {
        f"eagle3 k={k}": (dep.drafter, k),
        f"draft_target k={k_dt}": (lambda: ModelDrafter(draft.run, vocab), k_dt),
        f"ngram k={k_dt}": (lambda: NgramDrafter(pair.spec.speculative.max_ngram, pair.spec.speculative.min_ngram), k_dt),
    }

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    stats = compare_methods(dep.verifier(), drafters, requests, forget, args.rounds, progress)
    base = stats[0]
    rows = [s.to_dict(base) for s in stats]
    report = {
        "machine": machine_description(),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "eagle3_spec": str(args.eagle3),
        "draft_target_spec": str(args.draft_target),
        "command": "python bench/codesign.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "methods": rows,
    }
    print(f"{'method':<22}{'tok/s':>8}{'speedup':>9}{'accept':>8}{'len':>6}{'c':>8}  identical")
    for r in rows:
        print(
            f"{r['method']:<22}{r['tokens_per_s']:>8.1f}{r.get('speedup', 1.0):>9.2f}"
            f"{r.get('acceptance_rate', float('nan')):>8.2f}{r.get('mean_acceptance_length', 1.0):>6.2f}"
            f"{r.get('draft_cost_c', float('nan')):>8.3f}  {r['identical_to_target_only']}"
        )
    write_json_atomic(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r["identical_to_target_only"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
