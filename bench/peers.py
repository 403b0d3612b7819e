"""trtspec vs Hugging Face transformers on the same pair and prompts, in one run.

    python bench/peers.py                                   # the CPU demo pair, all prompts
    python bench/peers.py --limit 3 --max-tokens 16         # a quick look
    python bench/peers.py --spec engine_specs/tiny-llama.yaml --out bench/results/tiny.md
    python bench/peers.py --spec engine_specs/smollm2-135m-eagle3.yaml \
        --draft-from engine_specs/smollm2-135m-cpu.yaml --out bench/results/peers-eagle3.md

Build the spec's engines first (`trtspec build SPEC`). Progress goes to stderr; the markdown
table goes to stdout and to --out, with the full measurements as JSON beside it (same name,
.json). Ctrl-C stops the run and still writes the prompts measured so far. The paths and
every definition are in trtspec/peers.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trtspec.bench.peers import (
    describe_setup,
    encode_prompts,
    measure,
    peer_paths,
    read_prompts,
    render_markdown,
    summarise,
    to_json,
)
from trtspec.errors import EXIT_INTERRUPTED, TrtspecError
from trtspec.files import write_json_atomic, write_text_atomic
from trtspec.runtime import Deployment
from trtspec.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=ROOT / "engine_specs" / "smollm2-135m-cpu.yaml")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=Path, default=ROOT / "bench" / "prompts.jsonl")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and path; the fastest counts (a busy machine)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers.md")
    ap.add_argument(
        "--draft-from",
        type=Path,
        default=None,
        help="a built spec with the same target whose draft adds our path with it and, for an eagle3 "
        "--spec, transformers' assisted generation with it (HF's best path on this target)",
    )
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    return args


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        loaded = load_spec(args.spec)
        rows = read_prompts(args.prompts, args.limit)
        progress(f"loading {loaded.spec.name} (trtspec engines and transformers checkpoints)")
        dep = Deployment(loaded, loaded.output_dir(), slots=1)
        prompts = encode_prompts(dep, rows)
        for p in prompts:
            dep.request(p.ids, args.max_tokens)  # RequestError now, not halfway through the run
        paths, settings = peer_paths(dep, load_spec(args.draft_from) if args.draft_from else None)
    except TrtspecError as e:
        print(f"Error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        progress("interrupted before anything was measured")
        return EXIT_INTERRUPTED
    result = measure(paths, prompts, args.max_tokens, args.repeats, progress)
    result.setup = describe_setup(dep, settings) | {"command": " ".join(["python", "bench/peers.py", *sys.argv[1:]])}
    summaries = summarise(result)
    table = render_markdown(result, summaries)
    write_text_atomic(args.out, table)
    write_json_atomic(args.out.with_suffix(".json"), to_json(result, summaries))
    print(table, end="")
    progress(f"wrote {args.out} and {args.out.with_suffix('.json').name}")
    return EXIT_INTERRUPTED if result.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
