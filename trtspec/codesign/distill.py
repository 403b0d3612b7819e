"""`trtspec distill SPEC`: train an EAGLE-3 head for the spec's target.

1. build (or reuse) the target engine; 2. generate the target's greedy responses to a prompt
set and capture features + labels (cached in the work folder; the features stream to a file
there and are read per batch, so RAM does not grow with the data: codesign/store.py);
3. choose the draft vocabulary from the target's output frequencies on the training prompts;
4. train with the training-time test, evaluating on held-out prompts never trained on;
5. write the head folder (config, safetensors, manifest, training curve) atomically at the
spec's draft path.

Deterministic with a seed: the batch of step s is drawn from a generator seeded by (seed, s),
so a run resumed from its last checkpoint equals an uninterrupted one. The work folder
(.<head>.distill beside the head) keeps the data and the last good checkpoint; Ctrl-C saves
it first.
"""

from __future__ import annotations

import hashlib
import io
import json
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trtspec import console
from trtspec.codesign.data import (
    SHIPPED_PROMPTS,
    capture,
    collate,
    draft_vocabulary,
    read_prompts,
    responses,
)
from trtspec.codesign.heads import new_head, refuse_existing, save_head, target_lm_head
from trtspec.codesign.store import CorruptStore, FeatureStore, open_store, remove_store, write_store
from trtspec.codesign.train import agreement, ttt_loss
from trtspec.engines.build import build
from trtspec.engines.eagle3 import default_layer_ids
from trtspec.engines.manifest import check_manifest, versions
from trtspec.engines.torch.eagle3 import Eagle3Head
from trtspec.engines.torch.engine import TorchEngine
from trtspec.errors import SpecError, TrtspecError
from trtspec.files import sha256_file, write_bytes_atomic
from trtspec.layout import engine_folder
from trtspec.spec import LoadedSpec
from trtspec.speculative.requests import GenerationRequest, Limits, encode_prompt, end_token_ids, make_request
from trtspec.speculative.sampling import SamplingParams


@dataclass
class DistillOptions:
    prompts: Path | None = None  # JSONL; default: the shipped prompt set
    output: Path | None = None  # default: the spec's draft.path
    force: bool = False
    resume: bool = False
    max_steps: int = 2000
    time_budget_s: float | None = None  # whole run, data generation included
    seed: int = 0
    draft_vocab: int = 8192
    ttt_steps: int = 3
    max_tokens: int = 128  # response length per prompt
    batch_size: int = 8
    max_len: int = 512  # positions per training sequence
    lr: float = 1e-3
    held_out: float = 0.1  # fraction of prompts never trained on
    eval_every: int = 50
    layer_ids: tuple[int, ...] | None = None
    samples_per_prompt: int = 1  # training responses per prompt: the greedy one + sampled ones
    temperature: float = 0.8  # of the sampled responses (labels stay the target's greedy tokens)
    weight_decay: float = 0.0
    gen_batch: int = 16  # sequences generated at once (the engine's slots during distill)
    labels: str = "hard"  # hard: the target's greedy token; soft: its top-k distribution (train.ttt_loss)
    allow_pickle: bool = False


@dataclass
class DistillResult:
    output: Path
    steps: int
    metrics: dict
    curve: list[dict] = field(default_factory=list)
    stopped_by: str = "max_steps"

    def to_dict(self) -> dict:
        return {"output": str(self.output), "steps": self.steps, "stopped_by": self.stopped_by, "metrics": self.metrics}


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


