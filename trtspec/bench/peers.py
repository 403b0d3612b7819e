"""Side by side with Hugging Face transformers: same pair, same prompts, same greedy run.

Paths (batch 1, greedy, the same prompt ids and max_tokens for all):
  ours_target          trtspec target-only (the loop with no drafter)
  ours_draft_target    trtspec with the spec's draft model, k = the spec's draft length
  ours_eagle3          trtspec with the spec's EAGLE-3 head (an eagle3 spec), same k
  ours_ngram           trtspec prompt lookup (NgramDrafter with the spec's n-gram sizes), same k
  hf_target            transformers generate(do_sample=False) on the target checkpoint
  hf_assisted          generate(assistant_model=draft) drafting exactly k tokens per step
                       (constant schedule, confidence early-stop off): the same rule as ours
  hf_assisted_default  generate(assistant_model=draft) with transformers' own defaults
  hf_prompt_lookup     generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=max_ngram)

Definitions:
  tokens      generated tokens, EOS excluded (the loop does not emit EOS; HF's EOS is cut)
  seconds     wall time of the generate call, prefill included; each trtspec run starts
              with an empty prefix cache, as every HF call does
  tokens/s    sum of tokens / sum of seconds over the prompts every path completed
              (with --repeats N, seconds is each (prompt, path)'s fastest of N runs)
  identical   prompts whose output ids equal ours_target's exactly

Every path warms up once (excluded), then prompts run one by one with all paths on each,
in an order rotated per prompt so machine noise hits all paths alike.
"""

from __future__ import annotations

import copy
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trtspec.errors import SpecError
from trtspec.runtime import Deployment
from trtspec.spec import read_prompt_rows
from trtspec.speculative.loop import generate
from trtspec.speculative.metrics import SpecMetrics

KINDS = ("chat", "code", "rewrite")
REFERENCE = "ours_target"


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str
    ids: list[int]


@dataclass
class Generation:
    output_ids: list[int]
    metrics: SpecMetrics | None = None  # trtspec speculative paths only


@dataclass
class PeerPath:
    key: str
    label: str
    run: Callable[[list[int], int], Generation]  # (prompt ids, max_tokens) -> output


@dataclass
class Run:
    """One path on one prompt."""

    tokens: int
    seconds: float
    identical: bool
    first_difference: int | None  # index of the first token that differs from ours_target
    metrics: SpecMetrics | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["metrics"] = self.metrics.to_dict() if self.metrics else None
        return d


@dataclass
class Measurement:
    paths: list[tuple[str, str]]  # (key, label), table order
    prompts: list[Prompt]
    max_tokens: int
    repeats: int = 1
    runs: list[dict[str, Run]] = field(default_factory=list)  # per completed prompt
    interrupted: bool = False
    setup: dict = field(default_factory=dict)
    # 1-minute load average after warm-up and after each prompt: other processes on the
    # machine show up here (this run itself accounts for about torch_threads of it).
    load: list[float] = field(default_factory=list)


# ---- prompts ---------------------------------------------------------------------------


