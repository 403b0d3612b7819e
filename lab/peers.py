"""Side by side with Hugging Face transformers and vLLM: same pair, same prompts, same greedy run.

Paths (greedy, the same prompt ids and max_tokens for all):
  ours_target          trtspec target-only (the loop with no drafter)
  ours_draft_target    trtspec with the spec's draft model, k = the spec's draft length
  ours_eagle3          trtspec with the spec's EAGLE-3 head (an eagle3 spec), same k
  ours_ngram           trtspec prompt lookup (NgramDrafter with the spec's n-gram sizes), same k
  ours_suffix          trtspec suffix decoding (a suffix spec: its settings, requests kept apart), same k
  hf_target            transformers generate(do_sample=False) on the target checkpoint
  hf_assisted          generate(assistant_model=draft) drafting exactly k tokens per step
                       (constant schedule, confidence early-stop off): the same rule as ours
  hf_assisted_default  generate(assistant_model=draft) with transformers' own defaults
  hf_prompt_lookup     generate(prompt_lookup_num_tokens=k, max_matching_ngram_size=max_ngram)
  vllm_target          vLLM's CPU build (its own environment, trtspec/testing/vllm_peer.py as a subprocess
                       speaking JSON) on the spec's target engine folder, dtype = the target's
  vllm_eagle3          vLLM with the spec's EAGLE-3 head folder (method eagle3), k drafts
  vllm_draft_target    vLLM with the spec's draft engine folder (or --draft-from's; method
                       draft_model), k drafts; vLLM runs the draft in the target's dtype
  vllm_ngram           vLLM prompt lookup (method ngram, prompt_lookup_min/max = the spec's
                       min_ngram/max_ngram), k drafts
  vllm_suffix          vLLM suffix decoding (a suffix spec: method suffix, suffix_decoding_* from
                       speculative.suffix; needs Arctic Inference in vLLM's environment), k drafts
  vLLM paths run with prefix caching off (each call prefills, as ours and HF's do), vLLM's own
  thread setup (vllm_env) and the spec's end ids as stop ids.

Concurrency c: the prompts in consecutive groups of c, each group sent at once (our loop batches
them; vLLM gets them in one generate call). HF paths run at concurrency 1 only. A group's wall
time is shared equally by its prompts, so tokens/s over all prompts is exact and tokens/s by
prompt kind is approximate at c > 1.

Definitions:
  tokens      generated tokens, EOS excluded (the loop does not emit EOS; HF's EOS is cut)
  seconds     wall time of the generate call, prefill included; each trtspec run starts
              with an empty prefix cache, as every HF call does
  tokens/s    sum of tokens / sum of seconds over the prompts every path completed
              (with --repeats N, seconds is each (prompt, path)'s fastest of N runs)
  identical   prompts whose output ids equal ours_target's (same concurrency) exactly
  vLLM acceptance: vLLM's own counters (vllm:spec_decode_*) over each call: drafted =
              num_draft_tokens, accepted = num_accepted_tokens, accepted per position. vLLM
              drafts k at the last step too and counts what it accepts there even where
              max_tokens then cuts it (our loop drafts only what the budget can use). Its
              counters see only the steps that drafted, not every target forward, so its mean
              accepted length is left blank. At c > 1 a group's counts are booked on its first
              prompt.

Every path warms up once (excluded), then prompts run one by one with all paths on each,
in an order rotated per prompt so machine noise hits all paths alike.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trtspec import machine
from trtspec.errors import SpecError
from trtspec.runtime import Deployment
from trtspec.spec import read_prompt_rows
from trtspec.speculative.loop import generate
from trtspec.speculative.metrics import SpecMetrics
from trtspec.testing.vllm_worker import VllmWorker, vllm_env

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
    # (a group of prompts' ids, max_tokens) -> their outputs, all sent at once; None: the path
    # runs one request at a time only (measured at concurrency 1)
    run_batch: Callable[[list[list[int]], int], list[Generation]] | None = None


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
    concurrency: int = 1
    runs: list[dict[str, Run]] = field(default_factory=list)  # per completed prompt
    interrupted: bool = False
    setup: dict = field(default_factory=dict)
    # 1-minute load average after warm-up and after each prompt: other processes on the
    # machine show up here (this run itself accounts for about torch_threads of it).
    load: list[float] = field(default_factory=list)


# ---- prompts ---------------------------------------------------------------------------


def read_kinded_prompts(path: Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(text, kind) per JSONL line {"prompt": ..., "kind": "chat|code|rewrite"} (spec.read_prompt_rows)."""
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
    """Our paths over the spec's target engine: target-only, the spec's own method (draft_target,
    eagle3 or suffix), ``other_draft`` (method name, drafter factory, forget: another spec's
    draft loaded beside this target), and prompt lookup."""
    spec = dep.spec.speculative
    k = dep.limits.default_draft_tokens  # what our requests draft when they ask for no k
    forget_other = other_draft[2] if other_draft else (lambda: None)

    def run_with(drafter_factory):
        def run_batch(prompts: list[list[int]], max_tokens: int) -> list[Generation]:
            dep.forget_prefixes()  # HF recomputes the prefill on every call; so do we
            forget_other()
            reqs = [dep.request(ids, max_tokens, k if drafter_factory else 0) for ids in prompts]
            if drafter_factory is None:
                return [Generation(res.output_ids) for res in dep.generate(reqs, speculative=False)]
            return [Generation(res.output_ids, res.metrics) for res in generate(reqs, drafter_factory(), dep.verifier())]

        def run(ids: list[int], max_tokens: int) -> Generation:
            return run_batch([ids], max_tokens)[0]

        return run, run_batch

    paths = [PeerPath("ours_target", "trtspec target-only", *run_with(None))]
    if spec.method in ("draft_target", "eagle3"):
        paths.append(PeerPath(f"ours_{spec.method}", f"trtspec {spec.method} k={k}", *run_with(dep.drafter)))
    if spec.method == "suffix":  # beside vLLM's suffix path; requests kept apart, as bench --methods
        paths.append(
            PeerPath("ours_suffix", f"trtspec suffix k={k}", *run_with(lambda: dep.drafter("suffix", spec.suffix_drafting)))
        )
    if other_draft is not None:
        name, factory, _ = other_draft
        paths.append(PeerPath(f"ours_{name}", f"trtspec {name} k={k}", *run_with(factory)))
    # The same target engine with the prompt-lookup drafter a method: ngram spec would use.
    paths.append(
        PeerPath(
            "ours_ngram",
            f"trtspec ngram k={k}",
            *run_with(lambda: dep.drafter("ngram")),
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
    k = dep.limits.default_draft_tokens  # what our requests draft when they ask for no k
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


# ---- vLLM: its own environment, a subprocess speaking JSON ------------------------------


def vllm_metrics(spec: dict, k: int) -> SpecMetrics:
    """vLLM's counters over one call as our SpecMetrics (definitions at the top of this file):
    drafted and accepted, per position when every draft was k long; no target forwards (its
    counters see only the steps that drafted), so no mean accepted length."""
    m = SpecMetrics(drafted=spec["num_draft_tokens"], accepted=spec["num_accepted_tokens"])
    if spec["num_drafts"] and spec["num_draft_tokens"] == spec["num_drafts"] * k:
        m.drafted_at = [spec["num_drafts"]] * k
        m.accepted_at = list(spec["accepted_per_pos"])
    return m


def vllm_paths(
    dep: Deployment,
    python: Path,
    script: Path,
    log: Path,
    draft_from=None,
    kv_cache_gib: int = 1,
    max_num_seqs: int = 4,
    progress: Callable[[str], None] = lambda _: None,
    only: frozenset[str] | None = None,
) -> tuple[list[PeerPath], dict, Callable[[], None]]:
    """vLLM's paths over our engine folders: target-only, the spec's eagle3 head, a draft model
    (the spec's, else ``draft_from``'s), prompt lookup (``only``: these keys alone, none other
    started). One worker process per path, loaded one after another. Returns the paths, their
    settings and a function that stops the workers."""
    from trtspec.layout import engine_folder

    spec = dep.spec.speculative
    k = dep.limits.default_draft_tokens  # what our requests draft when they ask for no k
    env = vllm_env(kv_cache_gib)
    stop_ids = sorted(dep.end_ids)
    base = {
        "model": str(dep.target.folder),
        "dtype": dep.target.manifest.dtype,
        "max_model_len": dep.spec.build.max_seq_len,
        "max_num_seqs": max_num_seqs,
        "enable_prefix_caching": False,
    }
    configs: list[tuple[str, str, dict | None]] = [("vllm_target", "vLLM target-only", None)]
    if spec.method == "eagle3":
        head = engine_folder(dep.loaded.output_dir(), "draft")
        configs.append(("vllm_eagle3", f"vLLM eagle3 k={k}", {"method": "eagle3", "model": str(head)}))
    draft_folder = None
    if dep.draft is not None:
        draft_folder = dep.draft.folder
    elif draft_from is not None and draft_from.spec.speculative.method == "draft_target":
        draft_folder = engine_folder(draft_from.output_dir(), "draft")
    if draft_folder is not None:
        configs.append(("vllm_draft_target", f"vLLM draft_target k={k}", {"method": "draft_model", "model": str(draft_folder)}))
    configs.append(
        (
            "vllm_ngram",
            f"vLLM ngram k={k}",
            {"method": "ngram", "prompt_lookup_min": spec.min_ngram, "prompt_lookup_max": spec.max_ngram},
        )
    )
    if spec.method == "suffix":  # needs Arctic Inference in vLLM's environment
        configs.append(("vllm_suffix", f"vLLM suffix k={k}", vllm_suffix(spec.suffix_drafting)))
    if only is not None:
        configs = [c for c in configs if c[0] in only]
    workers: list[VllmWorker] = []

    def close() -> None:
        for w in workers:
            w.close()

    paths, settings = [], {"env": {"VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"]}, "paths": {}}
    try:
        for key, label, speculative in configs:
            load = base | {"speculative": speculative and speculative | {"num_speculative_tokens": k}}
            progress(f"loading {label} (vLLM, its own process; the first load compiles for minutes)")
            worker = VllmWorker(python, script, load, env, log)
            workers.append(worker)
            settings["paths"][key] = {k_: v for k_, v in load.items() if k_ != "model"} | {"model": load["model"]}
            settings["vllm"], settings["vllm_torch"] = worker.info["vllm"], worker.info["torch"]
            paths.append(PeerPath(key, label, *_vllm_run(worker, stop_ids, dep.end_ids, k if speculative else None)))
    except BaseException:
        close()
        raise
    return paths, settings, close


def vllm_suffix(sx) -> dict:
    """vLLM's speculative config for suffix decoding (spec.SuffixSpec -> SpeculativeConfig's
    suffix_decoding_* fields, tests/vllm_fields.py). vLLM bounds its cache in requests only;
    cache_tokens has no counterpart there."""
    return {
        "method": "suffix",
        "suffix_decoding_max_tree_depth": sx.max_depth,
        "suffix_decoding_max_cached_requests": sx.cache_responses,
        "suffix_decoding_max_spec_factor": sx.spec_factor,
        "suffix_decoding_min_token_prob": sx.min_token_prob,
    }


def _vllm_run(worker: VllmWorker, stop_ids: list[int], end_ids: frozenset[int], k: int | None):
    def run_batch(prompts: list[list[int]], max_tokens: int) -> list[Generation]:
        answer = worker.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "stop_token_ids": stop_ids})
        outputs = answer["outputs"]
        gens = [Generation(_cut_at_end(ids, end_ids)) for ids in outputs]  # vLLM returns its EOS id
        if k is not None:
            for g in gens:
                g.metrics = SpecMetrics()
            gens[0].metrics = vllm_metrics(answer["spec"], k)
        return gens

    def run(ids: list[int], max_tokens: int) -> Generation:
        return run_batch([ids], max_tokens)[0]

    return run, run_batch


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
    concurrency: int = 1,
) -> Measurement:
    """Warm up every path, then run all paths on each prompt (each group of ``concurrency``
    prompts, sent at once) in a rotated order.

    At concurrency > 1 only paths with ``run_batch`` run. With repeats > 1 each (group, path)
    keeps its fastest time: noise from other processes only ever adds time. Ctrl-C stops the
    run and returns the prompts every path completed (interrupted=True).
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1 (got {concurrency})")
    if concurrency > 1:
        paths = [p for p in paths if p.run_batch is not None]
    if not paths or paths[0].key != REFERENCE:
        raise ValueError(f"the first path must be {REFERENCE}, the reference for identity")
    result = Measurement([(p.key, p.label) for p in paths], prompts, max_tokens, repeats, concurrency)

    def call(p: PeerPath, group: list[Prompt]) -> list[Generation]:
        if concurrency == 1:
            return [p.run(group[0].ids, max_tokens)]
        return p.run_batch([q.ids for q in group], max_tokens)

    groups = [prompts[i : i + concurrency] for i in range(0, len(prompts), concurrency)]
    try:
        for p in paths:
            progress(f"warm-up: {p.label}")
            call(p, groups[0])
        result.load.append(load())
        done = 0
        for g, group in enumerate(groups):
            outputs: dict[str, list[Generation]] = {}
            seconds: dict[str, float] = {}
            for rep in range(repeats):
                r = (g + rep) % len(paths)
                for p in paths[r:] + paths[:r]:
                    start = clock()
                    outputs[p.key] = call(p, group)  # greedy: the same each time
                    seconds[p.key] = min(seconds.get(p.key, float("inf")), clock() - start)
            same = 0
            for j in range(len(group)):
                reference = outputs[REFERENCE][j].output_ids
                runs = {}
                for key, gens in outputs.items():
                    diff = first_difference(gens[j].output_ids, reference)
                    share = seconds[key] / len(group)  # the group's wall time, shared
                    runs[key] = Run(len(gens[j].output_ids), share, diff is None, diff, gens[j].metrics)
                result.runs.append(runs)
                same += sum(run.identical for run in runs.values()) - 1
            result.load.append(load())
            done += len(group)
            times = ", ".join(f"{p.key} {seconds[p.key]:.1f}s" for p in paths)
            what = f"prompt {done}/{len(prompts)} ({group[0].kind})" if concurrency == 1 else f"prompts {done}/{len(prompts)}"
            progress(
                f"{what}: {sum(len(gen.output_ids) for gen in outputs[REFERENCE])} tokens, "
                f"{same}/{(len(paths) - 1) * len(group)} outputs identical to {REFERENCE}; {times}"
            )
    except KeyboardInterrupt:
        result.interrupted = True
        progress(f"interrupted: keeping the {len(result.runs)} prompt(s) every path completed")
    return result


def describe_setup(dep: Deployment, settings: dict, vllm: dict | None = None) -> dict:
    import transformers

    return ({"vllm": vllm} if vllm else {}) | {
        "spec": dep.spec.name,
        "spec_path": str(dep.loaded.path),
        "num_draft_tokens": dep.limits.default_draft_tokens,
        "max_ngram": dep.spec.speculative.max_ngram,
        "target_dtype": dep.target.manifest.dtype,
        "draft_dtype": dep.draft.manifest.dtype if dep.draft else None,
        "hf": settings,
        "machine": machine.description(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
