"""Method auto and the fixed methods replayed offline: modelled tokens/s from counted steps, no timing.

    .venv/bin/python -m lab.auto_replay engine_specs/smollm2-135m-cpu.yaml \
        --prompts lab/auto_chat_prompts.jsonl --prompts lab/auto_repeat_prompts.jsonl \
        --prompts lab/auto_mixed_prompts.jsonl --max-tokens 64 --k 5 \
        --costs lab/results/auto-three-sets-epyc.json --recorded /tmp/auto-replay-recorded.json \
        --json lab/results/auto-replay.json

Greedy speculative output is token-identical to target-only output, so the target's answer to
any draft is known once its target-only output is (lab/acceptance_replay.py). This script
records target-only once per prompt (the only target calls), then runs each method through the
one loop (speculative.loop.generate) as `trtspec bench --methods draft_target,suffix,ngram,auto`
does: prompt after prompt, a fresh drafter per request, suffix with requests kept apart, ONE
auto policy for every request of every set in the order given. The target's verdicts come from
the recordings; the draft_target drafter is the spec's real draft model (its greedy drafts,
memoised per context so repeated replays do not recompute them).

Time is modelled, not measured: a clock advances by the costs of ``--costs`` (a bench result
file's `costs`, in target steps T = costs.target_step seconds) for every call the loop makes:

  a target forward scoring k drafts   verify_by_k[k] x T (k = 0: T; --verify flat: T for every k)
  a sequence's first forward          the prefill, ttft_p50 / target_step of the file's target x T
  one draft model step                c x T (costs.cost_ratio, or --c); n-gram and suffix: 0

and method auto's policy reads that clock, so it learns exactly the costs it is scored with.
``--synthetic-draft A`` replaces the draft model with one right at each position with
probability A (no model runs: seconds instead of the real draft's minutes, for comparing policy
changes; its misses are independent, the real draft's are not). ``--methods auto`` replays
target-only and auto alone (the fixed methods do not change with the policy).
Modelled tokens/s = output tokens / modelled seconds. Every replayed output is checked against
the recorded one.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from lab._common import command_line, write_result
from lab.acceptance_replay import record, replay_arguments
from trtspec.spec import FREE_METHODS, SuffixSpec, load_spec, read_prompts
from trtspec.speculative.adaptive import AdaptivePolicy, AdaptiveSettings
from trtspec.speculative.capabilities import Drafter
from trtspec.speculative.drafters import make_drafter
from trtspec.speculative.loop import GenerationRequest, NoDrafter, Verdict, generate
from trtspec.speculative.menus import make_menu

METHODS = ("draft_target", "suffix", "ngram")  # bench's auto over a draft_target spec chooses among these
NAMES = ("target-only", *METHODS, "auto")  # what is replayed (--methods; target-only: the base of every speedup)


@dataclass(frozen=True)
class Costs:
    """Modelled costs in target steps; ``target_step`` seconds each."""

    target_step: float
    c: float
    prefill: float
    verify_by_k: dict[int, float]

    def verify(self, k: int) -> float:
        if k == 0:
            return 1.0
        known = sorted(self.verify_by_k)
        return self.verify_by_k[min(k, known[-1])] if known else 1.0

    @classmethod
    def from_bench(cls, path: Path, c: float | None, flat: bool) -> Costs:
        values = json.loads(path.read_text())["values"]
        costs = values["costs"]
        by_k = {} if flat else {int(k): float(v) for k, v in (costs.get("verify_by_k") or {}).items()}
        prefill = values["target"]["ttft_p50"] / costs["target_step"]
        return cls(costs["target_step"], costs["cost_ratio"] if c is None else c, prefill, by_k)


class ModelClock:
    """Modelled seconds; the loop's and the policy's clock."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Counts:
    """What one method's replay cost: target forwards by drafts scored, draft model steps."""

    verify_widths: Counter = field(default_factory=Counter)
    prefills: int = 0
    draft_steps: int = 0


class ModelledTarget:
    """Answers from recorded greedy outputs (prompt ids -> output + end id) and advances the clock
    by what the forward would cost."""

    def __init__(self, runs: list[dict], costs: Costs, clock: ModelClock, counts: Counts):
        self.runs = {tuple(r["prompt_ids"]): r for r in runs}
        self.costs, self.clock, self.counts = costs, clock, counts

    def verify(self, contexts, drafts, want_logits=None, context_phase=None) -> list[Verdict]:
        if context_phase and any(context_phase):
            self.counts.prefills += 1
            self.clock.now += self.costs.prefill * self.costs.target_step
        else:
            k = max(len(d) for d in drafts)
            self.counts.verify_widths[k] += 1
            self.clock.now += self.costs.verify(k) * self.costs.target_step
        return [self._verdict(ctx, draft) for ctx, draft in zip(contexts, drafts)]

    def _verdict(self, ctx, draft) -> Verdict:
        run, after = _recorded(self.runs, ctx)
        i, ids = len(ctx) - len(run["prompt_ids"]), []
        for j, tok in enumerate([*draft, None]):
            if i + j >= len(after):
                if run["end"] is None:
                    raise ValueError("the loop asked past the recorded output; record more tokens")
                ids.append(run["end"])  # past an EOS: never emitted
                break
            ids.append(after[i + j])
            if tok is None or tok != after[i + j]:
                break
        return Verdict(ids)