def read_prompts(path: Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(text, kind) per JSONL line {"prompt": ..., "kind": "chat|code|rewrite"}."""
    rows = []
    for n, row in enumerate(read_prompt_rows(path, "--prompts"), start=1):
        if row.get("kind") not in KINDS:
            raise SpecError(f"{path}: prompt {n}: kind must be one of {', '.join(KINDS)} (got {row.get('kind')!r})")
        rows.append((row["prompt"], row["kind"]))
    if not rows:
        raise SpecError(f"{path} holds no prompts; add one JSON object per line")
    return rows[:limit] if limit else rows


def encode_prompts(dep: Deployment, rows: list[tuple[str, str]]) -> list[Prompt]:
    """Token ids once, through the spec's chat-template setting; every path gets these ids."""
    return [Prompt(text, kind, dep.encode(text)) for text, kind in rows]


# ---- paths -----------------------------------------------------------------------------


def trtspec_paths(dep: Deployment, other_draft: tuple[str, Callable, Callable[[], None]] | None = None) -> list[PeerPath]:
    """Our paths over the spec's target engine: target-only, the spec's own method (draft_target
    or eagle3), ``other_draft`` (method name, drafter factory, forget: another spec's draft
    loaded beside this target), and prompt lookup."""
    spec = dep.spec.speculative
    k = spec.default_draft_tokens
    forget_other = other_draft[2] if other_draft else (lambda: None)

    def run_with(drafter_factory):
        def run(ids: list[int], max_tokens: int) -> Generation:
            dep.forget_prefixes()  # HF recomputes the prefill on every call; so do we
            forget_other()
            req = dep.request(ids, max_tokens, k if drafter_factory else 0)
            if drafter_factory is None:
                (res,) = dep.generate([req], speculative=False)
                return Generation(res.output_ids)
            (res,) = generate([req], drafter_factory(), dep.verifier())
            return Generation(res.output_ids, res.metrics)

        return run

    paths = [PeerPath("ours_target", "trtspec target-only", run_with(None))]
    if spec.method in ("draft_target", "eagle3"):
        paths.append(PeerPath(f"ours_{spec.method}", f"trtspec {spec.method} k={k}", run_with(dep.drafter)))
    if other_draft is not None:
        name, factory, _ = other_draft
        paths.append(PeerPath(f"ours_{name}", f"trtspec {name} k={k}", run_with(factory)))
    # The same target engine with the prompt-lookup drafter a method: ngram spec would use.
    paths.append(
        PeerPath(
            "ours_ngram",
            f"trtspec ngram k={k}",
            run_with(lambda: dep.drafter("ngram")),
        )
    )
    return paths


def load_hf(folder: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.eval()


def hf_paths(dep: Deployment, assistant: tuple[Path, str] | None = None) -> tuple[list[PeerPath], dict]:
    """The transformers paths on the deployment's own checkpoints, and their settings.
    ``assistant`` (folder, dtype): the draft model for assisted generation when the spec has
    none of its own (an eagle3 spec: transformers cannot run EAGLE heads)."""
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate() warns about unused sampling flags per call
    spec = dep.spec.speculative
    k = spec.default_draft_tokens
    target = load_hf(dep.target.folder, dep.target.manifest.dtype)
    end_ids = sorted(dep.end_ids)
    pad = dep.tokenizer.pad_token_id if dep.tokenizer.pad_token_id is not None else end_ids[0]

    def run_with(**extra):
        def run(ids: list[int], max_tokens: int) -> Generation:
            input_ids = torch.tensor([ids], dtype=torch.long)
            with torch.inference_mode():
                out = target.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=end_ids,
                    pad_token_id=pad,
                    **extra,
                )
            return Generation(_cut_at_end(out[0, len(ids) :].tolist(), dep.end_ids))

        return run

    paths = [PeerPath("hf_target", "HF target-only", run_with())]
    settings: dict = {"prompt_lookup": {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": spec.max_ngram}}
    if dep.draft is not None:
        assistant = (dep.draft.folder, dep.draft.manifest.dtype)
    if assistant is not None:
        draft = load_hf(*assistant)
        # HF reads the drafting schedule from the assistant's generation_config.
        defaults = copy.deepcopy(draft.generation_config)
        same_rule = copy.deepcopy(defaults)
        same_rule.num_assistant_tokens = k
        same_rule.num_assistant_tokens_schedule = "constant"
        same_rule.assistant_confidence_threshold = 0.0  # off: always draft k, as ours does
        settings["assisted"] = _schedule(same_rule)
        settings["assisted_default"] = _schedule(defaults)

        def assisted(config):
            inner = run_with(assistant_model=draft)

            def run(ids: list[int], max_tokens: int) -> Generation:
                draft.generation_config = copy.deepcopy(config)
                return inner(ids, max_tokens)

            return run

        paths.append(PeerPath("hf_assisted", f"HF assisted k={k}", assisted(same_rule)))
        d = settings["assisted_default"]
        paths.append(
            PeerPath(
                "hf_assisted_default",
                f"HF assisted, HF defaults (up to {d['num_assistant_tokens']}, "
                f"{d['num_assistant_tokens_schedule']}, confidence {d['assistant_confidence_threshold']})",
                assisted(defaults),
            )
        )
    paths.append(
        PeerPath(
            "hf_prompt_lookup",
            f"HF prompt lookup k={k}",
            run_with(prompt_lookup_num_tokens=k, max_matching_ngram_size=spec.max_ngram),
        )
    )
    return paths, settings


def _schedule(config) -> dict:
    """The drafting schedule HF will use: the config's own values, else transformers'
    defaults (read through a private method, for this report only)."""
    fallback = getattr(config, "_get_default_generation_params", dict)()
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {key: v if (v := getattr(config, key, None)) is not None else fallback.get(key) for key in keys}


def _cut_at_end(ids: list[int], end_ids: frozenset[int]) -> list[int]:
    """Tokens before the first EOS-like id (the loop stops there without emitting it)."""
    for i, t in enumerate(ids):
        if t in end_ids:
            return ids[:i]
    return ids


def peer_paths(dep: Deployment, draft_from=None) -> tuple[list[PeerPath], dict]:
    """All paths in table order: ours first, then transformers'. ``draft_from`` (a LoadedSpec
    with the same target weights) adds its draft: our path with it, and transformers' assisted
    generation with it when this spec has no draft model of its own (an eagle3 spec)."""
    other, assistant = None, None
    if draft_from is not None:
        from trtspec.bench.methods import other_drafter
        from trtspec.engines.manifest import read_manifest
        from trtspec.layout import engine_folder

        factory, forget = other_drafter(dep, draft_from)
        other = (draft_from.spec.speculative.method, factory, forget)
        folder = engine_folder(draft_from.output_dir(), "draft")
        if draft_from.spec.speculative.method == "draft_target" and dep.draft is None:
            assistant = (folder, read_manifest(folder).dtype)
    hf, settings = hf_paths(dep, assistant)
    return trtspec_paths(dep, other) + hf, settings


# ---- measuring -------------------------------------------------------------------------


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(
    paths: list[PeerPath],
    prompts: list[Prompt],
    max_tokens: int,
    repeats: int = 1,
    progress: Callable[[str], None] = lambda _: None,
    clock: Callable[[], float] = time.perf_counter,
    load: Callable[[], float] = lambda: os.getloadavg()[0],
) -> Measurement:
    """Warm up every path, then run all paths on each prompt in a rotated order.

    With repeats > 1 each (prompt, path) keeps its fastest time: noise from other processes
    only ever adds time. Ctrl-C stops the run and returns the prompts every path completed
    (interrupted=True).
    """
    if paths[0].key != REFERENCE:
        raise ValueError(f"the first path must be {REFERENCE}, the reference for identity")
    result = Measurement([(p.key, p.label) for p in paths], prompts, max_tokens, repeats)
    try:
        for p in paths:
            progress(f"warm-up: {p.label}")
            p.run(prompts[0].ids, max_tokens)
        result.load.append(load())
        for i, prompt in enumerate(prompts):
            outputs: dict[str, Generation] = {}
            seconds: dict[str, float] = {}
            for rep in range(repeats):
                r = (i + rep) % len(paths)
                for p in paths[r:] + paths[:r]:
                    start = clock()
                    outputs[p.key] = p.run(prompt.ids, max_tokens)  # greedy: the same each time
                    seconds[p.key] = min(seconds.get(p.key, float("inf")), clock() - start)
            reference = outputs[REFERENCE].output_ids
            runs = {}
            for key, gen in outputs.items():
                diff = first_difference(gen.output_ids, reference)
                runs[key] = Run(len(gen.output_ids), seconds[key], diff is None, diff, gen.metrics)
            result.runs.append(runs)
            result.load.append(load())
            same = sum(run.identical for run in runs.values()) - 1
            times = ", ".join(f"{p.key} {runs[p.key].seconds:.1f}s" for p in paths)
            progress(
                f"prompt {i + 1}/{len(prompts)} ({prompt.kind}): {len(reference)} tokens, "
                f"{same}/{len(paths) - 1} paths identical to {REFERENCE}; {times}"
            )
    except KeyboardInterrupt:
        result.interrupted = True
        progress(f"interrupted: keeping the {len(result.runs)} prompt(s) every path completed")
    return result


# ---- summary and table -----------------------------------------------------------------


@dataclass
class PathSummary:
    key: str
    label: str
    tokens: int
    seconds: float
    tokens_per_s: float
    identical: int
    per_kind: dict[str, float]  # kind -> tokens/s
    metrics: dict | None  # merged SpecMetrics (trtspec speculative paths)


def summarise(m: Measurement) -> list[PathSummary]:
    out = []
    kinds = [p.kind for p in m.prompts[: len(m.runs)]]
    for key, label in m.paths:
        runs = [r[key] for r in m.runs]
        tokens = sum(r.tokens for r in runs)
        seconds = sum(r.seconds for r in runs)
        per_kind = {}
        for kind in KINDS:
            sel = [r for r, k in zip(runs, kinds) if k == kind]
            secs = sum(r.seconds for r in sel)
            if sel and secs > 0:
                per_kind[kind] = sum(r.tokens for r in sel) / secs
        metrics = None
        if runs and runs[0].metrics is not None:
            merged = SpecMetrics()
            for r in runs:
                merged = merged.merge(r.metrics)
            metrics = merged.to_dict()
        out.append(
            PathSummary(
                key,
                label,
                tokens,
                seconds,
                tokens / seconds if seconds else 0.0,
                sum(r.identical for r in runs),
                per_kind,
                metrics,
            )
        )
    return out


# Head-to-head ratios reported under the table: (ours, theirs, goal or None).
COMPARISONS = [
    ("ours_draft_target", "hf_assisted", 1.2),
    ("ours_draft_target", "hf_assisted_default", 1.2),
    ("ours_eagle3", "hf_assisted", 1.0),  # the co-designed head ahead of HF's best path (issue 9)
    ("ours_eagle3", "hf_assisted_default", 1.0),
    ("ours_eagle3", "ours_draft_target", 1.15),
    ("ours_ngram", "hf_prompt_lookup", None),
    ("ours_target", "hf_target", None),
]


def ratio(summaries: list[PathSummary], a: str, b: str) -> float | None:
    by = {s.key: s for s in summaries}
    if a not in by or b not in by or not by[b].tokens_per_s:
        return None
    return by[a].tokens_per_s / by[b].tokens_per_s


def render_markdown(m: Measurement, summaries: list[PathSummary]) -> str:
    n = len(m.runs)
    scope = f"{n} of {len(m.prompts)} prompts" + (" (interrupted)" if m.interrupted else "")
    timing = f", fastest of {m.repeats} runs per prompt and path" if m.repeats > 1 else ""
    get = m.setup.get
    run = f"{scope}, max_tokens {m.max_tokens}, greedy, batch 1, warm-up excluded, paths interleaved per prompt"
    where = f"Machine: {get('machine', '?')}; torch threads {get('torch_threads', '?')}"
    versions = f"torch {get('torch', '?')}, transformers {get('transformers', '?')}"
    lines = [
        f"# trtspec vs Hugging Face transformers: {get('spec', '?')}",
        "",
        f"{run}{timing}.",
        f"{where}; {versions}.",
        _load_line(m),
        "",
    ]
    if n == 0:
        return "\n".join(lines + ["Nothing measured: no prompt was completed by every path."]) + "\n"
    lines += [
        (
            "| path | tokens | seconds | tokens/s | vs trtspec target-only | vs HF target-only "
            "| identical to trtspec target-only | mean accepted length |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        vs_ours = ratio(summaries, s.key, "ours_target")
        vs_hf = ratio(summaries, s.key, "hf_target")
        same = "reference" if s.key == REFERENCE else f"{s.identical}/{n}"
        mal = f"{s.metrics['mean_acceptance_length']:.2f}" if s.metrics else ""
        lines.append(
            f"| {s.label} | {s.tokens} | {s.seconds:.2f} | {s.tokens_per_s:.1f} | {_x(vs_ours)} | {_x(vs_hf)} | {same} | {mal} |"
        )
    lines += ["", "Tokens/s by prompt kind:", ""]
    kinds = [k for k in KINDS if any(k in s.per_kind for s in summaries)]
    lines.append("| path | " + " | ".join(f"{k} ({sum(p.kind == k for p in m.prompts[:n])})" for k in kinds) + " |")
    lines.append("|---|" + "---:|" * len(kinds))
    for s in summaries:
        lines.append(f"| {s.label} | " + " | ".join(f"{s.per_kind.get(k, 0):.1f}" for k in kinds) + " |")
    lines += ["", "Head to head (tokens/s ratio):", ""]
    labels = dict(m.paths)
    for ours, theirs, goal in COMPARISONS:
        r = ratio(summaries, ours, theirs)
        if r is None:
            continue
        verdict = "" if goal is None else f" (goal >= {goal}: {'met' if r >= goal else 'missed'})"
        lines.append(f"- {labels[ours]} / {labels[theirs]}: {r:.2f}x{verdict}")
    return "\n".join(lines) + "\n"


def _load_line(m: Measurement) -> str:
    if not m.load:
        return ""
    cpus = os.cpu_count() or 1
    typical = sorted(m.load)[len(m.load) // 2]
    line = f"Load average (1 min) during the run: median {typical:.1f}, max {max(m.load):.1f} on {cpus} CPUs."
    # This run alone keeps about torch_threads threads busy (the CPU count by default); a
    # typical load well beyond the CPU count means other processes competed all along.
    if typical > cpus + 0.5:
        line += " **Other processes competed for the CPU: rerun on a quiet machine.**"
    return line


def _x(r: float | None) -> str:
    return "" if r is None else f"{r:.2f}x"


def to_json(m: Measurement, summaries: list[PathSummary]) -> dict:
    return {
        "setup": m.setup,
        "max_tokens": m.max_tokens,
        "repeats": m.repeats,
        "interrupted": m.interrupted,
        "load_average": m.load,
        "paths": [asdict(s) for s in summaries],
        "comparisons": {f"{a}/{b}": ratio(summaries, a, b) for a, b, _ in COMPARISONS if ratio(summaries, a, b) is not None},
        "prompts": [
            {"prompt": p.text, "kind": p.kind, "prompt_tokens": len(p.ids), "runs": {k: r.to_dict() for k, r in runs.items()}}
            for p, runs in zip(m.prompts, m.runs)
        ],
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {platform.system()} {platform.release()}"


def describe_setup(dep: Deployment, settings: dict) -> dict:
    import transformers

    return {
        "spec": dep.spec.name,
        "spec_path": str(dep.loaded.path),
        "num_draft_tokens": dep.spec.speculative.default_draft_tokens,
        "max_ngram": dep.spec.speculative.max_ngram,
        "target_dtype": dep.target.manifest.dtype,
        "draft_dtype": dep.draft.manifest.dtype if dep.draft else None,
        "hf": settings,
        "machine": machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
