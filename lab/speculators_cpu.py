"""Run speculators' EAGLE-3 trainer on a CPU: `speculators train ARGS`, with the few places that
assume an accelerator redirected at import time (nothing in site-packages is edited).

Runs INSIDE speculators' own environment (`make distill-peers` creates .venv-speculators), as

    .venv-speculators/bin/python -m lab.speculators_cpu prepare ROWS.jsonl DATA_DIR
    .venv-speculators/bin/python -m lab.speculators_cpu train --data-path DATA_DIR ...

``prepare`` writes the rows lab/distill_peers.py exported (input_ids, loss_mask per line) as
the Arrow dataset `speculators train` reads (its `prepare-data` output: input_ids, loss_mask,
seq_len). ``train`` is speculators' own command line; what is redirected, and why:

- the trainer moves the model and every batch to device ``local_rank`` (0: cuda:0): to "cpu";
- its autocast names the accelerator's type, "cuda" when there is none: "cpu" (bfloat16);
- its step timer and memory gauge call torch.accelerator.synchronize / memory_allocated: no-ops
  without an accelerator;
- its checkpointer's get_current_device() falls back to "cuda:0": "cpu".
FlexAttention (no CPU backward) and the Triton loss are avoided with speculators' own flags
(--draft-attn-impl sdpa --loss-implementation eager), which distill_peers.py passes.

With ``--hidden-states-dtype float32`` (its setting for compute without bfloat16; distill_peers.py
--peer-dtype float32) one more place is redirected: torch's Muon orthogonalizes each update in
bfloat16 whatever the parameters' dtype, which a CPU without bf16 instructions runs about 40x
slower (48 s of a 56 s step on the demo's data); the same Newton-Schulz iteration runs in
float32 instead (``_orthogonalize_float32``).
"""

from __future__ import annotations

import json
import sys


def _cpu_patches() -> None:
    import torch

    if torch.accelerator.current_accelerator() is not None:
        return  # a real accelerator: nothing to redirect
    torch.accelerator.synchronize = lambda *a, **k: None
    torch.accelerator.memory_allocated = lambda *a, **k: 0

    import speculators.train.checkpointer as checkpointer
    import speculators.train.trainer as trainer
    import speculators.utils.util as util

    util.get_current_device = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    original_init = trainer.Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.local_rank = "cpu"  # .to(local_rank) everywhere: the model and each batch
        self.device_type = "cpu"  # torch.autocast(device_type, bfloat16)

    trainer.Trainer.__init__ = init
    trainer.get_local_rank = lambda: "cpu"


def _orthogonalize_float32(grad, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float):
    """Muon's quintic Newton-Schulz orthogonalization of a 2D update, in float32: scaled to
    spectral norm <= 1, then X <- aX + (bXX^T + c(XX^T)^2)X, on the wide orientation."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def _float32_muon() -> None:
    import torch.optim._muon as muon

    muon._zeropower_via_newtonschulz = _orthogonalize_float32


def prepare(rows_path: str, out: str) -> None:
    from datasets import Dataset

    rows = [json.loads(line) for line in open(rows_path, encoding="utf-8")]
    data = {
        "input_ids": [r["input_ids"] for r in rows],
        "loss_mask": [r["loss_mask"] for r in rows],
        "seq_len": [len(r["input_ids"]) for r in rows],
    }
    Dataset.from_dict(data).with_format("torch").save_to_disk(out)


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "prepare":
        prepare(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "train":
        _cpu_patches()
        args = sys.argv[2:]
        if "--hidden-states-dtype" in args and args[args.index("--hidden-states-dtype") + 1 :][:1] == ["float32"]:
            _float32_muon()
        from speculators.train.cli import main as train
        from speculators.train.config import TrainConfig

        train(TrainConfig.resolve(sys.argv[2:]))
        return
    raise SystemExit("usage: speculators_cpu.py prepare ROWS.jsonl DATA_DIR | train SPECULATORS-TRAIN-ARGS")


if __name__ == "__main__":
    main()