def _recorded(runs: dict[tuple, dict], ctx) -> tuple[dict, list[int]]:
    """The recorded run whose prompt ``ctx`` continues, and its tokens after the prompt (the end id last)."""
    run = next(r for n in range(len(ctx), 0, -1) if (r := runs.get(tuple(ctx[:n]))) is not None)
    return run, run["output_ids"] + ([run["end"]] if run["end"] is not None else [])


class SyntheticDraft(Drafter):
    """--synthetic-draft A: a stand-in for the draft model that drafts the target's recorded token
    at each position with probability A (drawn once per prompt and position, so every replay
    sees the same draft) and another token otherwise: no model runs, for a quick comparison."""

    def __init__(self, runs: list[dict], rate: float):
        self.runs, self.rate = {tuple(r["prompt_ids"]): r for r in runs}, rate

    def propose(self, contexts, draft_lens) -> list[list[int]]:
        out = []
        for ctx, k in zip(contexts, draft_lens):
            run, after = _recorded(self.runs, ctx)
            start, key = len(ctx) - len(run["prompt_ids"]), _key(run["prompt_ids"])
            true = [after[p] if p < len(after) else 0 for p in range(start, start + k)]
            hits = [random.Random(f"{key}:{p}").random() < self.rate for p in range(start, start + k)]
            out.append([t if hit else t + 1 for t, hit in zip(true, hits)])
        return out


class MemoDraft(Drafter):
    """The draft model's greedy drafts, memoised per context; each call costs max(k) draft steps
    on the modelled clock, as the real drafter's k forwards would."""

    def __init__(self, model: Drafter, memo: dict[str, list[int]], costs: Costs, clock: ModelClock, counts: Counts):
        self.model, self.memo, self.costs, self.clock, self.counts = model, memo, costs, clock, counts

    def propose(self, contexts, draft_lens) -> list[list[int]]:
        keys = [_key(ctx) for ctx in contexts]
        todo = [j for j, (key, k) in enumerate(zip(keys, draft_lens)) if len(self.memo.get(key, ())) < k]
        if todo:
            for j, d in zip(todo, self.model.propose([contexts[j] for j in todo], [draft_lens[j] for j in todo])):
                self.memo[keys[j]] = list(d)
        steps = max(draft_lens, default=0)
        self.counts.draft_steps += steps
        self.clock.now += steps * self.costs.c * self.costs.target_step
        return [self.memo[key][:k] for key, k in zip(keys, draft_lens)]


def _key(ctx) -> str:
    return hashlib.sha1(json.dumps(list(ctx)).encode()).hexdigest()


def replay_method(name: str, runs: list[dict], make, k: int, costs: Costs, clock: ModelClock) -> dict:
    """Every recorded request through the one loop with a fresh drafter from ``make(counts)``."""
    counts, start = Counts(), clock.now
    target, tokens, choices = ModelledTarget(runs, costs, clock, counts), 0, Counter()
    for r in runs:
        end = frozenset({r["end"]}) if r["end"] is not None else frozenset()
        (res,) = generate([GenerationRequest(r["prompt_ids"], r["max_tokens"], k, end)], make(counts), target)
        if res.output_ids != r["output_ids"]:
            raise AssertionError(f"{name}: a replayed output differs from the recorded one")
        tokens += len(res.output_ids)
        choices.update(res.metrics.choices)
    seconds = clock.now - start
    row = {
        "tokens": tokens,
        "modelled_seconds": round(seconds, 4),
        "modelled_tokens_per_s": round(tokens / seconds, 2),
        "target_forwards": counts.prefills + sum(counts.verify_widths.values()),
        "verify_widths": {str(w + 1): n for w, n in sorted(counts.verify_widths.items())},
        "draft_steps": counts.draft_steps,
    }
    return row | ({"choices": dict(sorted(choices.items()))} if choices else {})


