"""Training a head: the optimiser over what trains, the learning-rate schedule, the loop with
checkpoints and held-out evaluation, and the final report on unseen prompts.

What trains: ``fc``, the decoder layer and the output norm; the LM head is the target's,
frozen unless asked (EAGLE-1 freezes it; official EAGLE-3 trains its own only over ~800k
steps, far beyond what a CPU run sees). The token embeddings are the target's and never get a
gradient. Schedule: linear warmup, then cosine decay to a tenth of the peak.

Deterministic with a seed: the batch of step s is drawn from a generator seeded by (seed, s),
so a run resumed from its last checkpoint equals an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from trtspec import console
from trtspec.distill.data import collate
from trtspec.distill.sample import Sample
from trtspec.distill.ttt import add_feature_noise, agreement, step_weights, to_device, ttt_loss
from trtspec.engines.torch import threads
from trtspec.engines.torch.eagle3_head import Eagle3Head
from trtspec.errors import TrtspecError
from trtspec.files import write_bytes_atomic

MIN_EVAL_DEPTH = 3  # chains are scored at least this deep: per-position acceptance for choosing k


class Trainer:
    def __init__(self, head: Eagle3Head, target, draft_ids: list[int], opts, steps: int, store):
        self.head, self.opts, self.steps, self.store = head, opts, steps, store
        # Training runs where the target runs (its embeddings and RoPE tables are used as they
        # are); batches are collated on the CPU from the store and copied over one at a time.
        self.device = getattr(target, "device", torch.device("cpu"))
        head.to(self.device)
        self.embed, self.cos, self.sin = target.model.model.embed_tokens, target.cos, target.sin
        self.t2d = torch.full((target.vocab_size,), -1, dtype=torch.long)
        self.t2d[torch.tensor(draft_ids)] = torch.arange(len(draft_ids))
        self.t2d = self.t2d.to(self.device)
        head.lm_head.weight.requires_grad_(opts.train_lm_head)
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(self.params, lr=opts.lr, weight_decay=opts.weight_decay)
        # The weights the head starts from (a resumed run builds the same head first), for start_decay.
        self.start = [p.detach().clone() for p in self.params] if opts.start_decay > 0 else []
        # The recipe's ema: a running average of the weights, from the start's (what is evaluated and written).
        self.average = [p.detach().clone() for p in self.params] if opts.ema > 0 else []
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, self.lr_factor)
        self.weights = step_weights(steps, opts.step_decay)
        # The first ttt_phase of the steps train the first draft step alone (the depth-1 head,
        # cheaper), the rest every unrolled step: step 1 gets the depth-1 head's start, and the
        # later steps learn on states that already predict well.
        self.phase_steps = round(opts.ttt_phase * opts.max_steps) if steps > 1 else 0

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak learning rate at ``step`` (0-based)."""
        if self.opts.schedule == "constant":
            return 1.0
        warmup = max(1, round(self.opts.warmup * self.opts.max_steps))
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.opts.max_steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    def batches(self, samples: list[Sample]):
        """Evaluation batches, a training batch's size at a time (memory of one batch)."""
        for n in range(0, len(samples), self.opts.batch_size):
            yield to_device(collate(samples[n : n + self.opts.batch_size], self.opts.max_len, self.store), self.device)

    def evaluate(self, samples: list[Sample], depth: int) -> dict:
        was = self.head.training
        self.head.eval()
        with self._averaged():
            a = agreement(self.head, self.embed, self.batches(samples), depth, self.cos, self.sin)
        self.head.train(was)
        return a

    def step_loss(self, batch, step: int = -1, gen: torch.Generator | None = None) -> torch.Tensor:
        """The loss of training step ``step`` (0-based; -1: past any depth-1 phase); ``gen``
        draws its dropout masks (the recipe's dropout; none without it)."""
        soft = self.opts.labels == "soft"
        depth, weights = (1, [1.0]) if 0 <= step < self.phase_steps else (self.steps, self.weights)
        loss, _ = ttt_loss(
            self.head,
            self.embed,
            batch,
            depth,
            self.t2d,
            self.cos,
            self.sin,
            soft=soft,
            weights=weights,
            response_only=not self.opts.all_positions,
            reach=self.opts.ttt_reach,
            loss=self.opts.loss,
            dropout=self.opts.dropout if gen is not None else 0.0,
            gen=gen,
            temperature=self.opts.label_temperature,
        )
        return loss

    def fit(self, train_s, held_s, ckpt: Path, run_key: str, start: float, on_step=None):
        """Train until max_steps or the time budget; (steps done, curve, what stopped it)."""
        opts = self.opts
        step, curve = 0, []
        if opts.resume:
            step, curve = self._resume(ckpt, run_key)
        self.head.train()
        stopped_by = "max_steps"
        t_train, first_step = time.monotonic(), step
        updating = False  # True while the weights are half-updated: no checkpoint then
        soft = opts.labels == "soft"
        on_cpu = torch.device(self.device).type == "cpu"
        try:
            with _deferred_interrupt() as asked:
                while step < opts.max_steps:
                    if asked():  # Ctrl-C: stop at this step boundary, weights consistent
                        raise KeyboardInterrupt
                    if opts.time_budget is not None and time.monotonic() - start >= opts.time_budget:
                        stopped_by = "time_budget"
                        break
                    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
                    idx = torch.randint(len(train_s), (min(opts.batch_size, len(train_s)),), generator=gen).tolist()
                    batch = collate([train_s[i] for i in idx], opts.max_len, self.store, soft=soft)
                    batch = add_feature_noise(batch, opts.feature_noise, gen)  # the same generator: deterministic
                    # One thread count for every step, so a run's weights do not depend on timing
                    # (a resumed run equals an uninterrupted one); generation follows a neighbour.
                    with threads.governor().pinned() if on_cpu else contextlib.nullcontext():
                        loss = self.step_loss(to_device(batch, self.device), step, gen)
                        self.optim.zero_grad()
                        loss.backward()
                        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                        updating = True
                        self.optim.step()
                        self._pull_to_start()
                        self._update_average()
                    self.sched.step()
                    step += 1
                    updating = False
                    row = {"step": step, "loss": float(loss.detach()), "lr": self.optim.param_groups[0]["lr"]}
                    if step % opts.eval_every == 0 or step == opts.max_steps:
                        row.update(self._eval_row(held_s))
                        self._progress(row, step, first_step, t_train, start)
                    curve.append(row)
                    if step % opts.eval_every == 0:
                        write_bytes_atomic(ckpt, self._checkpoint(step, curve, run_key), durable=True)
                    if on_step:
                        on_step(row)
        except KeyboardInterrupt:
            if not updating:
                write_bytes_atomic(ckpt, self._checkpoint(step, curve, run_key), durable=True)
            console.info(f"interrupted: the last good checkpoint is in {ckpt}; finish with --resume")
            raise
        write_bytes_atomic(ckpt, self._checkpoint(step, curve, run_key), durable=True)
        self._set_weights(self.average)  # the head written is the average (a checkpoint keeps both)
        self.average = []
        self.head.eval()
        return step, curve, stopped_by

    @torch.no_grad()
    def _pull_to_start(self) -> None:
        """start_decay: each weight moves lr x start_decay of the way back to where it started."""
        if not self.start:
            return
        rate = self.optim.param_groups[0]["lr"] * self.opts.start_decay
        for p, p0 in zip(self.params, self.start, strict=True):
            p.add_(p0 - p, alpha=min(1.0, rate))

    @torch.no_grad()
    def _update_average(self) -> None:
        """ema: avg = D x avg + (1 - D) x weights, after each optimiser step."""
        for a, p in zip(self.average, self.params):
            a.lerp_(p, 1.0 - self.opts.ema)

    @contextmanager
    def _averaged(self):
        """The averaged weights in the head for the block's duration (the last weights otherwise)."""
        if not self.average:
            yield
            return
        last = [p.detach().clone() for p in self.params]
        self._set_weights(self.average)
        try:
            yield
        finally:
            self._set_weights(last)

    @torch.no_grad()
    def _set_weights(self, values: list[torch.Tensor]) -> None:
        """The trained weights set to ``values`` (in self.params' order; none: unchanged)."""
        for p, v in zip(self.params, values):
            p.copy_(v)

    def _eval_row(self, held_s) -> dict:
        a = self.evaluate(held_s, self.steps)
        return {"held_out_top1": a["top1"], "held_out_acceptance_length": a["acceptance_length"], "held_out_chains": a["chains"]}

    def _progress(self, row: dict, step: int, first_step: int, t_train: float, start: float) -> None:
        opts = self.opts
        eta = (time.monotonic() - t_train) / max(1, step - first_step) * (opts.max_steps - step)
        if opts.time_budget is not None:
            eta = min(eta, max(0.0, opts.time_budget - (time.monotonic() - start)))
        console.info(
            f"step {step}/{opts.max_steps}  loss {row['loss']:.3f}  held-out top-1 "
            + "/".join(f"{a:.2f}" for a in row["held_out_top1"])
            + f"  acceptance length {row['held_out_acceptance_length']:.2f}  ETA {eta:.0f}s"
        )

    def report(self, held_s: list[Sample], unseen_s: list[Sample]) -> dict:
        """Held-out figures at the trained depth; on the unseen prompts, per-position
        acceptance at least MIN_EVAL_DEPTH deep (what choosing k needs)."""
        final = self._eval_row(held_s)
        depth = max(self.steps, MIN_EVAL_DEPTH)
        none = {"top1": [], "acceptance_length": 1.0, "accepted": [], "top_r": [], "top_r_accepted": [], "chains": 0}
        none |= {"walk_length": [], "walk_accepted": [], "walk_forwards": []}
        u = self.evaluate(unseen_s, depth) if unseen_s else none
        final.update(
            unseen_top1=u["top1"],
            unseen_accepted=u["accepted"],
            unseen_acceptance_length=u["acceptance_length"],
            unseen_top_r=u["top_r"],  # per depth: P(the target's token among the head's top 1/2/3)
            unseen_top_r_accepted=u["top_r_accepted"],  # the same given depths before it were too
            unseen_chains=u["chains"],
            # as greedy generation drafts them, per k = 1..depth (ttt.agreement): what the bound uses
            unseen_walk_length=u["walk_length"],
            unseen_walk_accepted=u["walk_accepted"],
            unseen_walk_forwards=u["walk_forwards"],
        )
        return final

    def _checkpoint(self, step: int, curve: list, key: str) -> bytes:
        buf = io.BytesIO()
        state = {
            "head": self.head.state_dict(),
            "optim": self.optim.state_dict(),
            "sched": self.sched.state_dict(),
            "step": step,
            "curve": json.dumps(curve),
            "key": key,
            "seed": self.opts.seed,
            "average": self.average,
        }
        torch.save(state, buf)
        return buf.getvalue()

    def _resume(self, ckpt: Path, run_key: str) -> tuple[int, list]:
        state = read_checkpoint(ckpt)
        if state.get("key") != run_key or state.get("seed") != self.opts.seed or "sched" not in state:
            raise TrtspecError(
                f"--resume: {ckpt} was made with other data, seed or training options (--labels, the recipe); run without --resume"
            )
        self.head.load_state_dict(state["head"])
        self.optim.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        if self.average:
            with torch.no_grad():
                for a, saved in zip(self.average, state["average"], strict=True):
                    a.copy_(saved)
        console.info(f"resuming at step {state['step']}")
        return int(state["step"]), json.loads(state["curve"])


# What every checkpoint holds (Trainer._checkpoint); a file without them is not one of ours.
CHECKPOINT_KEYS = frozenset({"head", "optim", "sched", "step", "curve", "key", "seed", "average"})


def read_checkpoint(ckpt: Path) -> dict:
    """A training checkpoint's state; TrtspecError (exit 2) naming the file when it is torn,
    corrupt or not a distill checkpoint, instead of torch's or pickle's traceback."""
    try:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TrtspecError(f"--resume: no checkpoint at {ckpt}; run without --resume to start") from None
    except Exception as e:  # noqa: BLE001 - torn zip, bad pickle, wrong type: one answer for all
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TrtspecError(
            f"--resume: {ckpt} is torn or corrupt ({reason}); delete it and run without --resume to train from the start"
        ) from None
    if not isinstance(state, dict) or not CHECKPOINT_KEYS <= state.keys():
        raise TrtspecError(
            f"--resume: {ckpt} is not a distill checkpoint; delete it and run without --resume to train from the start"
        )
    return state


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
