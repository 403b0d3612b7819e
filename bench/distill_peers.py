"""trtspec's EAGLE-3 head side by side with the trainers users pick, on the same data.

    make distill-peers
    python bench/distill_peers.py SPEC --head HEAD [--epochs 4] [--out bench/results/distill-peers]

HEAD is a head `trtspec distill SPEC` wrote; its manifest names the data it was trained on
(prompts, seed, split, response length, layers). This script:

1. takes the SAME captured responses (distill's own capture in HEAD's work folder, made again
   if it is gone), the same training split, the same target layers and the same draft
   vocabulary (HEAD's d2t), and writes them in speculators' offline format: per training
   sequence `hidden_states/hs_{i}.safetensors` with `token_ids [T]` and `hidden_states
   [T, 4, hidden]` (bfloat16): the three layers the head reads, then the last layer's output
   (the teacher: speculators computes the target's distribution from it; checked: its argmax
   through the target's norm and LM head is the captured greedy label), and the Arrow rows
   (input_ids, loss_mask = response positions, seq_len);
2. trains speculators' EAGLE-3 head on it in speculators' own environment
   (bench/speculators_cpu.py), with speculators' documented defaults except where the shared
   data or the CPU forces a change (each named in the result's "hyperparameters");
3. scores every head on the same unseen prompts (the spec's verify prompts and HEAD's
   --eval-prompts, never trained on) through vLLM (.venv-vllm: bench/vllm_peer.py) at
   k = 1 and k = 3, and through trtspec: HEAD's figures from its manifest, speculators' head
   by the same code that wrote them (distill's Trainer.report over the same unseen samples:
   per-position acceptance at depth 3, acceptance length at k=3), after converting it to
   trtspec's head layout (``speculators_to_trtspec``). HEAD is scored again the same way and
   must give its manifest's figures: the check that the path is the one distill used.

The converter lives here, not in ``trtspec check``/``build``: only this comparison needs
speculators' layout (``layers.0.*`` names, a nested ``transformer_layer_config``, a copy of the
target's embeddings, ``t2d``); the product keeps one head format, the one TensorRT-LLM, vLLM
and SGLang load, whose optional norms (config keys and ``input_norm`` / ``fc_norm`` tensors
as speculators and vLLM name them) it runs.

CPU time of each trainer is the training process's user + system seconds (not wall time, which
depends on the machine's load). Writes OUT/distill-peers.json and prints it. Exit 2 on bad input
(no head manifest at HEAD, a missing environment).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import ROOT, command_line

SPECULATORS_PY = ROOT / ".venv-speculators" / "bin" / "python"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SPECULATORS_CPU = ROOT / "bench" / "speculators_cpu.py"
VLLM_PEER = ROOT / "bench" / "vllm_peer.py"
EXPORT_ROWS = 64  # sequences captured per batch of the export


def refuse(message: str) -> None:
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(2)


def distill_options(head: Path):
    """The DistillOptions HEAD was trained with (its manifest), output = HEAD."""
    from trtspec.distill.heads import HEAD_MANIFEST
    from trtspec.distill.run import DistillOptions

    saved = recipe_and_run(json.loads((head / HEAD_MANIFEST).read_text()))
    opts = DistillOptions(**{k: v for k, v in saved.items() if k in DistillOptions.model_fields})
    return opts.model_copy(update={"output": head, "force": True, "resume": False, "scaling": ()})


def export(spec: Path, head: Path, out: Path) -> dict:
    """The head's training data in speculators' offline format (module docstring, 1.)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from trtspec.distill.data import capture_batch
    from trtspec.distill.run import prepare, work_folder, work_lock
    from trtspec.spec import load_spec

    loaded = load_spec(spec)
    opts = distill_options(head)
    work = work_folder(head)
    with work_lock(work):
        data = prepare(loaded, opts, work)
    target, hf = data.target, data.target_hf
    last = hf.num_hidden_layers - 1
    layers = tuple(sorted(set(data.layer_ids) | {last}))
    target.capture_features(layers)
    pick = [layers.index(i) for i in data.layer_ids] + [layers.index(last)]  # the head's layers, then the teacher's
    hs = out / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    checked = mismatched = 0
    # The training sequences, then the held-out prompts' responses as speculators' validation
    # rows (its split is "the first fraction trains": the same sequences train as in trtspec).
    seqs = data.train + data.held
    with open(out / "rows.jsonl", "w", encoding="utf-8") as rows:
        for n in range(0, len(seqs), EXPORT_ROWS):
            part = seqs[n : n + EXPORT_ROWS]
            got = capture_batch(target, [s.tokens.tolist() for s in part], [s.response_mask() for s in part])
            for i, (s, c) in enumerate(zip(part, got), start=n):
                h = c.features.view(len(s.tokens), len(layers), -1)[:, pick]
                with torch.no_grad():  # the teacher: the last layer's output, before the final norm
                    teacher = target.model.lm_head(target.model.model.norm(h[:, -1].to(target.device))).argmax(-1).cpu()
                known = s.labels >= 0
                checked += int(known.sum())
                mismatched += int((teacher[known] != s.labels[known]).sum())
                save_file(
                    {"token_ids": s.tokens.clone(), "hidden_states": h.to(torch.bfloat16).contiguous()},
                    str(hs / f"hs_{i}.safetensors"),
                )
                rows.write(json.dumps({"input_ids": s.tokens.tolist(), "loss_mask": s.response_mask().long().tolist()}) + "\n")
    if mismatched > 0.01 * checked:
        raise SystemExit(f"export: the teacher's argmax differs from the captured labels at {mismatched}/{checked} positions")
    d2t = load_file(str(head / "model.safetensors"))["d2t"].long()
    draft_ids = d2t + torch.arange(len(d2t))
    t2d = torch.zeros(hf.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    return {
        "verifier": str(data.folder),
        "train_sequences": len(data.train),
        "held_out_sequences": len(data.held),
        "train_tokens": sum(len(s.tokens) for s in data.train),
        "train_response_tokens": sum(int(s.response_mask().sum()) for s in data.train),
        "draft_vocab_size": len(d2t),
        # speculators (like vLLM) names a feature by the layer it is the input of: output i = input i + 1
        "aux_layer_ids": [i + 1 for i in data.layer_ids],
        "teacher_label_mismatch": f"{mismatched}/{checked}",
        "unseen_prompt_ids": [s.tokens[: s.prompt_len].tolist() for s in data.unseen],
        "end_ids": sorted(_end_ids(loaded, data.folder)),
    }


def _end_ids(loaded, folder: Path) -> set[int]:
    from transformers import AutoTokenizer

    from trtspec.speculative.requests import end_token_ids

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=loaded.spec.target.trust_remote_code)
    return set(end_token_ids(tok, folder))