def factories(model: Drafter, spec, k: int, costs: Costs, clock: ModelClock, memo: dict, policy: AdaptivePolicy):
    """Method name -> (make(counts) -> a fresh drafter, k), as bench's method_set builds them;
    ``model``: the draft model's greedy drafter."""
    s = spec.speculative
    ngram = dict(max_ngram=s.max_ngram, min_ngram=s.min_ngram)
    sx = s.suffix_drafting or SuffixSpec()
    return {
        "target-only": (lambda counts: NoDrafter(), 0),
        f"draft_target k={k}": (lambda counts: MemoDraft(model, memo, costs, clock, counts), k),
        f"suffix k={k}": (lambda counts: make_drafter("suffix", suffix=sx), k),
        f"ngram k={k}": (lambda counts: make_drafter("ngram", **ngram), k),
        f"auto k<={k}": (
            lambda counts: make_menu(
                "auto", policy, draft_model=MemoDraft(model, memo, costs, clock, counts), suffix=sx, **ngram
            ),
            k,
        ),
    }


def summarise(rows: dict[str, dict]) -> None:
    """Speedup over target-only and, for auto, the ratio to the best fixed method."""
    base = rows["target-only"]["modelled_tokens_per_s"]
    fixed = [r["modelled_tokens_per_s"] for n, r in rows.items() if n != "target-only" and not n.startswith("auto")]
    for name, row in rows.items():
        row["speedup"] = round(row["modelled_tokens_per_s"] / base, 3)
        if name.startswith("auto") and fixed:
            row["of_best_fixed"] = round(row["modelled_tokens_per_s"] / max(fixed), 3)


def main() -> int:
    ap = replay_arguments(__doc__.split("\n\n")[0], 64, 5)
    ap.add_argument("--costs", type=Path, required=True, help="a `trtspec bench` result file whose costs the model uses")
    ap.add_argument("--c", type=float, default=None, help="draft step / target step (default: the file's cost_ratio)")
    ap.add_argument("--verify", choices=("measured", "flat"), default="measured", help="verify cost by k: the file's, or T")
    ap.add_argument(
        "--methods",
        type=lambda v: v.split(","),
        default=list(NAMES),
        help="a subset of " + ",".join(NAMES) + " (target-only always)",
    )
    ap.add_argument("--synthetic-draft", type=float, default=None, help="A: no draft model, a draft right with probability A")
    ap.add_argument("--recorded", type=Path, default=None, help="JSON of recorded outputs and drafts: read if it exists")
    args = ap.parse_args()
    from trtspec.runtime import Deployment

    loaded = load_spec(args.spec)
    costs = Costs.from_bench(args.costs, args.c, args.verify == "flat")
    cache = json.loads(args.recorded.read_text()) if args.recorded and args.recorded.exists() else {}
    sets, memo = cache.setdefault("sets", {}), cache.setdefault("drafts", {})
    known = cache.setdefault("prompts", {})  # prompt text -> its recorded run (a mixed set reuses its parts')
    for path in args.prompts:
        prompts = read_prompts(path, "--prompts")
        new = [p for p in dict.fromkeys(prompts) if p not in known]
        if new:
            for p, r in zip(new, record(loaded, new, args.max_tokens)):
                known[p] = r | {"max_tokens": args.max_tokens}
            if args.recorded:  # kept at once: recording is the slow part
                args.recorded.write_text(json.dumps(cache) + "\n")
        sets[path.stem] = [known[p] for p in prompts]
    if args.synthetic_draft is None:
        from trtspec.speculative.drafters import engine_drafter

        dep = Deployment(loaded, loaded.output_dir())
        model = engine_drafter(dep.target, dep.draft, None, "own")
    else:
        model, memo = SyntheticDraft(list(known.values()), args.synthetic_draft), {}
    clock = ModelClock()
    free = frozenset(m for m in METHODS if m in FREE_METHODS)
    policy = AdaptivePolicy(AdaptiveSettings(METHODS, free, args.k), clock=clock)  # one for every set, as bench's
    made = {
        n: f
        for n, f in factories(model, loaded.spec, args.k, costs, clock, memo, policy).items()
        if n.split()[0] in (*args.methods, "target-only")
    }
    result = {"costs": costs.__dict__, "sets": {}}
    for path in args.prompts:
        runs = sets[path.stem]
        rows = {}
        for name, (make, k) in made.items():
            rows[name] = replay_method(name, runs, make, k, costs, clock)
            if args.recorded:  # the drafts so far
                args.recorded.write_text(json.dumps(cache) + "\n")
        summarise(rows)
        result["sets"][path.stem] = {"prompts": len(runs), "methods": rows}
        for name, row in rows.items():
            extra = f"  {row['of_best_fixed']:.3f}x best fixed" if "of_best_fixed" in row else ""
            print(
                f"{path.stem:22s} {name:16s} {row['modelled_tokens_per_s']:7.2f} tok/s  {row['speedup']:.3f}x{extra}", flush=True
            )
    if args.json:
        write_result(args.json, command_line("auto_replay.py"), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
