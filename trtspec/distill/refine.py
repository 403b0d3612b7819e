"""`trtspec distill SPEC --from-capture DIR --init HEAD`: continue a head on the traffic its
deployment served (serve.capture, docs/capture.md), mixed with a replay share of its original
data so it does not forget, and score the old and the new head side by side.

What is never trained on: the newest captured requests (--capture-held-out, the held-out
figures), any captured request whose prompt is a held-out one or one of the spec's verify
prompts (the other figures). The original data is the init head's own distill data (its
manifest's recipe, from its work folder, generated again where that is gone); a head without
a distill manifest replays the data distill would make for this spec.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from trtspec import console
from trtspec.distill.heads import HEAD_MANIFEST, HEAD_WEIGHTS, refuse_existing, save_head
from trtspec.distill.options import DistillOptions, resolve
from trtspec.distill.run import Prepared, head_destination, prepare, recipe_key, work_folder, work_lock
from trtspec.distill.sample import Sample
from trtspec.distill.trainer import Trainer
from trtspec.engines.eagle3_checkpoint import read_head_config
from trtspec.engines.manifest import versions
from trtspec.engines.torch.eagle3_head import Eagle3Head
from trtspec.errors import SpecError, TrtspecError
from trtspec.spec import LoadedSpec
from trtspec.speculative.capture import Captured, read_capture


@dataclass
class RefineResult:
    head: Path
    steps: int
    old: dict  # acceptance at k=1: {"held_out_captured": x, "verify_prompts": y, "unseen_prompts": z}
    new: dict
    held_requests: list[str] = field(default_factory=list)  # the captured requests never trained on

    def to_dict(self) -> dict:
        return {**asdict(self), "head": str(self.head)}

    def summary(self) -> str:
        rows = [f"{'acceptance at k=1':<34}{'old head':>10}{'new head':>10}"]
        sets = [("held_out_captured", "held-out captured requests"), ("verify_prompts", "spec's verify prompts")]
        if self.old["unseen_prompts_n"] > self.old["verify_prompts_n"]:  # the recipe's eval prompts too
            sets.append(("unseen_prompts", "verify + eval prompts"))
        for key, label in sets:
            name = f"{label} ({self.old[key + '_n']})"
            rows.append(f"{name:<34}{_fmt(self.old[key]):>10}{_fmt(self.new[key]):>10}")
        return f"wrote {self.head} ({self.steps} steps)\n" + "\n".join(rows)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def refine(loaded: LoadedSpec, opts: DistillOptions, on_step=None) -> RefineResult:
    """Continue ``opts.init`` on ``opts.from_capture``'s requests and write the new head."""
    start = time.monotonic()
    opts, _ = resolve(loaded, opts)
    init, out = _paths(loaded, opts)
    train_c, held_c = split_captured(read_capture(opts.from_capture), opts.capture_held_out, opts.from_capture)
    original = _original_recipe(init, opts)
    with work_lock(work_folder(init)):  # its data is read (or made again) there
        data = prepare(loaded, original, work_folder(init))
    head, config, draft_ids = load_head(init, data)
    old_head, _, _ = load_head(init, data)
    held_s = [c.sample for c in held_c]
    train_s = trainable(train_c, held_s + data.unseen, data)
    replayed = replay_samples(data.train, len(train_s), opts.replay, opts.seed)
    steps = opts.ttt_steps or max(1, loaded.spec.speculative.default_draft_tokens)
    key = hashlib.sha256(json.dumps([c.path.name for c in train_c]).encode()).hexdigest()[:16]
    target = reaching(data.target, data.target_hf, max(len(s.tokens) for s in train_s + held_s))
    with work_lock(work_folder(out)):
        trainer = Trainer(head, target, draft_ids, opts, steps, data.store)
        step, _, stopped_by = trainer.fit(
            train_s + replayed,
            held_s,
            work_folder(out) / "checkpoint.pt",
            f"capture:{key}+{recipe_key(opts, steps)}",
            start,
            on_step,
        )
        if step == 0:
            raise TrtspecError(
                f"the time budget ({opts.time_budget:g} s) was spent before the first training step; no head written"
            )
        n_verify = len(dict.fromkeys(loaded.verify_prompts()))  # data.unseen: the verify prompts, then eval's
        new = figures(trainer, held_s, data.unseen, n_verify)
        old = figures(Trainer(old_head, target, draft_ids, opts, steps, data.store), held_s, data.unseen, n_verify)
    held_ids = [c.record.get("request_id", c.path.name) for c in held_c]
    manifest = _manifest(init, opts, step, steps, stopped_by, old, new, held_ids, len(train_s), len(replayed))
    save_head(out, head, config, manifest)
    console.info(f"continued {init} on {len(train_s)} captured requests and {len(replayed)} replayed sequences")
    return RefineResult(out, step, old, new, held_ids)


