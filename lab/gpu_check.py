"""`make gpu-check`: what the torch reference engine costs on this GPU, in a few minutes, then
the CUDA tests (pytest -m cuda).

Nothing is downloaded and no checkpoint is read: each target is a Llama of a realistic shape
(1B-class: Llama-3.2-1B's; 8B-class: Llama-3.1-8B's) built from a transformers LlamaConfig with
random weights made directly on the GPU in bfloat16, loaded into trtspec's TorchEngine as a
built engine would be; the EAGLE-3 head is a random head of that target's shape. Costs do not
depend on the weights' values (no sparsity, no early exit), so random weights measure them.

Measured per shape, at a context of CONTEXT cached positions (each the best of REPEATS calls
after a warm one; every timed call ends by reading its logits or draft ids on the CPU, so the
GPU's queued work is inside the time):
  decode    one target forward of 1 new token (TorchEngine.run: logits copied to the CPU)
  verify k  one forward of k + 1 new tokens, k = 1..7, in decode steps (what a speculative step
            costs the target)
  head c    one EAGLE-3 head step (extend by one position + argmax over the draft vocabulary),
            in decode steps
  tok/s     decode steps of B rows at once (B = 1, 8, 32): B / step time

Projection (labelled so, never a measurement): with per-position acceptance a_1..a_k passed
on the command line (acceptance does not depend on the device: `trtspec distill` measures it
on CPU), the speedup bound of drafting k tokens is
    (1 + a_1 + a_1 a_2 + ... + a_1...a_k) / (verify(k) + k c)
(distill/costs.py recommend_k), and the k distill would recommend from them is the projected pair
(the shortest k within 2% of the highest bound).

Goals (issue 25), checked for the 8B-class shape at batch 1: verify(k) <= 1.1 decode steps for
k + 1 <= 8 tokens, and c <= 0.05.

Exit: 0 measured and the CUDA tests passed; 1 a CUDA test failed; 2 no usable CUDA GPU here.

Usage:
  python -m lab.gpu_check --acceptance 0.8,0.7,0.6,0.55 --json lab/results/gpu-check.json
  python -m lab.gpu_check --shapes 8b --no-tests
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lab._common import ROOT, command_line, write_result

CONTEXT = 128
REPEATS = 9
KS = tuple(range(1, 8))  # verify of k + 1 tokens
BATCHES = (1, 8, 32)
DRAFT_VOCAB = 32000  # the EAGLE-3 heads published for Llama-3.1-8B use a 32k draft vocabulary
BUDGET_S = 480  # the whole check (measurements and tests) within 8 minutes
GOAL_VERIFY = 1.1  # verify(k) in decode steps, k + 1 <= 8, batch 1, 8B-class
GOAL_HEAD = 0.05  # c in decode steps

# Llama shapes (config.json of the public checkpoints); vocab 128256, 8 KV heads.
SHAPES: dict[str, dict] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # for tests of this script on CPU only
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
}  # fmt: skip


def hf_config(shape: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        **SHAPES[shape],
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


@dataclass
class Pair:
    """A random target engine and a random EAGLE-3 head next to it."""

    engine: object  # TorchEngine
    head: object  # HeadEngine
    parameters: int


def random_pair(shape: str, device: torch.device, dtype: torch.dtype, slots: int, max_seq: int) -> Pair:
    """Target and head with random weights made on ``device`` in ``dtype`` (no files)."""
    from trtspec.engines.eagle3_checkpoint import distill_layer_ids, head_config_dict, head_config_from_dict
    from trtspec.engines.manifest import Manifest
    from trtspec.engines.torch.eagle3_head import Eagle3Head, HeadEngine
    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.engines.torch.model import DecoderConfig, DecoderLM, RMSNorm

    hf = hf_config(shape)
    cfg = DecoderConfig.from_hf(hf)
    names = {v: k for k, v in {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}.items()}
    gen_dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)  # parameters are made in the engine dtype: no float32 copy of 8B weights
        with device:
            model = DecoderLM(cfg).eval()
            head_cfg = head_config_from_dict(
                head_config_dict(hf, distill_layer_ids(cfg.num_layers), min(DRAFT_VOCAB, cfg.vocab_size)), cfg.num_layers
            )
            head = Eagle3Head(head_cfg).eval()
    finally:
        torch.set_default_dtype(gen_dtype)
    with torch.no_grad():
        for module in [*model.modules(), *head.modules()]:
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)  # made with torch.empty: any bits
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    parameters = sum(p.numel() for p in model.parameters())
    model.requires_grad_(False)
    head.requires_grad_(False)
    model.fuse_projections()
    limits = {"max_batch_size": slots, "max_input_len": max_seq - 1, "max_seq_len": max_seq}
    manifest = Manifest.model_construct(role="target", dtype=names[dtype], max_draft_len=max(KS), limits=limits)
    engine = TorchEngine(Path("<random>"), manifest, model, hf, slots, max_seq, device)
    head_engine = HeadEngine(head, model.model.embed_tokens, engine.cos, engine.sin, max_seq, dtype, 1)
    return Pair(engine, head_engine, parameters)


def measure(pair: Pair, repeats: int = REPEATS, ks=KS, batches=BATCHES, context: int = CONTEXT) -> dict:
    """Decode, verify(k), head c and tokens/s at each batch size (see the module doc)."""
    from trtspec.distill.costs import best_seconds  # each timed call ends on the CPU (a sync)
    from trtspec.engines.torch.eagle3_head import HeadRow
    from trtspec.engines.torch.engine import ForwardItem

    engine, head = pair.engine, pair.head
    vocab = engine.vocab_size
    ctxs = [[(7 * j + 13 * i) % (vocab - 16) + 1 for j in range(context)] for i in range(max(batches))]
    flip = [0]

    def forward(rows: int, n_new: int):
        def run():
            flip[0] ^= 1  # another token each time: each row keeps its context, recomputes n_new positions
            engine.run([ForwardItem(ctxs[i] + [3 + flip[0] + j for j in range(n_new)], n_new) for i in range(rows)])

        return run

    engine.forget_prefixes()
    engine.run([ForwardItem(c, 1) for c in ctxs[: max(batches)]])  # every row's context cached
    decode = best_seconds(forward(1, 1), repeats)
    verify = {k: best_seconds(forward(1, k + 1), repeats) for k in ks}
    per_batch = {b: best_seconds(forward(b, 1), repeats) for b in batches}
    hidden = head.cfg.hidden_size
    head.extend([HeadRow(0, 0, torch.zeros(context, hidden), ctxs[0])])
    state = torch.zeros(1, hidden, device=head.device)

    def head_step():
        out = head.extend([HeadRow(0, context, state, [5])])  # rewritten in place each time
        head.next_ids(out[0][-1:])

    c = best_seconds(head_step, repeats)
    return {
        "parameters": pair.parameters,
        "decode_ms": round(decode * 1e3, 3),
        "verify_ms": {str(k): round(v * 1e3, 3) for k, v in verify.items()},
        "verify": {str(k): round(v / decode, 3) for k, v in verify.items()},
        "head_ms": round(c * 1e3, 3),
        "head": round(c / decode, 4),
        "tokens_per_s": {str(b): round(b / s, 1) for b, s in per_batch.items()},
    }


def parse_acceptance(text: str | None, depth: int = max(KS)) -> list[float] | None:
    """Per-position acceptance a_1..a_k: one figure (the same at every position) or a list."""
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"--acceptance takes rates in [0, 1], one or per position (e.g. 0.7 or 0.8,0.7,0.6), not {text!r}")
    return values if len(values) > 1 else values * depth


def projection(costs: dict, acceptance: list[float]) -> dict:
    """The speedup bound per k from measured costs and the given acceptance (a projection)."""
    from trtspec.distill.costs import recommend_k

    verify = [costs["verify"][str(k)] for k in sorted(int(k) for k in costs["verify"])]
    k, bounds = recommend_k(acceptance, {"verify": verify, "head": costs["head"]})
    return {
        "label": "projection (not a measurement): measured costs x the acceptance given",
        "acceptance": acceptance[: len(bounds)],
        "bound": {str(i + 1): b for i, b in enumerate(bounds)},
        "best_k": k,
        "speedup": bounds[k - 1] if k else 1.0,
    }


def goals(costs: dict) -> dict:
    worst = max(costs["verify"].values())
    return {
        "verify_le_1.1_decode_steps": {"value": worst, "met": worst <= GOAL_VERIFY},
        "head_le_0.05_target_step": {"value": costs["head"], "met": costs["head"] <= GOAL_HEAD},
    }


def table(report: dict) -> list[str]:
    """The report as one plain-text table (and its projection lines)."""
    ks = sorted({int(k) for s in report["shapes"].values() for k in s["verify"]})
    bs = sorted({int(b) for s in report["shapes"].values() for b in s["tokens_per_s"]})
    head = ["shape", "params", "decode ms"] + [f"v(k={k})" for k in ks] + ["head c"] + [f"tok/s b={b}" for b in bs]
    rows = [head]
    for name, s in report["shapes"].items():
        rows.append(
            [name, f"{s['parameters'] / 1e9:.2f}B", f"{s['decode_ms']:.2f}"]
            + [f"{s['verify'][str(k)]:.2f}" for k in ks]
            + [f"{s['head']:.3f}"]
            + [f"{s['tokens_per_s'][str(b)]:.0f}" for b in bs]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"trtspec gpu-check: {report['machine']['line']}"]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    lines.append(
        f"(v: verify of k+1 tokens in decode steps; head c in decode steps; context {report['context']}; {report['dtype']})"
    )
    for name, s in report["shapes"].items():
        p = s.get("projection")
        if p:
            lines.append(
                f"{name} PROJECTION (not measured): acceptance {'/'.join(f'{a:.2f}' for a in p['acceptance'])} -> "
                + (f"k={p['best_k']}, speedup bound {p['speedup']:.2f}x" if p["best_k"] else "no k beats target-only")
            )
        if "goals" in s:
            lines.append(
                f"{name} goals: "
                + "; ".join(f"{g} {v['value']} {'met' if v['met'] else 'NOT met'}" for g, v in s["goals"].items())
            )
    return lines


def machine(device: torch.device) -> dict:
    from trtspec import __version__
    from trtspec.device import describe

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    cuda = torch.version.cuda or "none"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": cuda,
        "trtspec": __version__,
        "line": f"{describe(device)}, torch {torch.__version__}, CUDA {cuda}",
    }


def run_shapes(shapes: list[str], device: torch.device, dtype: torch.dtype, acceptance=None, repeats: int = REPEATS) -> dict:
    report = {"machine": machine(device), "dtype": str(dtype).removeprefix("torch."), "context": CONTEXT, "shapes": {}}
    for shape in shapes:
        t0 = time.monotonic()
        pair = random_pair(shape, device, dtype, slots=max(BATCHES), max_seq=CONTEXT + 16)
        costs = measure(pair, repeats)
        del pair
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next shape (and the tests) get the memory back
        costs["seconds"] = round(time.monotonic() - t0, 1)
        if acceptance:
            costs["projection"] = projection(costs, acceptance)
        if shape == "8b":
            costs["goals"] = goals(costs)
        report["shapes"][shape] = costs
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated: 1b, 8b")
    ap.add_argument("--acceptance", help="per-position acceptance for the projection: 0.7 or 0.8,0.7,0.6 (from trtspec distill)")
    ap.add_argument("--device", default="cuda", help="cuda or cuda:N")
    ap.add_argument("--json", type=Path, default=ROOT / "lab" / "results" / "gpu-check.json")
    ap.add_argument("--no-tests", action="store_true", help="skip pytest -m cuda")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check (the tests get what is left)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    from trtspec.device import resolve
    from trtspec.errors import TrtspecError

    try:
        device = resolve(args.device)
        if device.type != "cuda":
            raise TrtspecError(f"--device {args.device}: gpu-check measures a GPU; pass cuda or cuda:N")
    except TrtspecError as e:
        print(f"Error: gpu-check needs a CUDA GPU: {e}", file=sys.stderr)
        return 2
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in ("1b", "8b")]
    if unknown or not shapes:
        print(f"Error: --shapes takes 1b and/or 8b, not {args.shapes!r}", file=sys.stderr)
        return 2
    try:
        acceptance = parse_acceptance(args.acceptance)
    except ValueError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    report = run_shapes(shapes, device, torch.bfloat16, acceptance)
    rc = 0
    if not args.no_tests:
        left = max(60, int(args.budget - (time.monotonic() - start)))
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
        print(f"running {' '.join(cmd[2:])} (at most {left} s)", file=sys.stderr)
        try:
            rc = subprocess.run(cmd, cwd=ROOT, timeout=left, env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        report["tests"] = {"command": " ".join(cmd[2:]), "returncode": rc}
    report["seconds"] = round(time.monotonic() - start, 1)
    print("\n".join(table(report)))
    write_result(args.json, command_line("gpu_check.py", argv), report, machine=report["machine"]["line"])
    print(f"wrote {args.json}", file=sys.stderr)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
