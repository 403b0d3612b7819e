"""Acceptance of deterministic drafters (n-gram, suffix) on a target's recorded greedy outputs.

    .venv/bin/python -m lab.acceptance_replay engine_specs/smollm2-135m-cpu-suffix.yaml \
        --prompts trtspec/bench/repeat_prompts.jsonl --prompts trtspec/bench/prompts.jsonl --max-tokens 128 \
        --json lab/results/acceptance-replay.json

Greedy speculative output is token-identical to target-only output, so what the target answers
to any draft is known once its target-only output is: the next token at every position, and
the end id where it stopped. This script runs target-only once per prompt (the only model
calls), then drives the one loop (speculative.loop.generate) with each drafter against a
verifier that answers from those outputs, and checks every replayed output equals the recorded
one. Tokens per target forward and acceptance are therefore exactly what `trtspec verify` and
`bench --methods` report for these drafters (checked against `trtspec verify` on three
prompts: the same counts per prompt), without their model time. No timing: speed needs the
target's verify cost per draft length, which `trtspec bench` measures.

Drafters (k = --k): ngram at the spec's n-gram sizes and k = 5 and --k; suffix with the
spec's suffix settings (or the defaults), requests kept apart, and with a cache of earlier
responses shared across each prompt set in order (what one deployment serving that set sees).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab._common import command_line, write_result
from trtspec.spec import SuffixSpec, load_spec, read_prompts
from trtspec.speculative.drafters import make_drafter, response_cache
from trtspec.speculative.loop import GenerationRequest, Verdict, generate


class RecordedTarget:
    """A verifier answering from recorded greedy outputs (prompt ids -> output + end id)."""

    def __init__(self, runs: list[dict]):
        self.runs = {tuple(r["prompt_ids"]): r for r in runs}

    def verify(self, contexts, drafts, want_logits=None, context_phase=None):
        out = []
        for ctx, draft in zip(contexts, drafts):
            run = next(r for n in range(len(ctx), 0, -1) if (r := self.runs.get(tuple(ctx[:n]))) is not None)
            after = run["output_ids"] + ([run["end"]] if run["end"] is not None else [])
            i, ids = len(ctx) - len(run["prompt_ids"]), []
            for j, tok in enumerate([*draft, None]):
                if i + j >= len(after):
                    raise ValueError("the loop asked past the recorded output; record more tokens")
                ids.append(after[i + j])
                if tok is None or tok != after[i + j]:
                    break
            out.append(Verdict(ids))
        return out


def record(loaded, prompts: list[str], max_tokens: int) -> list[dict]:
    from trtspec.runtime import Deployment

    dep = Deployment(loaded, loaded.output_dir())
    runs = []
    for p in prompts:
        ids = dep.encode(p)
        (res,) = dep.generate([dep.request(ids, max_tokens)], speculative=False)
        runs.append({"prompt_ids": ids, "output_ids": res.output_ids, "end": res.end_id, "finish": res.finish_reason})
    return runs


def replay(runs: list[dict], factory, k: int) -> dict:
    target, drafter = RecordedTarget(runs), factory()
    forwards = tokens = drafted = accepted = 0
    for r in runs:
        budget = len(r["output_ids"]) + (1 if r["finish"] == "eos" else 0)
        end = frozenset({r["end"]}) if r["end"] is not None else frozenset()
        (res,) = generate([GenerationRequest(r["prompt_ids"], budget, k, end)], drafter, target)
        if res.output_ids != r["output_ids"]:
            raise AssertionError("a replayed output differs from the recorded one")
        m = res.metrics
        forwards, tokens, drafted, accepted = (
            forwards + m.target_forwards,
            tokens + m.tokens,
            drafted + m.drafted,
            accepted + m.accepted,
        )
    return {
        "k": k,
        "tokens_per_forward": round(tokens / forwards, 3),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "drafted_per_forward": round(drafted / forwards, 3),
        "drafted": drafted,
        "accepted": accepted,
    }


def replay_arguments(description: str, max_tokens: int, k: int) -> argparse.ArgumentParser:
    """The arguments of every replay script: a spec, its prompt sets, tokens per prompt, k, --json."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("spec")
    ap.add_argument("--prompts", type=Path, action="append", required=True, help="JSONL prompt set (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--k", type=int, default=k)
    ap.add_argument("--json", type=Path, default=None)
    return ap


def main() -> int:
    ap = replay_arguments(__doc__.split("\n\n")[0], 128, 16)
    ap.add_argument(
        "--recorded", type=Path, default=None, help="JSON of recorded outputs per set: read if it exists, else written"
    )
    args = ap.parse_args()
    loaded = load_spec(args.spec)
    s = loaded.spec.speculative
    sx = s.suffix_drafting or SuffixSpec()
    apart = sx.model_copy(update={"cache_responses": 0})
    drafters = {
        "ngram k=5": (lambda: make_drafter("ngram", max_ngram=s.max_ngram, min_ngram=s.min_ngram), 5),
        f"ngram k={args.k}": (lambda: make_drafter("ngram", max_ngram=s.max_ngram, min_ngram=s.min_ngram), args.k),
        f"suffix k={args.k} (requests apart)": (lambda: make_drafter("suffix", suffix=apart), args.k),
        f"suffix k={args.k} (cache over the set)": (lambda: make_drafter("suffix", suffix=sx, cache=response_cache(sx)), args.k),
    }
    result = {"suffix": sx.model_dump(), "sets": {}}
    recorded = json.loads(args.recorded.read_text()) if args.recorded and args.recorded.exists() else {}
    for path in args.prompts:
        if path.stem not in recorded:
            recorded[path.stem] = record(loaded, read_prompts(path, "--prompts"), args.max_tokens)
            if args.recorded:
                args.recorded.write_text(json.dumps(recorded) + "\n")
        runs = recorded[path.stem]
        rows = {name: replay(runs, factory, k) for name, (factory, k) in drafters.items()}
        result["sets"][path.stem] = {
            "prompts": len(runs),
            "output_tokens": sum(len(r["output_ids"]) for r in runs),
            "drafters": rows,
        }
        for name, row in rows.items():
            print(
                f"{path.stem:16s} {name:34s} tokens/forward {row['tokens_per_forward']:.2f}  acceptance {row['acceptance_rate']:.3f}  drafted/forward {row['drafted_per_forward']:.2f}"
            )
    if args.json:
        write_result(args.json, command_line("acceptance_replay.py"), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