def distill(loaded: LoadedSpec, opts: DistillOptions, on_step: Progress | None = None) -> DistillResult:
    start = time.monotonic()
    out = head_destination(loaded, opts.output)
    refuse_existing(out, opts.force)
    work = out.parent / f".{out.name}.distill"
    if opts.resume and not (work / "checkpoint.pt").is_file():
        raise TrtspecError(f"--resume: no checkpoint in {work}; run without --resume to start")
    prompts_path = Path(opts.prompts) if opts.prompts else SHIPPED_PROMPTS
    prompts = read_prompts(prompts_path)
    # The gate measures on prompts the head never saw: the spec's verify prompts are left out.
    gate = set(loaded.verify_prompts())
    kept = [p for p in prompts if p not in gate]
    if len(kept) < len(prompts):
        console.info(f"left out {len(prompts) - len(kept)} prompt(s) that are also the spec's verify prompts")
    if len(kept) < 2:
        raise SpecError(f"--prompts: {prompts_path} holds fewer than 2 prompts besides the spec's verify prompts")
    prompts = kept

    # 1. the target engine, built once (the head is not needed for that).
    out_dir = loaded.output_dir()
    build(loaded, out_dir, allow_pickle=opts.allow_pickle, roles=["target"])
    folder = engine_folder(out_dir, "target")
    check_manifest(folder, "target", loaded.spec.build_hash("target"))
    # Generation batches more sequences than the deployment serves: on CPU a decode step costs
    # about the same for 4 or 16 rows (the weights are read once per step).
    target = TorchEngine.load(folder, slots=max(opts.gen_batch, 1))
    from transformers import AutoConfig, AutoTokenizer

    target_hf = AutoConfig.from_pretrained(folder)
    layer_ids = tuple(opts.layer_ids or default_layer_ids(target_hf.num_hidden_layers))
    target.capture_features(layer_ids)
    target_hash = json.loads((folder / "manifest.json").read_text())["source"]["weights"]

    # 2. data, cached by everything that shapes it.
    held_n = max(1, round(len(prompts) * opts.held_out))
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(opts.seed)).tolist()
    held_idx, train_idx = sorted(order[:held_n]), sorted(order[held_n:])
    if not train_idx:
        raise SpecError(f"--prompts: {prompts_path} leaves no training prompt after holding out {held_n}")
    inputs = {
        "target": target_hash,
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
        "max_tokens": opts.max_tokens,
        "layers": list(layer_ids),
        "chat": loaded.spec.verify.chat_template,
        # sampled responses are drawn per (seed, prompt, sample): the split shapes them
        **(
            {"samples": opts.samples_per_prompt, "temperature": opts.temperature, "seed": opts.seed}
            if opts.samples_per_prompt > 1
            else {}
        ),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
    store = _cached_store(work, key)
    if store is None:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=loaded.spec.target.trust_remote_code)
        work.mkdir(parents=True, exist_ok=True)
        variants = _variants(len(prompts), train_idx, opts)
        outs, reqs = _generate(loaded, target, tok, prompts, variants, opts.max_tokens, work / f"responses-{key}.jsonl")
        store = _capture(target, reqs, outs, work, key, inputs)
    samples = store.samples
    # samples[i] is prompt i's greedy response; later ones are sampled responses to training
    # prompts only (held-out prompts are never trained on, in any form).
    held_s = [samples[i] for i in held_idx]
    train_s = [samples[i] for i in train_idx] + samples[len(prompts) :]

    # 3. draft vocabulary and a fresh head (or the checkpoint's).
    draft_ids = draft_vocabulary(train_s, opts.draft_vocab, target_hf.vocab_size)
    head, config = new_head(target_hf, target_lm_head(folder), layer_ids, draft_ids, opts.seed)
    head.train()
    optim = torch.optim.AdamW(head.parameters(), lr=opts.lr, weight_decay=opts.weight_decay)
    step, curve = 0, []
    ckpt = work / "checkpoint.pt"
    run_key = key if opts.labels == "hard" else f"{key}+{opts.labels}"  # what a checkpoint was trained on
    if opts.resume:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if state["key"] != run_key or state["seed"] != opts.seed:
            raise TrtspecError(f"--resume: {ckpt} was made with other data, seed or --labels; run without --resume")
        head.load_state_dict(state["head"])
        optim.load_state_dict(state["optim"])
        step, curve = int(state["step"]), json.loads(state["curve"])
        console.info(f"resuming at step {step}")

    # 4. train.
    t2d = torch.full((target_hf.vocab_size,), -1, dtype=torch.long)
    t2d[torch.tensor(draft_ids)] = torch.arange(len(draft_ids))
    embed, cos, sin = target.model.model.embed_tokens, target.cos, target.sin

    def held_batches():  # read per evaluation, a training batch's size at a time
        for n in range(0, len(held_s), opts.batch_size):
            yield collate(held_s[n : n + opts.batch_size], opts.max_len, store)

    stopped_by = "max_steps"
    t_train = time.monotonic()
    first_step = step
    updating = False  # True while the weights are half-updated: no checkpoint then
    try:
        with _deferred_interrupt() as asked:
            while step < opts.max_steps:
                if asked():  # Ctrl-C: stop at this step boundary, weights consistent
                    raise KeyboardInterrupt
                if opts.time_budget_s is not None and time.monotonic() - start >= opts.time_budget_s:
                    stopped_by = "time_budget"
                    break
                gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
                idx = torch.randint(len(train_s), (min(opts.batch_size, len(train_s)),), generator=gen).tolist()
                loss, _ = ttt_loss(
                    head,
                    embed,
                    collate([train_s[i] for i in idx], opts.max_len, store, soft=opts.labels == "soft"),
                    opts.ttt_steps,
                    t2d,
                    cos,
                    sin,
                    soft=opts.labels == "soft",
                )
                optim.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                updating = True
                optim.step()
                step += 1
                updating = False
                row = {"step": step, "loss": float(loss.detach())}
                if step % opts.eval_every == 0 or step == opts.max_steps:
                    row.update(_evaluate(head, embed, held_batches(), opts.ttt_steps, cos, sin))
                    done = step - first_step
                    eta = (time.monotonic() - t_train) / done * (opts.max_steps - step)
                    if opts.time_budget_s is not None:
                        eta = min(eta, max(0.0, opts.time_budget_s - (time.monotonic() - start)))
                    console.info(
                        f"step {step}/{opts.max_steps}  loss {row['loss']:.3f}  held-out top-1 "
                        + "/".join(f"{a:.2f}" for a in row["held_out_top1"])
                        + f"  acceptance length {row['held_out_acceptance_length']:.2f}  ETA {eta:.0f}s"
                    )
                curve.append(row)
                if step % opts.eval_every == 0:
                    write_bytes_atomic(ckpt, _checkpoint_bytes(head, optim, step, curve, run_key, opts.seed))
                if on_step:
                    on_step(row)
    except KeyboardInterrupt:
        if not updating:
            write_bytes_atomic(ckpt, _checkpoint_bytes(head, optim, step, curve, run_key, opts.seed))
        console.info(f"interrupted: the last good checkpoint is in {ckpt}; finish with --resume")
        raise
    write_bytes_atomic(ckpt, _checkpoint_bytes(head, optim, step, curve, run_key, opts.seed))

    # 5. the head folder, atomically, with its manifest and curve.
    head.eval()
    final = _evaluate(head, embed, held_batches(), opts.ttt_steps, cos, sin)
    manifest = {
        "format": 1,
        "method": "eagle3",
        "target": {"spec": loaded.spec.name, "source": loaded.spec.target.source_id, "weights": target_hash},
        "layer_ids": list(layer_ids),
        "draft_vocab_size": len(draft_ids),
        "data": {
            "prompts_file": str(prompts_path),
            "prompts_sha256": sha256_file(prompts_path),
            "prompts_used": len(prompts),  # after leaving out the spec's verify prompts
            "train_prompts": len(train_idx),
            "held_out_prompts": len(held_idx),
            "train_sequences": len(train_s),
            "samples_per_prompt": opts.samples_per_prompt,
            "temperature": opts.temperature if opts.samples_per_prompt > 1 else None,
            "train_tokens": sum(len(s.tokens) for s in train_s),
            "held_out_tokens": sum(len(s.tokens) for s in held_s),
            "max_tokens": opts.max_tokens,
        },
        "seed": opts.seed,
        "steps": step,
        "stopped_by": stopped_by,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "metrics": final,
        "elapsed_s": round(time.monotonic() - start, 1),
        "versions": versions(),
    }
    png = work / "training-curve.png"
    _plot(curve, png)
    save_head(out, head, config, manifest, {"training-curve.png": png})
    console.info(f"wrote {out} ({step} steps, held-out acceptance length {final['held_out_acceptance_length']:.2f})")
    return DistillResult(out, step, final, curve, stopped_by)


