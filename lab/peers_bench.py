"""trtspec vs Hugging Face transformers (and vLLM) on the same pair and prompts, in one run.

    python -m lab.peers_bench                             # the CPU demo pair, all prompts
    python -m lab.peers_bench --limit 3 --max-tokens 16   # a quick look
    python -m lab.peers_bench --spec engine_specs/tiny-llama.yaml --out lab/results/tiny.md
    python -m lab.peers_bench --spec engine_specs/smollm2-135m-eagle3.yaml \
        --draft-from engine_specs/smollm2-135m-cpu.yaml --out lab/results/peers-eagle3.md
    make vllm && python -m lab.peers_bench --vllm .venv-vllm/bin/python --concurrency 1,4

Build the spec's engines first (`trtspec build SPEC`). Progress goes to stderr; the markdown
tables (one per concurrency) go to stdout and to --out, with the full measurements as JSON
(same name, .json) and a plot of tokens/s (.png) beside it. --vllm adds vLLM's paths: vLLM runs
in its own environment, one trtspec/testing/vllm_peer.py process per path, its log in --out's name with
.vllm.log. Ctrl-C stops the run and still writes the prompts measured so far. The paths and
every definition are in lab/peers.py; the table, JSON and plot in lab/peers_report.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab._common import ROOT, command_line, write_result
from lab.peers import describe_setup, encode_prompts, measure, peer_paths, read_kinded_prompts, vllm_paths
from lab.peers_report import plot, render_markdown, summarise, to_json
from trtspec.errors import EXIT_INTERRUPTED, RequestError, TrtspecError
from trtspec.files import write_text_atomic
from trtspec.runtime import Deployment
from trtspec.spec import load_spec
from trtspec.testing.vllm_worker import PEER_SCRIPT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, default=ROOT / "engine_specs" / "smollm2-135m-cpu.yaml")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=Path, default=ROOT / "trtspec" / "bench" / "prompts.jsonl")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and path; the fastest counts (a busy machine)")
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "peers.md")
    ap.add_argument(
        "--draft-from",
        type=Path,
        default=None,
        help="a built spec with the same target whose draft adds our path with it and, for an eagle3 "
        "--spec, transformers' assisted generation with it (HF's best path on this target)",
    )
    ap.add_argument(
        "--concurrency",
        "-c",
        default="1",
        help="comma-separated levels, e.g. 1,4: each measures all prompts in groups of that many sent at "
        "once (HF paths at 1 only)",
    )
    ap.add_argument(
        "--vllm",
        type=Path,
        default=None,
        metavar="PYTHON",
        help="the python of vLLM's own environment (make vllm: .venv-vllm/bin/python): adds vLLM's paths",
    )
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="vLLM's CPU KV cache per path, GiB (default 1)")
    ap.add_argument(
        "--paths",
        default=None,
        help="comma-separated path keys to measure, e.g. ours_target,ours_eagle3,vllm_target,vllm_eagle3 "
        "(ours_target, the reference, is always kept; default: every path)",
    )
    args = ap.parse_args(argv)
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        ap.error(f"--concurrency takes comma-separated integers, e.g. 1,4 (got {args.concurrency!r})")
    if not all(1 <= c <= 64 for c in args.concurrency):
        ap.error("--concurrency levels must be 1..64")
    if args.vllm is not None and not args.vllm.is_file():
        ap.error(f"--vllm {args.vllm} does not exist; create vLLM's environment with `make vllm`")
    if args.vllm_kv_gib < 1:
        ap.error("--vllm-kv-gib must be at least 1")
    if args.max_tokens < 1:
        ap.error("--max-tokens must be at least 1")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    if args.paths is not None:
        args.paths = frozenset({"ours_target", *(k.strip() for k in args.paths.split(",") if k.strip())})
    return args


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    close = lambda: None  # noqa: E731  (the vLLM workers' stop, once started)
    try:
        loaded = load_spec(args.spec)
        draft_from = load_spec(args.draft_from) if args.draft_from else None
        rows = read_kinded_prompts(args.prompts, args.limit)
        progress(f"loading {loaded.spec.name} (trtspec engines and transformers checkpoints)")
        if max(args.concurrency) > loaded.spec.build.max_batch_size:
            raise RequestError(
                f"--concurrency {max(args.concurrency)} exceeds the spec's build.max_batch_size "
                f"({loaded.spec.build.max_batch_size}); lower it or rebuild with a larger batch"
            )
        dep = Deployment(loaded, loaded.output_dir(), slots=max(args.concurrency))
        prompts = encode_prompts(dep, rows)
        for p in prompts:
            dep.request(p.ids, args.max_tokens)  # RequestError now, not halfway through the run
        paths, settings = peer_paths(dep, draft_from)
        vllm = None
        if args.vllm is not None:
            log = args.out.with_suffix(".vllm.log")
            more, vllm, close = vllm_paths(
                dep, args.vllm, PEER_SCRIPT, log, draft_from, args.vllm_kv_gib, max(args.concurrency), progress, args.paths
            )
            paths += more
        if args.paths is not None:
            unknown = sorted(args.paths - {p.key for p in paths})
            if unknown:
                raise RequestError(f"--paths {','.join(unknown)}: no such path here; known: {', '.join(p.key for p in paths)}")
            paths = [p for p in paths if p.key in args.paths]
    except TrtspecError as e:
        close()
        print(f"Error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        close()
        progress("interrupted before anything was measured")
        return EXIT_INTERRUPTED
    command = command_line("peers_bench.py", argv)
    setup = describe_setup(dep, settings, vllm) | {"command": command}
    results = []
    try:
        for c in args.concurrency:
            progress(f"concurrency {c}")
            result = measure(paths, prompts, args.max_tokens, args.repeats, progress, concurrency=c)
            result.setup = setup
            results.append((result, summarise(result)))
            if result.interrupted:
                break
    except TrtspecError as e:  # a vLLM worker that died mid-run
        print(f"Error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        close()
    table = "\n".join(render_markdown(m, s) for m, s in results)
    write_text_atomic(args.out, table)
    write_result(args.out.with_suffix(".json"), command, {"results": [to_json(m, s) for m, s in results]})
    png = plot(results, args.out.with_suffix(".png"))
    print(table, end="")
    progress(f"wrote {args.out}, {args.out.with_suffix('.json').name} and {png.name}")
    return EXIT_INTERRUPTED if results[-1][0].interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