def _paths(loaded: LoadedSpec, opts: DistillOptions) -> tuple[Path, Path]:
    """(the init head, where the new one goes), each checked."""
    if opts.init is None or opts.from_capture is None:
        raise SpecError("--from-capture and --init go together: the captured folder and the head to continue")
    init = Path(opts.init).expanduser().resolve()
    if not (init / HEAD_WEIGHTS).is_file() or not (init / "config.json").is_file():
        raise SpecError(
            f"--init: {init} is not an EAGLE-3 head folder (config.json and {HEAD_WEIGHTS}); pass a head distill wrote"
        )
    if not Path(opts.from_capture).is_dir():
        raise SpecError(f"--from-capture: {opts.from_capture} is not a folder; pass serve.capture's dir")
    out = head_destination(loaded, opts.output).resolve()
    if out == init:
        raise SpecError(f"--init {init} is also where the new head would go; write the new head elsewhere with -o NEW")
    refuse_existing(out, opts.force)
    return init, out


def split_captured(captured: list[Captured], fraction: float, folder) -> tuple[list[Captured], list[Captured]]:
    """(train, held out): the newest ``fraction`` of the captured requests (at least one) are held out."""
    held_n = max(1, math.ceil(fraction * len(captured)))
    if len(captured) - held_n < 1:
        raise SpecError(
            f"--from-capture: {folder} holds {len(captured)} whole captured request(s); at least 2 are needed "
            "(the newest are held out); serve more requests with serve.capture on"
        )
    return captured[:-held_n], captured[-held_n:]


def trainable(train: list[Captured], kept_out: list[Sample], data: Prepared) -> list[Sample]:
    """The captured samples to train on: checked against the target, none whose prompt is one
    of ``kept_out``'s (a held-out request's, a verify prompt's)."""
    width = len(data.layer_ids) * data.target.config.hidden_size
    prompts = {tuple(s.tokens[: s.prompt_len].tolist()) for s in kept_out}
    out = []
    for c in train:
        s = c.sample
        if s.features.shape[-1] != width or int(s.tokens.max()) >= data.target.vocab_size:
            raise SpecError(
                f"--from-capture: {c.path} was captured from another target or other feature layers "
                f"({s.features.shape[-1]} features a token, this head reads {width}); capture again or pass its own folder"
            )
        if tuple(s.tokens[: s.prompt_len].tolist()) not in prompts:
            out.append(s)
    if not out:
        raise SpecError("--from-capture: every captured request repeats a held-out or verify prompt; nothing to train on")
    return out


def replay_samples(original: list[Sample], captured: int, share: float, seed: int) -> list[Sample]:
    """Sequences of the original data making ``share`` of the training set beside ``captured``
    captured ones (as many as there are, at most), chosen by ``seed``."""
    if share <= 0 or not original:
        return []
    want = min(len(original), round(share / (1 - share) * captured))
    order = torch.randperm(len(original), generator=torch.Generator().manual_seed(seed)).tolist()
    return [original[i] for i in sorted(order[:want])]


@dataclass
class _TrainTarget:
    """What Trainer reads of the target (its embeddings, RoPE tables, vocabulary, device), with
    RoPE tables as long as the captured requests: distill sized the engine to its own data."""

    model: object
    cos: torch.Tensor
    sin: torch.Tensor
    vocab_size: int
    device: torch.device