def _variants(n_prompts: int, train_idx: list[int], opts: DistillOptions) -> list[tuple[int, SamplingParams | None]]:
    """(prompt index, sampling) per response to generate: every prompt's greedy response first,
    then samples_per_prompt - 1 sampled responses per training prompt, each with its own seed."""
    out: list[tuple[int, SamplingParams | None]] = [(i, None) for i in range(n_prompts)]
    for j in range(1, opts.samples_per_prompt):
        for i in train_idx:
            seed = (opts.seed * 1_000_003 + i * 1009 + j) % 2**63
            out.append((i, SamplingParams(temperature=opts.temperature, top_p=0.95, seed=seed)))
    return out


def _generate(
    loaded: LoadedSpec,
    target: TorchEngine,
    tok,
    prompts: list[str],
    variants: list[tuple[int, SamplingParams | None]],
    max_tokens: int,
    log: Path,
) -> tuple[list[list[int]], list[GenerationRequest]]:
    """The target's responses (output ids) and their requests, one per variant; finished
    responses are kept in ``log`` as they come, so an interrupted run (Ctrl-C, --time-budget, a crash) continues
    where it stopped. Sampled responses only vary the contexts: every label is the target's
    greedy next token, what the head must predict at inference."""
    limits = Limits.from_spec(loaded.spec, target.vocab_size)
    end_ids = end_token_ids(tok, target.folder)
    encoded = []
    for n, p in enumerate(prompts, start=1):
        ids = encode_prompt(tok, p, loaded.spec.verify.chat_template)
        if min(max_tokens, limits.max_seq_len - len(ids)) < 1:
            raise SpecError(f"--prompts: prompt {n} has {len(ids)} tokens, no room below max_seq_len; shorten it")
        encoded.append(ids)
    reqs = []
    for i, sampling in variants:
        ids = encoded[i]
        budget = min(max_tokens, limits.max_seq_len - len(ids))
        reqs.append(make_request(ids, budget, 0, limits, end_ids, sampling=sampling))
    t0 = time.monotonic()

    first: list[int] = []

    def progress(done: int, total: int) -> None:
        if not first:  # the call before any batch: responses found in the log, not timed here
            first.append(done)
            if done:
                console.info(f"target responses {done}/{total} found in {log}")
            return
        eta = (time.monotonic() - t0) / (done - first[0]) * (total - done)
        console.info(f"target responses {done}/{total}  ETA {eta:.0f}s")

    with console.step(f"generating {len(reqs)} target responses to {len(prompts)} prompts"):
        outs = responses(target, reqs, progress, log)
    return outs, reqs


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
    elif (work / f"data-{key}.pt").is_file():  # format 1 held every feature in RAM
        console.info(f"{work / f'data-{key}.pt'} is an older in-memory capture, no longer read (delete it to free the space)")
    return store