def speculators_hyperparameters(exported: dict, epochs: int, ttt_steps: int) -> tuple[list[str], dict]:
    """speculators train's arguments and what each departure from its defaults is for."""
    args = {
        "--speculator-type": "eagle3",
        "--draft-attn-impl": "sdpa",  # FlexAttention has no CPU backward
        "--loss-implementation": "eager",  # the fused loss is a Triton kernel
        "--d2t-path": "d2t.npy",  # the same draft vocabulary as trtspec's head
        "--t2d-path": "t2d.npy",
        "--epochs": str(epochs),  # the CPU budget (speculators' default: 20)
        # packed rows of 1,024 tokens (default 8,192): about the 8 sequences a trtspec step
        # takes; at 8,192, the demo's 56k tokens are 7 optimizer steps an epoch
        "--total-seq-len": "1024",
        "--ttt-steps": str(ttt_steps),
        "--num-workers": "0",  # 2 cores: no dataloader processes
        "--hidden-states-path": "hidden_states",
        "--on-missing": "raise",  # no vLLM server to make missing hidden states
        # the training rows first, trtspec's held-out ones last: the same sequences train
        "--train-data-ratio": f"{(exported['train_sequences'] + 0.5) / (exported['train_sequences'] + exported['held_out_sequences']):.6f}",
        "--logger": "",
    }
    why = {
        "draft_attn_impl": "sdpa: FlexAttention has no CPU backward",
        "loss_implementation": "eager: the fused loss needs Triton (GPU)",
        "draft_vocab": f"trtspec's head's {exported['draft_vocab_size']} ids (d2t/t2d): the same draft vocabulary",
        "target_layer_ids": f"{exported['aux_layer_ids']}: the layers trtspec's head reads",
        "epochs": f"{epochs} (default 20): the CPU budget",
        "total_seq_len": "1024 (default 8192): about trtspec's 8 sequences a step; at 8192 the demo's data is 7 steps an epoch",
        "num_workers": "0 (default 12): 2 cores",
        "train_data_ratio": "the training sequences train, trtspec's held-out prompts validate (default 0.9 of the rows)",
        "defaults kept": "lr 1e-3, Muon + AdamW, linear schedule with 1% warmup, grad clip 1.0, KL loss, "
        f"{ttt_steps} TTT steps (decay 1.0), norms before fc and on the output, frozen embeddings, 1 layer",
    }
    argv = [x for k, v in args.items() if v != "" for x in (k, v)]
    return argv + ["--target-layer-ids", *map(str, exported["aux_layer_ids"])], why  # the same layers


