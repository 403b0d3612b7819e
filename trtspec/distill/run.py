"""`trtspec distill SPEC`: train an EAGLE-3 head for the spec's target.

1. build (or reuse) the target engine; 2. the data: the target's greedy responses to a prompt
set (and sampled ones, continuations from inside them, a user's conversations), captured as
they are generated (distill/data.py) into a feature store in the work folder, read per batch,
so RAM does not grow with the data (distill/store.py); 3. the draft vocabulary from the
target's outputs in training responses; 4. an anchored head (distill/heads.py) trained with
the training-time test on response positions, evaluated on held-out prompts never trained on
(distill/trainer.py); 5. the unseen prompts (the spec's verify prompts) scored per draft
position, the head's costs measured, and a draft length recommended (distill/costs.py);
6. the head folder (config, safetensors, manifest, training curve) written atomically at the
spec's draft path.

The work folder (.<head>.distill beside the head) keeps the data and the last good checkpoint;
Ctrl-C saves it first, --resume continues exactly. One distill runs per work folder at a time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trtspec import console
from trtspec.cache import cache_root
from trtspec.device import describe, free_bytes, place, uses_cpu_kernels
from trtspec.distill.corpus import read_conversations, tokenize_conversations
from trtspec.distill.costs import generation_key, generation_rows_for, measure_costs, recommend_k
from trtspec.distill.data import SHIPPED_PROMPTS, capture_batch, distill_prompts, draft_vocabulary, generated
from trtspec.distill.heads import head_norms, new_head, refuse_existing, save_head
from trtspec.distill.options import GEN_BATCH_MAX, DistillOptions, recipe_dump, resolve, run_dump
from trtspec.distill.sample import Sample
from trtspec.distill.store import CorruptStore, FeatureStore, open_store, remove_store, write_store
from trtspec.distill.trainer import Trainer, read_checkpoint
from trtspec.engines.build import build
from trtspec.engines.eagle3_checkpoint import distill_layer_ids
from trtspec.engines.manifest import check_manifest, versions
from trtspec.engines.torch import threads
from trtspec.engines.torch.engine import DTYPES, WEIGHTS, TorchEngine
from trtspec.engines.torch.model import DecoderConfig
from trtspec.errors import SpecError, TrtspecError
from trtspec.files import sha256_file
from trtspec.layout import engine_folder
from trtspec.spec import LoadedSpec
from trtspec.speculative.requests import GenerationRequest, Limits, encode_prompt, end_token_ids, make_request
from trtspec.speculative.sampling import SamplingParams


@dataclass
class DistillResult:
    output: Path
    steps: int
    metrics: dict
    curve: list[dict] = field(default_factory=list)
    stopped_by: str = "max_steps"
    advice: dict = field(default_factory=dict)  # measured costs, the bound per k, the recommended k

    def to_dict(self) -> dict:
        return {
            "output": str(self.output),
            "steps": self.steps,
            "stopped_by": self.stopped_by,
            "metrics": self.metrics,
            "advice": self.advice,
        }

    def summary(self) -> str:
        """One line: where the head went, its acceptance on unseen prompts, the recommended k."""
        m, k = self.metrics, self.advice["recommended_k"]
        return (
            f"head written to {self.output}: {self.steps} steps ({self.stopped_by}); unseen prompts: "
            f"per-position acceptance {'/'.join(f'{a:.2f}' for a in m['unseen_accepted'])}, acceptance length "
            f"{m['unseen_acceptance_length']:.2f} at k={len(m['unseen_accepted'])}; "
            + (f"recommended default_draft_tokens: {k}" if k else "no draft length beats target-only with this head")
        )


Progress = Callable[[dict], None]  # called after every training step (tests interrupt here)


def head_destination(loaded: LoadedSpec, output: Path | None) -> Path:
    if output is not None:
        return Path(output).expanduser().resolve()
    draft = loaded.spec.draft
    if loaded.spec.speculative.method != "eagle3" or draft is None or draft.path is None:
        raise SpecError(
            f"{loaded.path}: distill writes the head at draft.path of a method: eagle3 spec; "
            "set speculative.method: eagle3 and draft.path, or pass --output DIR"
        )
    return loaded.resolve(draft.path)


@dataclass
class Split:
    """Which prompts train and which measure: indices into the prompt list, plus the unseen
    evaluation prompts (the spec's verify prompts: never trained on in any form)."""

    prompts: list[str]
    train: list[int]
    held: list[int]
    unseen: list[str]


def distill(loaded: LoadedSpec, opts: DistillOptions, on_step: Progress | None = None) -> DistillResult:
    """Train and write the head; ``opts``' recipe fields that were set (the flags given) override
    the spec's ``distill:`` block (distill/options.resolve)."""
    start = time.monotonic()
    opts, sources = resolve(loaded, opts)
    out = head_destination(loaded, opts.output)
    refuse_existing(out, opts.force)
    work = work_folder(out)
    if opts.resume and not (work / "checkpoint.pt").is_file():
        raise TrtspecError(f"--resume: no checkpoint in {work}; run without --resume to start")
    with work_lock(work):  # before any work: a second run into this folder stops here
        if opts.resume:
            read_checkpoint(work / "checkpoint.pt")  # a torn one is refused now, not after the data
        split = _split(loaded, opts)
        data = prepare(loaded, opts, work, split)
        target, folder, target_hf, layer_ids = data.target, data.folder, data.target_hf, data.layer_ids
        store, train_s, held_s, unseen_s = data.store, data.train, data.held, data.unseen
        steps = opts.ttt_steps or max(1, loaded.spec.speculative.default_draft_tokens)
        draft_ids = draft_vocabulary(train_s, opts.draft_vocab, target_hf.vocab_size)
        head, config = new_head(target_hf, folder, layer_ids, draft_ids, opts.seed, anchor=opts.anchor, norms=head_norms(opts))
        run_key = f"{data.info['key']}+{recipe_key(opts, steps)}"  # what a checkpoint was trained on
        scaling = _scaling(target_hf, folder, layer_ids, draft_ids, target, opts, steps, store, train_s, held_s, unseen_s, work)
        trainer = Trainer(head, target, draft_ids, opts, steps, store)
        cpu0 = time.process_time()
        step, curve, stopped_by = trainer.fit(train_s, held_s, work / "checkpoint.pt", run_key, start, on_step)
        if step == 0:  # an untrained (anchored) head would pass for a distilled one
            raise TrtspecError(
                f"the time budget ({opts.time_budget:g} s) was spent before the first training step "
                f"(the data took {time.monotonic() - start:.0f} s); no head written. Raise --time-budget "
                f"(or pass none), or make less data (--samples-per-prompt, --max-tokens); the captured data "
                f"in {work} is kept and reused"
            )
        train_cpu_s = round(time.process_time() - cpu0, 1)  # this process's CPU seconds (all its threads)
        final = trainer.report(held_s, unseen_s)
        costs = measure_costs(target, head, len(final["unseen_accepted"]))
        k, bound = recommend_k(final["unseen_accepted"], costs, final["unseen_walk_length"])
        advice = {"costs": costs, "bound": bound, "recommended_k": k}  # timed: differs run to run
    manifest = {
        **_made_from(loaded, data, len(draft_ids), opts, sources),
        "steps": step,
        "ttt_steps": steps,
        "stopped_by": stopped_by,
        "metrics": final,
        "advice": advice,
        "elapsed_s": round(time.monotonic() - start, 1),
        "train_cpu_s": train_cpu_s,  # training only (a resumed run: since it resumed)
        "versions": versions(),
    }
    if scaling:
        scaling.append(_scaling_point(1.0, train_s, final))
        manifest["scaling"] = scaling
    save_head(out, head, config, manifest, _plots(work, curve, scaling))
    _summary(out, step, final, advice)
    return DistillResult(out, step, final, curve, stopped_by, advice)


def _made_from(loaded: LoadedSpec, data: Prepared, draft_vocab_size: int, opts: DistillOptions, sources: dict) -> dict:
    """The manifest's account of what made the head: its target, layers, data and the resolved
    recipe (a spec's ``distill:`` block that trains it again) with where each value came from."""
    return {
        "format": 2,
        "method": "eagle3",
        "target": {"spec": loaded.spec.name, "source": loaded.spec.target.source_id, "weights": data.info["target"]},
        "layer_ids": list(data.layer_ids),
        "draft_vocab_size": draft_vocab_size,
        "data": _data_manifest(data.info["manifest"], data.train, data.held),
        "seed": opts.seed,
        "recipe": recipe_dump(opts),
        "recipe_from": sources,  # each recipe field: "cli" (a flag given), "spec" (its distill: block) or "default"
        "run": run_dump(opts),  # this run's settings that are not the recipe (--output, --resume, --gen-batch, ...)
    }


def _plots(work: Path, curve: list[dict], scaling: list[dict]) -> dict[str, Path]:
    """The head folder's plots, drawn in the work folder: the training curve and, with
    --scaling, the data-scaling curve."""
    extra = {"training-curve.png": work / "training-curve.png"}
    _plot(curve, extra["training-curve.png"])
    if scaling:
        extra["data-scaling.png"] = work / "data-scaling.png"
        _plot_scaling(scaling, extra["data-scaling.png"])
    return extra


def _data_manifest(captured: dict, train_s, held_s) -> dict:
    """The manifest's data block: how the data was captured, and what training used of it."""
    return {
        **captured,
        "train_sequences": len(train_s),
        "train_tokens": sum(len(s.tokens) for s in train_s),
        "train_response_tokens": sum(int(s.response_mask().sum()) for s in train_s),
        "held_out_tokens": sum(len(s.tokens) for s in held_s),
    }


def work_folder(head: Path) -> Path:
    """Where distill keeps a head's data and checkpoint: ``.<head>.distill`` beside it."""
    return Path(head).parent / f".{Path(head).name}.distill"


@dataclass
class Prepared:
    """The target engine (capturing the head's layers) and the captured data, split."""

    target: TorchEngine
    folder: Path  # the built target engine
    target_hf: object  # its transformers config
    layer_ids: tuple[int, ...]
    store: FeatureStore
    info: dict  # the data's key and what the manifest says of it
    train: list[Sample]
    held: list[Sample]  # held-out prompts' greedy responses (progress figures)
    unseen: list[Sample]  # the unseen prompts' (the final figures)


def prepare(loaded: LoadedSpec, opts: DistillOptions, work: Path, split: Split | None = None) -> Prepared:
    """Build (or reuse) the target, generate and capture the data (or reuse its capture in
    ``work``) and split it as training does: what distill trains on, and what another trainer
    is given for a side by side (lab/distill_peers.py)."""
    split = split or _split(loaded, opts)
    target, folder, target_hf, layer_ids = _target(loaded, opts, split)
    store, info = _data(loaded, opts, split, target, folder, layer_ids, work)
    samples = store.samples
    n_prompts, n_unseen = len(split.prompts), len(split.unseen)
    # samples: each prompt's greedy response, each unseen prompt's, then the sampled ones and
    # the continuations (training prompts only), then the corpus.
    return Prepared(
        target,
        folder,
        target_hf,
        layer_ids,
        store,
        info,
        train=[samples[i] for i in split.train] + samples[n_prompts + n_unseen :],
        held=[samples[i] for i in split.held],
        unseen=samples[n_prompts : n_prompts + n_unseen],
    )


def _summary(out: Path, step: int, final: dict, advice: dict) -> None:
    acc = final["unseen_accepted"]
    console.info(
        f"wrote {out} ({step} steps): on unseen prompts, per-position acceptance "
        + "/".join(f"{a:.2f}" for a in acc)
        + f", acceptance length {final['unseen_acceptance_length']:.2f} at k={len(acc)}; top-1/2/3 recall per depth "
        + ", ".join("/".join(f"{r:.2f}" for r in d) for d in final["unseen_top_r"])
    )
    if walk := final.get("unseen_walk_length"):
        console.info(
            "as greedy generation drafts them (one walk of each unseen response per k): tokens per forward "
            + ", ".join(f"k={i + 1}: {t:.2f}" for i, t in enumerate(walk))
            + f"; the first draft kept {final['unseen_walk_accepted'][0][0]:.2f} of the time at k=1"
        )
    c = advice["costs"]
    k = advice["recommended_k"]
    console.info(
        f"measured costs: head step {c['head']:.3f} target steps, verify of k+1 tokens "
        + ", ".join(f"k={i + 1}: {v:.2f}" for i, v in enumerate(c["verify"]))
        + "; bound "
        + ", ".join(f"k={i + 1}: {b:.2f}x" for i, b in enumerate(advice["bound"]))
        + (f"; recommended default_draft_tokens: {k}" if k else "; no k beats target-only with this head")
    )


def _scaling(target_hf, folder, layer_ids, draft_ids, target, opts, steps, store, train_s, held_s, unseen_s, work) -> list[dict]:
    """The data-scaling curve: the same recipe trained on a seeded fraction of the training
    sequences (steps in proportion: the same number of passes over the data), scored on the
    unseen prompts. The full run is the last point."""
    points = []
    order = torch.randperm(len(train_s), generator=torch.Generator().manual_seed(opts.seed + 99)).tolist()
    for f in sorted(x for x in opts.scaling if x < 1.0):
        part = [train_s[i] for i in sorted(order[: max(1, round(f * len(train_s)))])]
        sub = opts.model_copy(update={"max_steps": max(1, round(opts.max_steps * f)), "resume": False, "time_budget": None})
        head, _ = new_head(target_hf, folder, layer_ids, draft_ids, opts.seed, anchor=opts.anchor, norms=head_norms(opts))
        trainer = Trainer(head, target, draft_ids, sub, steps, store)
        console.info(f"data scaling: {f:g}x of the data ({len(part)} sequences, {sub.max_steps} steps)")
        ckpt = work / "scaling-checkpoint.pt"
        trainer.fit(part, held_s, ckpt, "scaling", time.monotonic())
        ckpt.unlink(missing_ok=True)
        points.append(_scaling_point(f, part, trainer.report([], unseen_s)))
    return points


def _scaling_point(fraction: float, part: list, metrics: dict) -> dict:
    return {
        "fraction": fraction,
        "sequences": len(part),
        "response_tokens": sum(int(s.response_mask().sum()) for s in part),
        "unseen_accepted": metrics["unseen_accepted"],
        "unseen_acceptance_length": metrics["unseen_acceptance_length"],
    }


def _plot_scaling(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p["response_tokens"] for p in points]
    ax.plot(x, [p["unseen_accepted"][0] for p in points], "o-", label="acceptance at k=1 (first draft)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training response tokens")
    ax.set_ylabel("acceptance on unseen prompts")
    ax2 = ax.twinx()
    ax2.plot(x, [p["unseen_acceptance_length"] for p in points], "s--", color="tab:red", label="acceptance length")
    ax2.set_ylabel("acceptance length (tokens per target forward)")
    ax.legend(loc="upper left")
    ax2.legend(loc="lower right")
    ax.set_title("data scaling (same recipe, same passes over the data)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _split(loaded: LoadedSpec, opts: DistillOptions) -> Split:
    prompts_path = Path(opts.prompts) if opts.prompts else SHIPPED_PROMPTS
    prompts = distill_prompts(prompts_path)
    # The gate measures on prompts the head never saw: the spec's verify prompts (and
    # --eval-prompts) are left out of training and scored at the end.
    extra = distill_prompts(Path(opts.eval_prompts)) if opts.eval_prompts else []
    unseen = list(dict.fromkeys(loaded.verify_prompts() + extra))
    gate = set(unseen)
    kept = [p for p in prompts if p not in gate]
    if len(kept) < len(prompts):
        console.info(f"left out {len(prompts) - len(kept)} prompt(s) that are also evaluation prompts (verify, --eval-prompts)")
    if len(kept) < 2:
        raise SpecError(f"--prompts: {prompts_path} holds fewer than 2 prompts besides the spec's verify prompts")
    held_n = max(1, round(len(kept) * opts.held_out))
    order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(opts.seed)).tolist()
    held, train = sorted(order[:held_n]), sorted(order[held_n:])
    if not train:
        raise SpecError(f"--prompts: {prompts_path} leaves no training prompt after holding out {held_n}")
    return Split(kept, train, held, unseen)


def _target(loaded: LoadedSpec, opts: DistillOptions, split: Split):
    """The target engine (built once), sized for generation: gen_batch slots of just the
    positions the data needs; it captures the head's feature layers as it runs."""
    from transformers import AutoConfig

    out_dir = loaded.output_dir()
    build(loaded, out_dir, allow_pickle=opts.allow_pickle, roles=["target"])
    folder = engine_folder(out_dir, "target")
    check_manifest(folder, "target", loaded.spec.build_hash("target"))
    target_hf = AutoConfig.from_pretrained(folder)
    layer_ids = tuple(opts.layer_ids or distill_layer_ids(target_hf.num_hidden_layers))
    # Generation batches far more sequences than the deployment serves: a decode step reads
    # the weights once for all its rows, so on CPU 64 rows cost a few times 1, not 64 times.
    # The KV cache holds 2 x 30 x 3 x 64 x 4 bytes a position for SmolLM2: sized to the longest
    # prompt + response (or training sequence), not the manifest's max_seq_len.
    longest = _longest_prompt(loaded, folder, split) + opts.max_tokens
    max_seq = min(max(longest, opts.max_len if opts.corpus else 0) + 1, loaded.spec.limits("target").max_seq_len)
    device = place(loaded.spec.device, {"target": loaded.spec.target.dtype})
    rows = opts.gen_batch
    if rows is None and uses_cpu_kernels(device):
        rows, rates, how = generation_rows_for(folder, device, generation_key(folder, target_hf), cache_root())
        console.info(
            f"generating {rows} sequences at once on {describe(device)} ({how} on this machine: "
            + ", ".join(f"{r} rows {v:.0f} tok/s" for r, v in sorted(rates.items()))
            + "; --gen-batch sets it)"
        )
    elif rows is None:
        rows = generation_rows(device, folder, target_hf, len(layer_ids), max_seq)
        console.info(f"generating {rows} sequences at once on {describe(device)}")
    target = TorchEngine.load(folder, slots=max(rows, 1), max_seq_len=max_seq, device=device)
    target.capture_features(layer_ids)
    return target, folder, target_hf, layer_ids


def _longest_prompt(loaded: LoadedSpec, folder: Path, split: Split) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=loaded.spec.target.trust_remote_code)
    return max(len(encode_prompt(tok, p, loaded.spec.verify.chat_template)) for p in split.prompts + split.unseen)