def _capture(
    target: TorchEngine, reqs: list[GenerationRequest], outs: list[list[int]], work: Path, key: str, inputs: dict
) -> FeatureStore:
    """Teacher-forced features and labels of every response, streamed to the work folder one
    sequence at a time (only the store's index stays in RAM)."""
    t0 = time.monotonic()

    def captured():
        for n, (r, o) in enumerate(zip(reqs, outs), start=1):
            yield capture(target, r.prompt_ids, o)
            if n % 100 == 0 and n < len(reqs):
                eta = (time.monotonic() - t0) / n * (len(reqs) - n)
                console.info(f"captured {n}/{len(reqs)} sequences  ETA {eta:.0f}s")

    with console.step(f"capturing features and labels of {len(reqs)} sequences to {work}"):
        return write_store(work, key, inputs, captured())


def _evaluate(head: Eagle3Head, embed, batches, steps: int, cos, sin) -> dict:
    was = head.training
    head.eval()
    a = agreement(head, embed, batches, steps, cos, sin)
    head.train(was)
    return {"held_out_top1": a["top1"], "held_out_acceptance_length": a["acceptance_length"], "held_out_chains": a["chains"]}


@contextmanager
def _deferred_interrupt():
    """The first Ctrl-C only asks the loop to stop at the next step boundary; a second one
    interrupts at once. Outside the main thread, signals stay as they are."""
    asked = {"flag": False}
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def handler(signum, frame):
        if asked["flag"]:
            raise KeyboardInterrupt
        asked["flag"] = True
        console.info("stopping after this step (Ctrl-C again to stop now)")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: asked["flag"]
    finally:
        signal.signal(signal.SIGINT, previous)


def _checkpoint_bytes(head, optim, step, curve, key, seed) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {
            "head": head.state_dict(),
            "optim": optim.state_dict(),
            "step": step,
            "curve": json.dumps(curve),
            "key": key,
            "seed": seed,
        },
        buf,
    )
    return buf.getvalue()


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