def train_speculators(python: Path, data: Path, exported: dict, epochs: int, ttt_steps: int, log: Path) -> dict:
    """speculators' head in data/speculators-head; its CPU seconds."""
    subprocess.run([str(python), str(SPECULATORS_CPU), "prepare", str(data / "rows.jsonl"), str(data / "arrow")], check=True)
    args, why = speculators_hyperparameters(exported, epochs, ttt_steps)
    args = [str(data / a) if a.endswith(".npy") or a == "hidden_states" else a for a in args]
    save = data / "speculators-head"
    cmd = [str(python), str(SPECULATORS_CPU), "train", "--verifier-name-or-path", exported["verifier"]]
    cmd += ["--data-path", str(data / "arrow"), "--save-path", str(save), *args]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise SystemExit(f"speculators train exited {rc}; see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "head": str(_last_checkpoint(save)),
        "cpu_s": round(cpu, 1),
        "wall_s": round(time.monotonic() - t0, 1),
        "hyperparameters": why,
    }


def _last_checkpoint(save: Path) -> Path:
    """The folder of the last epoch's checkpoint (the one holding config.json)."""
    found = sorted((p.parent for p in save.rglob("config.json")), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"speculators wrote no checkpoint under {save}")
    return found[-1]


def score_vllm(python: Path, target: str, head: Path, exported: dict, k: int, max_tokens: int, log: Path) -> dict:
    """Acceptance of ``head`` in vLLM on the unseen prompts, greedy, k drafts per step."""
    from peers import VllmWorker, vllm_env

    load = {
        "model": target,
        "dtype": "float32",
        "max_model_len": max(map(len, exported["unseen_prompt_ids"])) + max_tokens + k + 8,
        "max_num_seqs": 1,
        "enable_prefix_caching": False,
        "speculative": {"method": "eagle3", "model": str(head), "num_speculative_tokens": k},
    }
    worker = VllmWorker(python, VLLM_PEER, load, vllm_env(1), log)
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * k}
    try:
        for ids in exported["unseen_prompt_ids"]:  # one at a time: the counters are per call
            answer = worker.call(
                {"op": "generate", "prompts": [ids], "max_tokens": max_tokens, "stop_token_ids": exported["end_ids"]}
            )
            spec = answer["spec"]
            for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                total[key] += spec[key]
            for j, a in enumerate(spec["accepted_per_pos"][:k]):
                total["accepted_per_pos"][j] += a
    finally:
        worker.close()
    drafts = max(1, total["num_drafts"])
    alive = [drafts] + total["accepted_per_pos"][:-1]
    return {
        "k": k,
        "acceptance": round(total["num_accepted_tokens"] / max(1, total["num_draft_tokens"]), 3),
        "acceptance_length": round(1 + total["num_accepted_tokens"] / drafts, 3),
        "per_position": [round(a / n, 3) if n else 0.0 for a, n in zip(total["accepted_per_pos"], alive)],
        "counters": total,
    }


# speculators' tensors with no place in a trtspec head: the target's own embeddings (a head
# shares the target's), the target-to-draft mask (d2t carries the same map), the verifier's copies.
SPECULATORS_DROPPED = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
)