GPU_MEMORY_USE = 0.8  # of the GPU memory free once the weights are in; the rest: allocator, LM-head logits


def generation_rows(device, folder: Path, hf, n_features: int, max_seq: int, free: int | None = None) -> int:
    """Rows generated at once on a GPU: as many as fit in GPU_MEMORY_USE of
    the memory free after the weights (the engine file's size), at a per-row cost of

        KV cache   2 x layers x kv_heads x head_dim x max_seq x e      (e: bytes per element)
        features   n_features x hidden x max_seq x e                   (kept per position for the head)
        prefill    heads x max_seq^2 x 4                                (one layer's attention scores in
                                                                         float32, if SDPA uses its math kernel)
                 + max_seq x (2 x intermediate + 4 x hidden) x e       (one layer's activations)

    between 1 and GEN_BATCH_MAX. ``free``: bytes free on the device (default: measured now)."""
    free = free_bytes(device) if free is None else free
    if free is None:
        raise TrtspecError(f"{device}: no free-memory reading; a CPU measures its batch (distill/costs.py generation_rows_for)")
    cfg = DecoderConfig.from_hf(hf)
    e = DTYPES[json.loads((folder / "manifest.json").read_text())["dtype"]].itemsize
    per_row = (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * max_seq * e
        + n_features * cfg.hidden_size * max_seq * e
        + cfg.num_heads * max_seq * max_seq * 4
        + max_seq * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * e
    )
    usable = GPU_MEMORY_USE * (free - (folder / WEIGHTS).stat().st_size)
    return max(1, min(GEN_BATCH_MAX, int(usable // per_row)))


# Recipe fields a checkpoint's key leaves out. A resumed run may change how long it runs (a
# budget cut short is resumed with a longer one) and the data-scaling curve (trained apart,
# before the run); the data files and the layers are in the data's key by content and resolved
# value, and ttt_steps is keyed as the depth it resolves to.
OUTSIDE_KEY = ("time_budget", "scaling", "prompts", "eval_prompts", "corpus", "layer_ids", "ttt_steps")


def recipe_key(opts: DistillOptions, steps: int) -> str:
    """What, besides the data, a checkpoint's weights depend on: resuming under another recipe is refused."""
    recipe = {k: v for k, v in recipe_dump(opts).items() if k not in OUTSIDE_KEY}
    recipe["ttt_steps"] = steps
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def _variants(n_prompts: int, train_idx: list[int], opts: DistillOptions) -> list[tuple[int, SamplingParams | None]]:
    """(prompt index, sampling) per response to generate: every prompt's greedy response first,
    then samples_per_prompt - 1 sampled responses per training prompt, each with its own seed."""
    out: list[tuple[int, SamplingParams | None]] = [(i, None) for i in range(n_prompts)]
    for j in range(1, opts.samples_per_prompt):
        for i in train_idx:
            seed = (opts.seed * 1_000_003 + i * 1009 + j) % 2**63
            out.append((i, SamplingParams(temperature=opts.temperature, top_p=0.95, seed=seed)))
    return out


def _data(loaded: LoadedSpec, opts: DistillOptions, split: Split, target: TorchEngine, folder: Path, layer_ids, work: Path):
    """The captured data (a FeatureStore) and what describes it, cached by everything that
    shapes it; superseded captures in the work folder are removed."""
    from transformers import AutoTokenizer

    target_hash = json.loads((folder / "manifest.json").read_text())["source"]["weights"]
    inputs = {
        "target": target_hash,
        "prompts": hashlib.sha256(json.dumps(split.prompts).encode()).hexdigest(),
        "unseen": hashlib.sha256(json.dumps(split.unseen).encode()).hexdigest(),
        "max_tokens": opts.max_tokens,
        "layers": list(layer_ids),
        "chat": loaded.spec.verify.chat_template,
        "format": "generated+recorded",
        # sampled responses are drawn per (seed, prompt, sample): the split shapes them
        **(
            {
                "samples": opts.samples_per_prompt,
                "branches": opts.branches_per_prompt,
                "temperature": opts.temperature,
                "seed": opts.seed,
            }
            if opts.samples_per_prompt > 1 or opts.branches_per_prompt
            else {}
        ),
        **({"corpus": sha256_file(Path(opts.corpus)), "max_len": opts.max_len} if opts.corpus else {}),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
    remove_superseded(work, key)
    store = _cached_store(work, key)
    info = {"key": key, "target": target_hash, "manifest": {}}
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=loaded.spec.target.trust_remote_code)
    corpus = _corpus(tok, opts) if opts.corpus else []
    if store is None:
        work.mkdir(parents=True, exist_ok=True)
        rates = DataRates()
        parts = work / f"parts-{key}-g{target.max_batch_size}"
        samples = _generated_samples(loaded, opts, split, target, tok, parts, rates)
        # at one thread count throughout: the same command makes the same data, whatever the load
        with console.step(f"generating and capturing the target's responses into {work}"), _held(target):
            store = write_store(work, key, inputs, _chain(samples, _corpus_samples(target, corpus, rates)))
        shutil.rmtree(parts, ignore_errors=True)  # the store holds every batch now
        console.info(rates.line())
        info["rates"] = rates.to_dict() | {"rows": target.max_batch_size}  # sequences generated at once
    info["manifest"] = {
        "prompts_file": str(opts.prompts or SHIPPED_PROMPTS),
        "prompts_sha256": sha256_file(Path(opts.prompts or SHIPPED_PROMPTS)),
        "prompts_used": len(split.prompts),  # after leaving out the spec's verify prompts
        "train_prompts": len(split.train),
        "held_out_prompts": len(split.held),
        "unseen_prompts": len(split.unseen),
        "samples_per_prompt": opts.samples_per_prompt,
        "branches_per_prompt": opts.branches_per_prompt,
        "temperature": opts.temperature if opts.samples_per_prompt > 1 or opts.branches_per_prompt else None,
        "corpus": str(opts.corpus) if opts.corpus else None,
        "corpus_conversations": len(corpus),
        "max_tokens": opts.max_tokens,
        **({"rates": info["rates"]} if "rates" in info else {}),
    }
    return store, info


@dataclass
class Tokens:
    """Tokens made and the seconds they took."""

    n: int = 0
    seconds: float = 0.0

    def per_s(self) -> float | None:
        return round(self.n / self.seconds, 1) if self.seconds else None


@dataclass
class DataRates:
    """What the data cost: the responses generated (and captured as generated) and the corpus
    captured, each in tokens and seconds."""

    generated: Tokens = field(default_factory=Tokens)
    captured: Tokens = field(default_factory=Tokens)
    sequences: dict = field(default_factory=dict)  # kind -> count

    def to_dict(self) -> dict:
        g, c = self.generated, self.captured  # the record's keys and their order are distill's format
        return {
            "generated_tokens": g.n,
            "generation_s": g.seconds,
            "captured_tokens": c.n,
            "capture_s": c.seconds,
            "sequences": dict(self.sequences),
            "generated_tokens_per_s": g.per_s(),
            "captured_tokens_per_s": c.per_s(),
        }

    def line(self) -> str:
        g, c = self.generated, self.captured
        mix = ", ".join(f"{n} {k}" for k, n in self.sequences.items())
        return f"data: {mix}; generated {g.n} response tokens in {g.seconds:.0f}s ({g.per_s()} tok/s, captured as generated)" + (
            f"; captured {c.n} corpus tokens in {c.seconds:.0f}s ({c.per_s()} tok/s)" if c.n else ""
        )


def _held(target: TorchEngine):
    """The thread governor held at its full count (threads.Governor.held) on CPU."""
    return threads.governor().held() if target.device.type == "cpu" else contextlib.nullcontext()


def _chain(*iterables):
    for it in iterables:
        yield from it


def _generated_samples(loaded, opts: DistillOptions, split: Split, target: TorchEngine, tok, parts: Path, rates: DataRates):
    """Samples of the target's responses, in store order: each prompt's greedy response, each
    unseen prompt's, the sampled ones, then the continuations from inside greedy responses."""
    limits = Limits.from_spec(loaded.spec, target.vocab_size)
    end_ids = end_token_ids(tok, target.folder)
    texts = split.prompts + split.unseen
    encoded = []
    for n, p in enumerate(texts, start=1):
        ids = encode_prompt(tok, p, loaded.spec.verify.chat_template)
        if min(opts.max_tokens, target.max_seq_len - 1 - len(ids), limits.max_seq_len - len(ids)) < 1:
            raise SpecError(f"--prompts: prompt {n} has {len(ids)} tokens, no room below max_seq_len; shorten it")
        encoded.append(ids)

    def request(ids: list[int], sampling: SamplingParams | None) -> GenerationRequest:
        budget = min(opts.max_tokens, target.max_seq_len - 1 - len(ids), limits.max_seq_len - len(ids))
        return make_request(ids, budget, 0, limits, end_ids, sampling=sampling)

    variants = [(i, None) for i in range(len(texts))] + _variants(len(split.prompts), split.train, opts)[len(split.prompts) :]
    reqs = [request(encoded[i], s) for i, s in variants]
    rates.sequences["greedy"] = len(texts)
    rates.sequences["sampled"] = len(reqs) - len(texts)
    greedy: dict[int, list[int]] = {}
    yield from _timed(target, reqs, parts / "responses", rates, "responses", keep=greedy)
    if opts.branches_per_prompt:
        branch_reqs, starts = [], []
        gen = torch.Generator().manual_seed(opts.seed * 7919 + 17)
        for j in range(opts.branches_per_prompt):
            for i in split.train:
                resp = greedy[i]
                if len(resp) < 4:
                    continue
                m = int(torch.randint(1, len(resp) - 2, (1,), generator=gen))
                seed = (opts.seed * 1_000_003 + i * 1009 + 7 * j + 3) % 2**63
                r = request(encoded[i] + resp[:m], SamplingParams(temperature=opts.temperature, top_p=0.95, seed=seed))
                branch_reqs.append(r)
                starts.append(len(encoded[i]))  # the greedy prefix is response text too (labelled once, in its own sample)
        rates.sequences["continued"] = len(branch_reqs)
        yield from _timed(target, branch_reqs, parts / "continuations", rates, "continuations", starts)


def _timed(target, reqs, parts: Path, rates: DataRates, what: str, starts=None, keep: dict | None = None):
    """data.generated with progress, ETA and the generation rate."""
    t0 = time.monotonic()
    first: list[int] = []

    def progress(done: int, total: int) -> None:
        if not first:  # the call before any batch: responses found in the log, not timed here
            first.append(done)
            if done:
                console.info(f"target {what} {done}/{total} found in {parts}")
            return
        eta = (time.monotonic() - t0) / max(1, done - first[0]) * (total - done)
        console.info(f"target {what} {done}/{total}  ETA {eta:.0f}s")

    base = rates.generated.seconds
    for n, s in enumerate(generated(target, reqs, parts, progress, starts)):
        rates.generated.n += len(s.tokens) + 1 - len(reqs[n].prompt_ids)  # its output ids
        rates.generated.seconds = base + time.monotonic() - t0
        if keep is not None and reqs[n].sampling is None:
            keep[n] = s.tokens[len(reqs[n].prompt_ids) :].tolist()  # all but its last token
        yield s


def _corpus(tok, opts: DistillOptions) -> list:
    conversations = read_conversations(Path(opts.corpus))
    convs, skipped = tokenize_conversations(tok, conversations, opts.max_len)
    console.info(
        f"corpus: {len(convs)} conversations from {opts.corpus}"
        + (
            f" ({skipped} skipped: no assistant token within {opts.max_len} tokens, or a template that splits turns)"
            if skipped
            else ""
        )
    )
    return convs


def _corpus_samples(target: TorchEngine, convs: list, rates: DataRates):
    """The corpus, captured by teacher-forced forwards, a few conversations per forward."""
    rates.sequences["corpus"] = len(convs)
    t0 = time.monotonic()
    for n in range(0, len(convs), 64):
        part = convs[n : n + 64]
        for s in capture_batch(target, [c.tokens for c in part], [c.response for c in part]):
            rates.captured.n += len(s.tokens)
            yield s
        captured = rates.captured
        captured.seconds = time.monotonic() - t0
        if n + 64 < len(convs):
            eta = captured.seconds / (n + 64) * (len(convs) - n - 64)
            console.info(f"corpus captured {n + 64}/{len(convs)}  {captured.n / captured.seconds:.0f} tok/s  ETA {eta:.0f}s")


def _cached_store(work: Path, key: str) -> FeatureStore | None:
    """The finished capture of this data, if the work folder holds a sound one."""
    try:
        store = open_store(work, key)
    except CorruptStore as e:
        console.info(f"{e}; capturing again")
        remove_store(work, key)
        return None
    if store is not None:
        console.info(f"data: {len(store.samples)} captured sequences, {store.rows} tokens, features in {store.features}")
    return store


def remove_superseded(work: Path, key: str) -> None:
    """Delete captures and generated batches of other data than ``key``: every change of
    prompts, layers or lengths used to leave gigabytes of features behind."""
    if not work.is_dir():
        return
    freed, names = 0, []
    for p in work.iterdir():
        stem = p.name.lstrip(".")
        if not stem.startswith(("features-", "data-", "responses-", "parts-")) or key in p.name:
            continue
        if p.is_dir():
            freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p, ignore_errors=True)
        else:
            freed += p.stat().st_size
            p.unlink()
        names.append(p.name)
    if names:
        console.info(f"removed {len(names)} superseded file(s) of other data from {work} ({freed / 1e9:.2f} GB)")


@contextmanager
def work_lock(work: Path):
    """One distill per work folder: two runs would share (and corrupt) one checkpoint. The
    lock is the kernel's (``fcntl.flock`` on ``work/lock``, as the kernel-choice cache does):
    held from the moment it is taken, even before the file names its owner, and released by
    the kernel when its run ends, however it ends, so a dead run's lock is simply free."""
    import fcntl

    work.mkdir(parents=True, exist_ok=True)
    lock = work / "lock"
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "not written yet"
            os.close(fd)
            raise TrtspecError(
                f"{work} is in use by another distill (pid {owner}, holding the lock {lock}); wait for it to finish, or stop it"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:  # its last holder removed it as we opened it
            same = False
        if same:
            break
        os.close(fd)  # locked a file no longer at the path: take the one there now
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())  # for the message a second run prints
        yield
    finally:
        lock.unlink(missing_ok=True)  # still held: nobody can take the removed file's lock
        os.close(fd)


def _plot(curve: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in curve], [r["loss"] for r in curve], label="training loss", color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    evals = [r for r in curve if "held_out_top1" in r]
    if evals:
        ax2 = ax.twinx()
        ax2.plot(
            [r["step"] for r in evals],
            [r["held_out_top1"][0] for r in evals],
            "o-",
            color="tab:green",
            label="held-out top-1 (step 0)",
        )
        ax2.plot(
            [r["step"] for r in evals],
            [r["held_out_acceptance_length"] for r in evals],
            "s-",
            color="tab:red",
            label="held-out acceptance length",
        )
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