def reaching(t, hf_config, positions: int) -> _TrainTarget:
    """The target engine ``t`` as Trainer reads it, its RoPE tables ``positions`` long at least."""
    from trtspec.engines.torch.model import rope_tables

    cos, sin = (x.to(t.device) for x in rope_tables(hf_config, max(positions, t.max_seq_len)))
    return _TrainTarget(t.model, cos, sin, t.vocab_size, t.device)


def _original_recipe(init: Path, opts: DistillOptions) -> DistillOptions:
    """The recipe the init head was distilled with (its manifest), else ``opts``."""
    path = init / HEAD_MANIFEST
    if not path.is_file():
        console.info(f"{init} has no distill manifest: replaying the data distill makes for this spec")
        return opts
    try:
        recipe = json.loads(path.read_text(encoding="utf-8"))["recipe"]
        return opts.model_copy(update=DistillOptions(**recipe).model_dump(include=set(recipe)))
    except (ValueError, KeyError, TypeError) as e:
        raise SpecError(f"--init: {path} does not hold a distill recipe ({e}); pass a head distill wrote") from None


def load_head(init: Path, data: Prepared) -> tuple[Eagle3Head, dict, list[int]]:
    """The init head, trainable in float32, its config.json and its draft vocabulary (target ids)."""
    return read_head(init, data.target_hf.num_hidden_layers, tuple(data.layer_ids), data.target.vocab_size)


def read_head(init: Path, num_layers: int, layer_ids: tuple[int, ...], vocab: int) -> tuple[Eagle3Head, dict, list[int]]:
    """A head folder (distill's, or a built head engine) for training or scoring in float32."""
    from safetensors.torch import load_file

    cfg = read_head_config(init, num_layers)
    if tuple(cfg.layer_ids) != tuple(layer_ids) or cfg.vocab_size != vocab:
        raise SpecError(
            f"{init} is a head for layers {list(cfg.layer_ids)} of a {cfg.vocab_size}-token target; this spec's head "
            f"reads layers {list(layer_ids)} of a {vocab}-token one: pass a head made for this spec"
        )
    head = Eagle3Head.from_state_dict(cfg, load_file(str(init / HEAD_WEIGHTS))).float()
    for p in head.parameters():
        p.requires_grad_(True)
    draft_ids = (torch.arange(cfg.draft_vocab_size) + head.d2t).tolist()
    return head, json.loads((init / "config.json").read_text(encoding="utf-8")), draft_ids


def figures(trainer: Trainer, held: list[Sample], unseen: list[Sample], n_verify: int) -> dict:
    """Acceptance at k=1 (the first draft kept, as distill scores heads) on the held-out
    captured requests, on the spec's verify prompts (the first ``n_verify`` of ``unseen``) and
    on every unseen prompt (the verify prompts and the recipe's eval prompts)."""

    def k1(samples: list[Sample]) -> float | None:
        if not samples:
            return None
        accepted = trainer.evaluate(samples, 1)["accepted"]
        return float(accepted[0]) if accepted else None

    return {
        "held_out_captured": k1(held),
        "held_out_captured_n": len(held),
        "verify_prompts": k1(unseen[:n_verify]),
        "verify_prompts_n": len(unseen[:n_verify]),
        "unseen_prompts": k1(unseen),
        "unseen_prompts_n": len(unseen),
    }


def _manifest(init: Path, opts, step: int, steps: int, stopped_by: str, old, new, held_ids, n_train: int, n_replay: int) -> dict:
    path = init / HEAD_MANIFEST
    base = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"format": 2, "method": "eagle3"}
    return base | {
        "steps": step,
        "ttt_steps": steps,
        "stopped_by": stopped_by,
        "continued": {
            "init": str(init),
            "capture": str(Path(opts.from_capture).resolve()),
            "captured_trained": n_train,
            "replayed": n_replay,
            "replay": opts.replay,
            "held_requests": held_ids,  # never trained on: what refresh measures both heads on
        },
        "comparison": {"old": old, "new": new},  # acceptance at k=1
        "versions": versions(),
    }