def speculators_to_trtspec(src: Path, dst: Path) -> Path:
    """speculators' EAGLE-3 checkpoint folder ``src`` written as a trtspec head folder ``dst``
    (engines/eagle3_checkpoint.py's layout): ``layers.0.*`` -> ``midlayer.*``, the layer's
    config flattened to Llama keys, the same aux layer ids (both count a layer's input) and the
    norm flags and their tensors carried as they are. Returns ``dst``."""
    from safetensors.torch import load_file, save_file

    from trtspec.engines.eagle3_checkpoint import HEAD_ARCHITECTURE, NORM_FLAGS

    try:
        cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
        layer = cfg["transformer_layer_config"]
        files = sorted(src.glob("*.safetensors"))
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{src} is not a speculators checkpoint folder ({e})") from e
    if cfg.get("speculators_model_type") != "eagle3" or not files:
        raise SystemExit(f"{src} is not a speculators EAGLE-3 checkpoint (speculators_model_type eagle3, safetensors)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise SystemExit(f"{src}: {layer['num_hidden_layers']} draft layers; trtspec runs one-layer EAGLE-3 heads")
    state = {}
    for f in files:
        state |= load_file(str(f))
    state = {
        ("midlayer." + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v
        for k, v in state.items()
        if k not in SPECULATORS_DROPPED
    }
    ids = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    config = {
        "architectures": [HEAD_ARCHITECTURE],
        "model_type": "llama",
        **{k: layer[k] for k in LAYER_KEYS if k in layer},
        "num_hidden_layers": 1,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "target_hidden_size": cfg.get("target_hidden_size") or layer["hidden_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        **{k: bool(cfg.get(k, False)) for k in NORM_FLAGS},
        # the window speculators trained under; trtspec's head attends to the whole context
        "speculators": {"source": str(src), "sliding_window": layer.get("sliding_window")},
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return dst


def load_head(folder: Path, target_hf, dtype=None):
    """A head folder as an Eagle3Head in ``dtype`` (None: as stored; d2t kept), after the checkpoint checks
    ``trtspec check`` runs (config, tensors and shapes, norms, d2t, the target)."""
    from safetensors.torch import load_file

    from trtspec.engines.eagle3_checkpoint import (
        check_d2t,
        check_head_for_target,
        check_head_tensors,
        read_head_config,
        safetensors_shapes,
    )
    from trtspec.engines.torch.eagle3_head import Eagle3Head

    cfg = read_head_config(folder, target_hf.num_hidden_layers)
    check_head_for_target(cfg, target_hf)
    check_head_tensors(cfg, safetensors_shapes([folder / "model.safetensors"]))
    state = load_file(str(folder / "model.safetensors"))
    check_d2t(cfg, state.get("d2t"))
    return Eagle3Head.from_state_dict(cfg, {k: v if k == "d2t" or dtype is None else v.to(dtype) for k, v in state.items()})


def score_trtspec(spec: Path, trtspec_head: Path, others: dict[str, Path]) -> dict[str, dict]:
    """trtspec_head and each head in ``others`` scored on trtspec_head's unseen samples by
    distill's own report (Trainer.report: per-position acceptance at the depth distill scored
    trtspec_head at, at least 3; acceptance length at that k; top-1 agreement per step), all in
    the dtype trtspec_head was trained and scored in."""
    import torch

    from trtspec.distill.heads import HEAD_MANIFEST
    from trtspec.distill.run import prepare, work_folder, work_lock
    from trtspec.distill.trainer import Trainer
    from trtspec.spec import load_spec

    opts = distill_options(trtspec_head)
    steps = json.loads((trtspec_head / HEAD_MANIFEST).read_text())["ttt_steps"]
    work = work_folder(trtspec_head)
    with work_lock(work):
        data = prepare(load_spec(spec), opts, work)
    longest = max(len(s.tokens) for s in data.unseen)
    own = load_head(trtspec_head, data.target_hf)
    out = {}
    for name, folder in {"trtspec": trtspec_head, **others}.items():
        head = own if name == "trtspec" else load_head(folder, data.target_hf, own.fc.weight.dtype)
        window = (head.cfg.raw.get("speculators") or {}).get("sliding_window")
        if window is not None and longest > window:
            raise SystemExit(f"{folder}: an unseen sequence of {longest} tokens passes the head's {window}-token window")
        draft_ids = head.to_target_ids(torch.arange(head.cfg.draft_vocab_size)).tolist()
        trainer = Trainer(head, data.target, draft_ids, opts, steps, data.store)
        m = trainer.report([], data.unseen)
        out[name] = {
            "k1_acceptance": round(m["unseen_accepted"][0], 3),
            "acceptance_length_k3": round(m["unseen_acceptance_length"], 3),
            "per_position": [round(a, 3) for a in m["unseen_accepted"]],
            "top1": [round(a, 3) for a in m["unseen_top1"]],
            "chains": m["unseen_chains"],
            "norms": {k: getattr(head.cfg, k) for k in ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")},
        }
    return out


def recipe_and_run(manifest: dict) -> dict:
    """The options a head was trained with: its manifest's recipe and run settings (a head
    written before the recipe was recorded apart holds them all under "options")."""
    return {**manifest.get("run", {}), **manifest.get("recipe", manifest.get("options", {}))}


def trtspec_figures(head: Path) -> dict:
    from trtspec.distill.heads import HEAD_MANIFEST

    m = json.loads((head / HEAD_MANIFEST).read_text())
    metrics = m["metrics"]
    return {
        "k1_acceptance": round(metrics["unseen_accepted"][0], 3),
        "acceptance_length_k3": round(metrics["unseen_acceptance_length"], 3),
        "per_position": [round(a, 3) for a in metrics["unseen_accepted"]],
        "top1": [round(a, 3) for a in metrics["unseen_top1"]],
        "steps": m["steps"],
        "train_cpu_s": m.get("train_cpu_s"),
        "options": {
            k: v
            for k, v in recipe_and_run(m).items()
            if k in ("lr", "batch_size", "ttt_steps", "labels", "step_decay", "ttt_phase", "feature_noise")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", type=Path)
    ap.add_argument("--head", type=Path, required=True, help="a head trtspec distill wrote for SPEC (its data is reused)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "distill-peers")
    ap.add_argument("--epochs", type=int, default=4, help="speculators' epochs (the CPU budget; its default is 20)")
    ap.add_argument("--ttt-steps", type=int, default=3, help="speculators' TTT steps (its default 3)")
    ap.add_argument("--speculators-python", type=Path, default=SPECULATORS_PY)
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PY)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM scoring")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reuse-export", action="store_true", help="use the export already in OUT (same HEAD)")
    ap.add_argument(
        "--speculators-head",
        type=Path,
        help="score this speculators checkpoint (trained on HEAD's export) instead of training one (needs --reuse-export)",
    )
    args = ap.parse_args()
    out = args.out.resolve()
    head = args.head.resolve()
    data = out / "speculators-data"
    if not (head / "trtspec-head.json").is_file():
        refuse(f"{head} holds no trtspec-head.json; pass a head `trtspec distill` wrote as --head")
    if args.speculators_head and not (args.reuse_export and (out / "exported.json").is_file()):
        refuse(f"--speculators-head needs --reuse-export and the export it was trained on in {out}; pass both")
    if args.speculators_head and not (args.speculators_head / "config.json").is_file():
        refuse(f"{args.speculators_head} holds no config.json; pass the checkpoint folder speculators wrote")
    for python, what in ((args.speculators_python, "speculators (make speculators)"), (args.vllm_python, "vLLM (make vllm)")):
        if not python.is_file() and not (args.no_vllm and "vLLM" in what):
            refuse(f"no Python environment for {what} at {python}; create it, or pass its python")
    data.mkdir(parents=True, exist_ok=True)
    if args.reuse_export and (out / "exported.json").is_file():
        exported = json.loads((out / "exported.json").read_text())
    else:
        print("exporting the head's training data in speculators' format ...", flush=True)
        exported = export(args.spec.resolve(), head, data)
        (out / "exported.json").write_text(json.dumps(exported) + "\n")
    if args.speculators_head:  # trained before (its CPU seconds are in that run's result)
        spec_run = {"head": str(args.speculators_head.resolve()), "cpu_s": None, "wall_s": None}
    else:
        print("training speculators' EAGLE-3 head ...", flush=True)
        spec_run = train_speculators(
            args.speculators_python, data, exported, args.epochs, args.ttt_steps, out / "speculators-train.log"
        )
    heads = {"trtspec": head, "speculators": Path(spec_run["head"])}
    print("scoring both heads through trtspec ...", flush=True)
    converted = speculators_to_trtspec(heads["speculators"], out / "speculators-head-trtspec")
    scored = score_trtspec(args.spec.resolve(), head, {"speculators": converted})
    manifest = trtspec_figures(head)
    if any(scored["trtspec"][k] != manifest[k] for k in ("k1_acceptance", "acceptance_length_k3", "per_position", "top1")):
        raise SystemExit(f"trtspec scoring path differs from distill's: {scored['trtspec']} vs the manifest's {manifest}")
    result = {
        "command": command_line("distill_peers.py"),
        "data": {k: v for k, v in exported.items() if k not in ("unseen_prompt_ids", "end_ids")},
        "unseen_prompts": len(exported["unseen_prompt_ids"]),
        "trtspec": {"head": str(head), "scored_by_trtspec": {**manifest, "chains": scored["trtspec"]["chains"]}},
        "speculators": {**spec_run, "converted": str(converted), "scored_by_trtspec": scored["speculators"]},
        "time": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
    }
    (out / "distill-peers.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_vllm:
        for name, h in heads.items():
            result[name]["scored_by_vllm"] = [
                score_vllm(args.vllm_python, exported["verifier"], h, exported, k, args.max_tokens, out / f"vllm-{name}-k{k}.log")
                for k in (1, 3)
            ]
            (out / "distill-peers.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
