"""Run SpecForge's EAGLE-3 trainer on a CPU: `specforge train|export ARGS`, with the one place that
needs a GPU replaced at import time (nothing in site-packages is edited).

Runs INSIDE SpecForge's own environment (`make specforge` creates .venv-specforge), as

    .venv-specforge/bin/python -m lab.specforge_cpu train --config RUN.json
    .venv-specforge/bin/python -m lab.specforge_cpu export --to sglang --checkpoint OUT ...

The arguments are SpecForge's own command line. What is replaced, and why:

- ``specforge.core.loss`` imports Triton and computes its forward KL with a Triton kernel (no
  CPU backend): it is replaced by a module whose ``LogSoftmaxLoss`` computes the same loss in
  plain PyTorch, -sum_v p_target(v) log softmax(logits)(v) per position, zero where the position
  mask is 0, averaged over all batch x time positions (autograd gives the gradient).

Everything else SpecForge needs on a CPU is its own configuration, which lab/distill_peers.py
writes: offline features (no SGLang), ``training.attention_backend: sdpa``,
``training.fsdp_sharding: NO_SHARD`` (DDP on the gloo backend), features in bfloat16.
"""

from __future__ import annotations

import sys
import types


def forward_kl(logits, target_p, position_mask):
    """SpecForge's KL loss: logits [B, T, V], target_p [B, T, V] (the target's distribution over
    the draft vocabulary), position_mask [B, T, 1]; a scalar."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    per_position = -(target_p.float() * logp).sum(-1)  # [B, T]
    mask = position_mask.reshape(per_position.shape).to(per_position.dtype)
    return (per_position * mask).mean()


class LogSoftmaxLoss:
    """The name SpecForge's EAGLE-3 model calls (``LogSoftmaxLoss.apply(logits, target_p, mask)``)."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        return forward_kl(logits, target_p, position_mask)


def _cpu_patches() -> None:
    import torch

    if torch.accelerator.current_accelerator() is not None:
        return  # a real accelerator: SpecForge's own Triton loss runs
    import specforge.core  # the package first, so the submodule below is its loss module

    loss = types.ModuleType("specforge.core.loss")
    loss.LogSoftmaxLoss = LogSoftmaxLoss
    loss.forward_kl = forward_kl
    sys.modules["specforge.core.loss"] = loss
    specforge.core.loss = loss


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("train", "export"):
        raise SystemExit("usage: specforge_cpu.py train --config RUN.json | export SPECFORGE-EXPORT-ARGS")
    _cpu_patches()
    from specforge.cli import main as specforge

    return specforge(argv)


if __name__ == "__main__":
    raise SystemExit(main())
