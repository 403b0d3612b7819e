"""trtspec's EAGLE-3 head side by side with the trainers users pick, on the same data.

    make distill-peers
    python -m lab.distill_peers SPEC --head HEAD [--epochs 6] [--specforge-epochs 1] [--out DIR]
    # one more trtspec head in the same table, the peers' heads and scores reused:
    python -m lab.distill_peers SPEC --head HEAD --out DIR --reuse-export \
        --speculators-head S --specforge-head F --extra-head NAME=HEAD2

HEAD is a head `trtspec distill SPEC` wrote; its manifest names the data it was trained on
(prompts, seed, split, response length, layers). This script:

1. takes the SAME captured responses (distill's own capture in HEAD's work folder, made again
   if it is gone), the same training split, the same target layers and the same draft
   vocabulary (HEAD's d2t), and writes them, from one capture, in
   - speculators' offline format: per sequence `hidden_states/hs_{i}.safetensors` with
     `token_ids [T]` and `hidden_states [T, 4, hidden]` (bfloat16): the three layers the head
     reads, then the last layer's output (the teacher: speculators computes the target's
     distribution from it; checked: its argmax through the target's norm and LM head is the
     captured greedy label), and the Arrow rows (input_ids, loss_mask = response positions);
   - SpecForge's offline format: per training sequence a `.ckpt` with input_ids, loss_mask,
     hidden_state [1, T, hidden] (the last layer's output through the final norm: SpecForge's
     teacher) and aux_hidden_state [1, T, 3 * hidden] (the same three layers), its vocabulary
     mapping file (HEAD's d2t / t2d), a target folder with the index its loaders need, and a
     draft config of HEAD's shape naming the layers;
2. trains speculators' and SpecForge's EAGLE-3 heads on it at the same time, one thread each,
   each in its own environment (lab/speculators_cpu.py, lab/specforge_cpu.py), with each
   trainer's documented defaults except where the shared data or the CPU forces a change (each
   named in the record's "hyperparameters"); SpecForge's head is then written by its own
   `specforge export --to sglang`;
3. scores every head on the same unseen prompts (the spec's verify prompts and HEAD's
   --eval-prompts, never trained on) through vLLM (.venv-vllm: trtspec/testing/vllm_peer.py) at
   k = 1 and k = 3 (speculators' head both as it wrote it and converted to trtspec's layout:
   the converted folder must load and give the same acceptance), and through trtspec: HEAD's
   figures from its manifest, the peers' heads by the same code that wrote them (distill's
   Trainer.report over the same unseen samples: per-position acceptance at depth 3,
   acceptance length at k=3), after converting them to trtspec's head layout
   (``speculators_to_trtspec``, ``specforge_to_trtspec``). HEAD is scored again the same way
   and must give its manifest's figures: the check that the path is the one distill used.

The converters (trtspec/testing/peer_heads.py) are not in ``trtspec check``/``build``: only this comparison needs the
trainers' own layouts (speculators' ``layers.0.*`` names, nested ``transformer_layer_config``,
copy of the target's embeddings and ``t2d``; SpecForge's ``t2d`` and its config without
trtspec's keys); the product keeps one head format, the one TensorRT-LLM, vLLM and SGLang
load, whose optional norms (config keys and ``input_norm`` / ``fc_norm`` tensors as
speculators and vLLM name them) it runs.

CPU time of each trainer is its training process tree's user + system seconds (from wait4;
not wall time, which depends on the machine's load). Writes OUT/distill-peers-run.json (the
whole record) and the result file (--result, lab/results/distill-peers.json: one row per
head), and prints the record. Exit 2 on bad input (no head manifest at HEAD, a missing
environment, a peer head without its export).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lab._common import ROOT, command_line
from trtspec.testing.peer_heads import LAYER_KEYS, specforge_to_trtspec, speculators_to_trtspec

SPECULATORS_PY = ROOT / ".venv-speculators" / "bin" / "python"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SPECULATORS_CPU = ROOT / "lab" / "speculators_cpu.py"
EXPORT_ROWS = 64  # sequences captured per batch of the export
RESULT = ROOT / "lab" / "results" / "distill-peers.json"
SPECFORGE_PY = ROOT / ".venv-specforge" / "bin" / "python"
SPECFORGE_CPU = ROOT / "lab" / "specforge_cpu.py"
# SpecForge's inputs in the export folder: its .ckpt rows, vocabulary mapping, target folder
# (the verifier's files + the index its loaders need) and draft config
SPECFORGE_ROWS = "specforge-rows"
SPECFORGE_VOCAB = "specforge-vocab-mapping.pt"
SPECFORGE_TARGET = "specforge-target"
SPECFORGE_DRAFT_CONFIG = "specforge-draft-config.json"


def refuse(message: str) -> None:
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(2)


def distill_options(head: Path):
    """The DistillOptions HEAD was trained with (its manifest), output = HEAD; generation at the
    batch HEAD's data was generated at (so reusing its capture runs no timing probe)."""
    from trtspec.distill.heads import HEAD_MANIFEST
    from trtspec.distill.run import DistillOptions

    manifest = json.loads((head / HEAD_MANIFEST).read_text())
    saved = recipe_and_run(manifest)
    opts = DistillOptions(**{k: v for k, v in saved.items() if k in DistillOptions.model_fields})
    rows = opts.gen_batch or ((manifest.get("data") or {}).get("rates") or {}).get("rows")
    update = {"output": head, "force": True, "resume": False, "scaling": ()}
    return opts.model_copy(update=update | ({"gen_batch": int(rows)} if rows else {}))


def export(spec: Path, head: Path, out: Path) -> dict:
    """The head's training data in speculators' and SpecForge's offline formats (module docstring, 1.)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from trtspec.distill.run import prepare, work_folder, work_lock
    from trtspec.spec import load_spec

    loaded = load_spec(spec)
    opts = distill_options(head)
    work = work_folder(head)
    with work_lock(work):
        data = prepare(loaded, opts, work)
    hf = data.target_hf
    checked, mismatched = _write_rows(data, out)
    if mismatched > 0.01 * checked:
        raise SystemExit(f"export: the teacher's argmax differs from the captured labels at {mismatched}/{checked} positions")
    d2t = load_file(str(head / "model.safetensors"))["d2t"].long()
    draft_ids = d2t + torch.arange(len(d2t))
    t2d = torch.zeros(hf.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    torch.save({"d2t": d2t, "t2d": t2d}, out / SPECFORGE_VOCAB)  # SpecForge's vocabulary mapping file
    aux_layer_ids = [i + 1 for i in data.layer_ids]
    write_specforge_target(data.folder, out / SPECFORGE_TARGET)
    write_specforge_draft_config(head, aux_layer_ids, out / SPECFORGE_DRAFT_CONFIG)
    return {
        "verifier": str(data.folder),
        "train_sequences": len(data.train),
        "held_out_sequences": len(data.held),
        "train_tokens": sum(len(s.tokens) for s in data.train),
        "train_response_tokens": sum(int(s.response_mask().sum()) for s in data.train),
        "draft_vocab_size": len(d2t),
        # speculators (like vLLM) names a feature by the layer it is the input of: output i = input i + 1
        "aux_layer_ids": aux_layer_ids,
        "teacher_label_mismatch": f"{mismatched}/{checked}",
        "unseen_prompt_ids": [s.tokens[: s.prompt_len].tolist() for s in data.unseen],
        "end_ids": sorted(_end_ids(loaded, data.folder)),
    }


def _write_rows(data, out: Path) -> tuple[int, int]:
    """One capture of every training and held-out sequence, written for both trainers:
    speculators' hs_{i}.safetensors + rows.jsonl (all sequences: its split is "the first fraction
    trains", so the same sequences train as in trtspec) and SpecForge's .ckpt rows (the training
    sequences). Returns (labelled positions, positions whose teacher argmax differs)."""
    import torch
    from safetensors.torch import save_file

    from trtspec.distill.data import capture_batch

    target, last = data.target, data.target_hf.num_hidden_layers - 1
    layers = tuple(sorted(set(data.layer_ids) | {last}))
    target.capture_features(layers)
    pick = [layers.index(i) for i in data.layer_ids] + [layers.index(last)]  # the head's layers, then the teacher's
    hs, ckpts = out / "hidden_states", out / SPECFORGE_ROWS
    hs.mkdir(parents=True, exist_ok=True)
    ckpts.mkdir(parents=True, exist_ok=True)
    checked = mismatched = 0
    seqs = data.train + data.held
    with open(out / "rows.jsonl", "w", encoding="utf-8") as rows:
        for n in range(0, len(seqs), EXPORT_ROWS):
            part = seqs[n : n + EXPORT_ROWS]
            got = capture_batch(target, [s.tokens.tolist() for s in part], [s.response_mask() for s in part])
            for i, (s, c) in enumerate(zip(part, got), start=n):
                h = c.features.view(len(s.tokens), len(layers), -1)[:, pick]  # [T, 4, hidden]
                with torch.no_grad():  # the teacher: the last layer's output through the final norm
                    normed = target.model.model.norm(h[:, -1].to(target.device))  # [T, hidden]
                    teacher = target.model.lm_head(normed).argmax(-1).cpu()
                known = s.labels >= 0
                checked += int(known.sum())
                mismatched += int((teacher[known] != s.labels[known]).sum())
                save_file(
                    {"token_ids": s.tokens.clone(), "hidden_states": h.to(torch.bfloat16).contiguous()},
                    str(hs / f"hs_{i}.safetensors"),
                )
                rows.write(json.dumps({"input_ids": s.tokens.tolist(), "loss_mask": s.response_mask().long().tolist()}) + "\n")
                if i < len(data.train):
                    torch.save(specforge_row(s.tokens, s.response_mask(), h[:, :-1], normed.cpu()), ckpts / f"data_{i:06d}.ckpt")
    return checked, mismatched


def specforge_row(tokens, response_mask, aux, normed) -> dict:
    """One SpecForge offline EAGLE-3 row: input_ids [T], loss_mask [T], hidden_state [1, T, hidden]
    (the target's last hidden state after its final norm: SpecForge's teacher) and
    aux_hidden_state [1, T, n_layers * hidden] (the head's layers, concatenated in layer order),
    features in bfloat16 as SpecForge's capture writes them."""
    import torch

    t = len(tokens)
    if aux.shape[0] != t or normed.shape != (t, aux.shape[-1]) or len(response_mask) != t:
        raise ValueError(
            f"specforge_row: {t} tokens, aux {tuple(aux.shape)}, normed {tuple(normed.shape)}, mask {len(response_mask)}"
        )
    return {
        "input_ids": tokens.clone().long(),
        "loss_mask": response_mask.clone().long(),
        "hidden_state": normed.to(torch.bfloat16).reshape(1, t, -1).contiguous(),
        "aux_hidden_state": aux.to(torch.bfloat16).reshape(1, t, -1).contiguous(),
    }


def write_specforge_target(verifier: Path, dst: Path) -> Path:
    """The target folder as SpecForge's loaders read it: the verifier's files linked, plus the
    ``*.index.json`` they require (its LM head and embeddings are looked up there; a tied
    model's LM head is its embedding table, named by ``lm_head_key``)."""
    from safetensors import safe_open

    dst.mkdir(parents=True, exist_ok=True)
    weights = sorted(verifier.glob("*.safetensors"))
    if not weights:
        raise SystemExit(f"{verifier} holds no safetensors; SpecForge reads the target's LM head from them")
    for f in verifier.iterdir():
        link = dst / f.name
        if f.is_file() and not f.name.endswith(".index.json") and not link.exists():
            link.symlink_to(f.resolve())
    weight_map = {}
    for f in weights:
        with safe_open(str(f), framework="pt") as st:
            weight_map |= dict.fromkeys(st.keys(), f.name)
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}) + "\n")
    return dst


def specforge_lm_head_key(target: Path) -> str:
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    return "lm_head.weight" if "lm_head.weight" in index else "model.embed_tokens.weight"


def write_specforge_draft_config(head: Path, aux_layer_ids: list[int], dst: Path) -> Path:
    """SpecForge's draft config: trtspec's head's architecture (one Llama layer of the target's
    shape, the same draft vocabulary), with the aux layer ids under the names vLLM
    (``eagle_aux_hidden_state_layer_ids``) and SGLang (``eagle_config``) read."""
    from trtspec.engines.eagle3_checkpoint import HEAD_ARCHITECTURE

    cfg = json.loads((head / "config.json").read_text(encoding="utf-8"))
    config = {
        "architectures": [HEAD_ARCHITECTURE],
        "model_type": "llama",
        **{k: cfg[k] for k in LAYER_KEYS if k in cfg},
        "num_hidden_layers": 1,
        "draft_vocab_size": cfg["draft_vocab_size"],
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids},
    }
    dst.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return dst


def _end_ids(loaded, folder: Path) -> set[int]:
    from transformers import AutoTokenizer

    from trtspec.speculative.requests import end_token_ids

    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=loaded.spec.target.trust_remote_code)
    return set(end_token_ids(tok, folder))


def speculators_hyperparameters(exported: dict, epochs: int, ttt_steps: int, dtype: str = "bfloat16") -> tuple[list[str], dict]:
    """speculators train's arguments and what each departure from its defaults is for. ``dtype``:
    its compute (autocast) and hidden-state dtype, bfloat16 its default; float32 is its other
    documented option, for a CPU without bfloat16 instructions."""
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
        "--hidden-states-dtype": dtype,
    }
    why = {
        "draft_attn_impl": "sdpa: FlexAttention has no CPU backward",
        "loss_implementation": "eager: the fused loss needs Triton (GPU)",
        "draft_vocab": f"trtspec's head's {exported['draft_vocab_size']} ids (d2t/t2d): the same draft vocabulary",
        "target_layer_ids": f"{exported['aux_layer_ids']}: the layers trtspec's head reads",
        "epochs": f"{epochs} (default 20): the CPU budget",
        "total_seq_len": "1024 (default 8192): about trtspec's 8 sequences a step; at 8192 the demo's data is 7 steps an epoch",
        "num_workers": "0 (default 12): 2 cores",
        **({"hidden_states_dtype": f"{dtype} (default bfloat16): this CPU's fast dtype"} if dtype != "bfloat16" else {}),
        "train_data_ratio": "the training sequences train, trtspec's held-out prompts validate (default 0.9 of the rows)",
        "defaults kept": "lr 1e-3, Muon + AdamW, linear schedule with 1% warmup, grad clip 1.0, KL loss, "
        f"{ttt_steps} TTT steps (decay 1.0), norms before fc and on the output, frozen embeddings, 1 layer",
    }
    argv = [x for k, v in args.items() if v != "" for x in (k, v)]
    return argv + ["--target-layer-ids", *map(str, exported["aux_layer_ids"])], why  # the same layers


def speculators_command(
    python: Path, data: Path, exported: dict, epochs: int, ttt_steps: int, dtype: str = "bfloat16"
) -> tuple[list[str], dict]:
    """`speculators train` on the export (after speculators_cpu.py prepare), head in data/speculators-head."""
    args, why = speculators_hyperparameters(exported, epochs, ttt_steps, dtype)
    args = [str(data / a) if a.endswith(".npy") or a == "hidden_states" else a for a in args]
    cmd = [str(python), str(SPECULATORS_CPU), "train", "--verifier-name-or-path", exported["verifier"]]
    return cmd + ["--data-path", str(data / "arrow"), "--save-path", str(data / "speculators-head"), *args], why


def train_speculators(python: Path, data: Path, exported: dict, epochs: int, ttt_steps: int, log: Path) -> dict:
    """speculators' head in data/speculators-head; its CPU seconds."""
    subprocess.run([str(python), str(SPECULATORS_CPU), "prepare", str(data / "rows.jsonl"), str(data / "arrow")], check=True)
    cmd, why = speculators_command(python, data, exported, epochs, ttt_steps)
    ran = run_measured({"speculators": (cmd, log)})["speculators"]
    if ran["rc"] != 0:
        raise SystemExit(f"speculators train exited {ran['rc']}; see {log}")
    return {
        "head": str(_last_checkpoint(data / "speculators-head")),
        "cpu_s": ran["cpu_s"],
        "wall_s": ran["wall_s"],
        "hyperparameters": why,
    }


SPECFORGE_TTT = 7  # SpecForge's default ttt_length


def specforge_run_config(data: Path, exported: dict, epochs: int, save: Path) -> tuple[dict, dict]:
    """SpecForge's run config (its `specforge train --config`) and what each departure from its
    defaults is for. Paths are absolute: SpecForge resolves them from its working directory."""
    target = data / SPECFORGE_TARGET
    config = {
        "model": {
            "target_model_path": str(target),
            "draft_model_config": str(data / SPECFORGE_DRAFT_CONFIG),
            "vocab_mapping_path": str(data / SPECFORGE_VOCAB),
            "embedding_key": "model.embed_tokens.weight",
            "lm_head_key": specforge_lm_head_key(target),
            "torch_dtype": "bfloat16",  # the dtype of its offline rows too (float32 is refused)
        },
        "data": {
            "hidden_states_path": str(data / SPECFORGE_ROWS),
            "cache_dir": str(data / "specforge-cache"),
            "dataloader_num_workers": 0,
        },
        "training": {
            "strategy": "eagle3",
            "num_epochs": epochs,
            "attention_backend": "sdpa",
            "fsdp_sharding": "NO_SHARD",
            "ttt_length": SPECFORGE_TTT,
            "seed": 0,
        },
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
        "run_id": "specforge-peer",
        "output_dir": str(save),
    }
    why = {
        "attention_backend": "sdpa (default flex_attention): FlexAttention has no CPU backward",
        "fsdp_sharding": "NO_SHARD (default SHARD_GRAD_OP): DDP on gloo, FSDP needs an accelerator",
        "loss": "its forward KL in plain PyTorch (lab/specforge_cpu.py): its kernel needs Triton (GPU)",
        "draft_vocab": f"trtspec's head's {exported['draft_vocab_size']} ids (vocab_mapping_path; default 32000 from the data)",
        "aux_layers": f"{exported['aux_layer_ids']} (vLLM ids): the layers trtspec's head reads, in the .ckpt rows",
        "data": f"offline .ckpt rows of the {exported['train_sequences']} training sequences (no SGLang on a CPU)",
        "lm_head_key": f"{config['model']['lm_head_key']}: the target's LM head (tied models: the embeddings)",
        "dataloader_num_workers": "0: 2 cores",
        "num_epochs": f"{epochs} (default 1)",
        "defaults kept": "lr 1e-4, AdamW, cosine schedule with 1.5% warmup, grad clip 0.5, batch 1, "
        f"ttt_length {SPECFORGE_TTT} (step weights 0.8^i), forward KL over the draft vocabulary, max_length 2048, 1 layer",
    }
    return config, why


def specforge_command(python: Path, data: Path, exported: dict, epochs: int, save: Path) -> tuple[list[str], dict]:
    config, why = specforge_run_config(data, exported, epochs, save)
    path = data / "specforge-run.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return [str(python), str(SPECFORGE_CPU), "train", "--config", str(path)], why


def export_specforge(python: Path, data: Path, save: Path, log: Path) -> Path:
    """SpecForge's own export of its last checkpoint to the folder SGLang (and vLLM) load."""
    dst = save / "exported"
    cmd = [str(python), str(SPECFORGE_CPU), "export", "--to", "sglang", "--checkpoint", str(save)]
    cmd += ["--draft-config", str(data / SPECFORGE_DRAFT_CONFIG), "--output-dir", str(dst)]
    with open(log, "a", encoding="utf-8") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"specforge export exited {rc}; see {log}")
    return dst


def run_measured(jobs: dict[str, tuple[list[str], Path]]) -> dict[str, dict]:
    """Run the commands at once (each one thread), each with its log; per job its exit code,
    CPU seconds (user + system of its process tree, from wait4) and wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    running, out = {}, {}
    t0 = time.monotonic()
    for name, (cmd, log) in jobs.items():
        f = open(log, "w", encoding="utf-8")  # noqa: SIM115 - closed when the job ends
        running[subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).pid] = (name, f)
    while running:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        name, f = running.pop(pid)
        f.close()
        out[name] = {
            "rc": os.waitstatus_to_exitcode(status),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "wall_s": round(time.monotonic() - t0, 1),
        }
    return out


def train_peers(args, data: Path, exported: dict, out: Path, peers: list[str]) -> dict[str, dict]:
    """Train the named peers on the export at the same time; per peer its head folder, CPU s,
    wall s and hyperparameters."""
    jobs, why, saves = {}, {}, {}
    if "speculators" in peers:
        subprocess.run(
            [str(args.speculators_python), str(SPECULATORS_CPU), "prepare", str(data / "rows.jsonl"), str(data / "arrow")],
            check=True,
        )
        saves["speculators"] = data / "speculators-head"
        jobs["speculators"], why["speculators"] = speculators_command(
            args.speculators_python, data, exported, args.epochs, args.ttt_steps, args.peer_dtype
        )
    if "specforge" in peers:
        saves["specforge"] = data / "specforge-head"
        jobs["specforge"], why["specforge"] = specforge_command(
            args.specforge_python, data, exported, args.specforge_epochs, saves["specforge"]
        )
    logs = {name: out / f"{name}-train.log" for name in jobs}
    ran = run_measured({name: (cmd, logs[name]) for name, cmd in jobs.items()})
    failed = [f"{name} exited {r['rc']} (see {logs[name]})" for name, r in ran.items() if r["rc"] != 0]
    if failed:
        raise SystemExit("; ".join(failed))
    heads = {}
    if "speculators" in ran:
        heads["speculators"] = _last_checkpoint(saves["speculators"])
    if "specforge" in ran:
        heads["specforge"] = export_specforge(args.specforge_python, data, saves["specforge"], logs["specforge"])
    return {
        name: {"head": str(heads[name]), "cpu_s": r["cpu_s"], "wall_s": r["wall_s"], "hyperparameters": why[name]}
        for name, r in ran.items()
    }


def _last_checkpoint(save: Path) -> Path:
    """The folder of the last epoch's checkpoint (the one holding config.json)."""
    found = sorted((p.parent for p in save.rglob("config.json")), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"speculators wrote no checkpoint under {save}")
    return found[-1]


def score_vllm(python: Path, target: str, head: Path, exported: dict, k: int, max_tokens: int, log: Path) -> dict:
    """Acceptance of ``head`` in vLLM on the unseen prompts, greedy, k drafts per step."""
    from trtspec.testing.vllm_worker import PEER_SCRIPT, VllmWorker, vllm_env

    load = {
        "model": target,
        "dtype": "float32",
        "max_model_len": max(map(len, exported["unseen_prompt_ids"])) + max_tokens + k + 8,
        "max_num_seqs": 1,
        "enable_prefix_caching": False,
        "speculative": {"method": "eagle3", "model": str(head), "num_speculative_tokens": k},
    }
    worker = VllmWorker(python, PEER_SCRIPT, load, vllm_env(1), log)
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
        if head.cfg.layer_ids != own.cfg.layer_ids:  # the unseen chains' features are of trtspec_head's layers
            raise SystemExit(f"{folder} reads target layers {head.cfg.layer_ids}, the scored data holds {own.cfg.layer_ids}")
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


PEERS = ("speculators", "specforge")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", type=Path)
    ap.add_argument("--head", type=Path, required=True, help="a head trtspec distill wrote for SPEC (its data is reused)")
    ap.add_argument("--out", type=Path, default=ROOT / "lab" / "results" / "distill-peers", help="work folder")
    ap.add_argument("--result", type=Path, default=RESULT, help="the result file the figures come from")
    ap.add_argument("--peers", default=",".join(PEERS), help="peer trainers to train or score: speculators,specforge")
    ap.add_argument("--epochs", type=int, default=4, help="speculators' epochs (the CPU budget; its default is 20)")
    ap.add_argument("--ttt-steps", type=int, default=3, help="speculators' TTT steps (its default 3)")
    ap.add_argument("--specforge-epochs", type=int, default=1, help="SpecForge's epochs (its default 1)")
    ap.add_argument(
        "--peer-dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="speculators' compute dtype (its default bfloat16; float32 on a CPU without bf16 instructions, "
        "where bfloat16 matmuls run about 40x slower; SpecForge trains in bfloat16 only)",
    )
    ap.add_argument("--speculators-python", type=Path, default=SPECULATORS_PY)
    ap.add_argument("--specforge-python", type=Path, default=SPECFORGE_PY)
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PY)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM scoring")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reuse-export", action="store_true", help="use the export (and the run record) already in OUT (same HEAD)")
    for peer in PEERS:
        ap.add_argument(
            f"--{peer}-head",
            type=Path,
            help=f"score this {peer} head (trained on HEAD's export in OUT) instead of training one (needs --reuse-export)",
        )
    ap.add_argument(
        "--extra-head",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another trtspec head reading the same layers, scored beside the others (repeatable)",
    )
    return ap.parse_args(argv)


def check_args(args) -> dict[str, Path]:
    """Refuse bad input (exit 2); the extra heads by name."""
    out = args.out.resolve()
    if not (args.head / "trtspec-head.json").is_file():
        refuse(f"{args.head} holds no trtspec-head.json; pass a head `trtspec distill` wrote as --head")
    peers = [p for p in args.peers.split(",") if p]
    if not peers or any(p not in PEERS for p in peers):
        refuse(f"--peers {args.peers!r}: name one or more of {', '.join(PEERS)}")
    if args.peer_dtype == "float32" and "specforge" in peers and not args.specforge_head:
        refuse("--peer-dtype float32: SpecForge trains in bfloat16 only (its offline rows are bf16); pass --peers speculators")
    for peer in PEERS:
        given = getattr(args, f"{peer}_head")
        if given and not (args.reuse_export and (out / "exported.json").is_file()):
            refuse(f"--{peer}-head needs --reuse-export and the export it was trained on in {out}; pass both")
        if given and not (given / "config.json").is_file():
            refuse(f"{given} holds no config.json; pass the checkpoint folder {peer} wrote")
    extras = {}
    for item in args.extra_head:
        name, _, folder = item.partition("=")
        if not name or not folder or not (Path(folder) / "trtspec-head.json").is_file():
            refuse(f"--extra-head {item!r}: give NAME=DIR with DIR a head `trtspec distill` wrote")
        extras[name] = Path(folder).resolve()
    need = [(getattr(args, f"{p}_python"), p, f"make {p}") for p in peers if not getattr(args, f"{p}_head")]
    need += [] if args.no_vllm else [(args.vllm_python, "vLLM", "make vllm")]
    for python, what, make in need:
        if not python.is_file():
            refuse(f"no Python environment for {what} ({make}) at {python}; create it, or pass its python")
    return extras


def peer_runs(args, data: Path, exported: dict, out: Path, previous: dict) -> dict[str, dict]:
    """Each peer's head: trained now (all at once), or given (its CPU seconds from the run that
    trained it, when OUT's record names the same head)."""
    peers = [p for p in args.peers.split(",") if p]
    given = {p: getattr(args, f"{p}_head").resolve() for p in peers if getattr(args, f"{p}_head")}
    runs = {}
    for peer, head in given.items():
        before = previous.get(peer, {})
        same = before.get("head") == str(head)
        runs[peer] = {"head": str(head), **{k: before.get(k) if same else None for k in ("cpu_s", "wall_s", "hyperparameters")}}
    todo = [p for p in peers if p not in given]
    if todo:
        print(f"training {', '.join(todo)} on the export (at once, one thread each) ...", flush=True)
        runs |= train_peers(args, data, exported, out, todo)
    return runs


def main(argv=None) -> None:
    args = parse_args(argv)
    extras = check_args(args)
    out, head = args.out.resolve(), args.head.resolve()
    data = out / "export"
    data.mkdir(parents=True, exist_ok=True)
    record = out / "distill-peers-run.json"
    previous = json.loads(record.read_text()) if args.reuse_export and record.is_file() else {}
    if args.reuse_export and (out / "exported.json").is_file():
        exported = json.loads((out / "exported.json").read_text())
    else:
        print("exporting the head's training data in speculators' and SpecForge's formats ...", flush=True)
        exported = export(args.spec.resolve(), head, data)
        (out / "exported.json").write_text(json.dumps(exported) + "\n")
    runs = peer_runs(args, data, exported, out, previous)
    converted = {}
    if "speculators" in runs:
        converted["speculators"] = speculators_to_trtspec(Path(runs["speculators"]["head"]), out / "speculators-head-trtspec")
    if "specforge" in runs:
        converted["specforge"] = specforge_to_trtspec(Path(runs["specforge"]["head"]), out / "specforge-head-trtspec")
    print("scoring every head through trtspec ...", flush=True)
    scored = score_trtspec(args.spec.resolve(), head, converted | extras)
    manifest = trtspec_figures(head)
    if any(scored["trtspec"][k] != manifest[k] for k in ("k1_acceptance", "acceptance_length_k3", "per_position", "top1")):
        raise SystemExit(f"trtspec scoring path differs from distill's: {scored['trtspec']} vs the manifest's {manifest}")
    run = {
        "command": command_line("distill_peers.py", argv),
        "data": {k: v for k, v in exported.items() if k not in ("unseen_prompt_ids", "end_ids")},
        "unseen_prompts": len(exported["unseen_prompt_ids"]),
        "trtspec": {"head": str(head), "scored_by_trtspec": {**manifest, "chains": scored["trtspec"]["chains"]}},
        **{name: {**r, "converted": str(converted[name]), "scored_by_trtspec": scored[name]} for name, r in runs.items()},
        **{
            name: {"head": str(folder), "scored_by_trtspec": scored[name], **_extra_cpu(folder)}
            for name, folder in extras.items()
        },
        "time": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
    }
    if "speculators" in runs:  # the converted folder in vLLM: the load check of the conversion
        run["speculators-converted"] = {"head": str(converted["speculators"]), "of": runs["speculators"]["head"]}
    record.write_text(json.dumps(run, indent=2) + "\n")
    if not args.no_vllm:
        score_all_vllm(args, run, exported, out, previous, record)
    write_result(args.result, run, args)
    print(json.dumps(run, indent=2))


def _extra_cpu(folder: Path) -> dict:
    from trtspec.distill.heads import HEAD_MANIFEST

    return {"cpu_s": json.loads((folder / HEAD_MANIFEST).read_text()).get("train_cpu_s")}


def score_all_vllm(args, run: dict, exported: dict, out: Path, previous: dict, record: Path) -> None:
    """Every head in ``run`` scored in vLLM at k = 1 and 3 (a head OUT's record scored before,
    the same folder trained by the same run, keeps its scores)."""
    for name, entry in run.items():
        if not isinstance(entry, dict) or "head" not in entry:
            continue
        before = previous.get(name, {})
        if before.get("scored_by_vllm") and before.get("head") == entry["head"] and before.get("of") == entry.get("of"):
            entry["scored_by_vllm"] = before["scored_by_vllm"]
            continue
        print(f"scoring {name} in vLLM ...", flush=True)
        entry["scored_by_vllm"] = [
            score_vllm(
                args.vllm_python,
                exported["verifier"],
                Path(entry["head"]),
                exported,
                k,
                args.max_tokens,
                out / f"vllm-{name}-k{k}.log",
            )
            for k in (1, 3)
        ]
        record.write_text(json.dumps(run, indent=2) + "\n")


COLUMNS = [
    "head",
    "CPU s",
    "trtspec k=1",
    "trtspec acceptance length k=3 (per position)",
    "vLLM k=1",
    "vLLM acceptance length k=3 (per position)",
]


def _label(name: str, entry: dict, args) -> str:
    if name == "speculators":
        return f"speculators 0.9.0, {args.epochs} epochs" + (f", {args.peer_dtype}" if args.peer_dtype != "bfloat16" else "")
    if name == "speculators-converted":
        return "the same speculators head converted to trtspec's layout (the vLLM load check)"
    if name == "specforge":
        return f"SpecForge 0.2.0, {args.specforge_epochs} epoch{'s' if args.specforge_epochs != 1 else ''}"
    return f"trtspec ({Path(entry['head']).name})" if name == "trtspec" else f"trtspec, {name}"


def _length(score: dict) -> str:
    per = " / ".join(f"{a:.2f}" for a in score["per_position"][:3])
    return f"{score['acceptance_length_k3' if 'acceptance_length_k3' in score else 'acceptance_length']:.3f} ({per})"


def result_values(run: dict, args) -> dict:
    """The result file's values: one table row per head, and per head its four figures by key."""
    rows, values = [], {}
    for name, entry in run.items():
        if not isinstance(entry, dict) or "head" not in entry:
            continue
        trt = entry.get("scored_by_trtspec") or run["speculators"]["scored_by_trtspec"]  # converted: the same weights
        cpu = entry.get("cpu_s") if name != "trtspec" else trt.get("train_cpu_s")
        vllm = {s["k"]: s for s in entry.get("scored_by_vllm", [])}
        rows.append(
            [
                _label(name, entry, args),
                "the same head" if name == "speculators-converted" else (f"{cpu:.0f}" if cpu else "not recorded"),
                f"{trt['k1_acceptance']:.3f}",
                _length(trt),
                f"{vllm[1]['acceptance']:.3f}" if 1 in vllm else "not run",
                _length(vllm[3]) if 3 in vllm else "not run",
            ]
        )
        key = name.replace("-", "_")
        values |= {f"{key}_k1_trtspec": trt["k1_acceptance"], f"{key}_al3_trtspec": trt["acceptance_length_k3"]}
        values |= {f"{key}_k1_vllm": vllm[1]["acceptance"]} if 1 in vllm else {}
        values |= {f"{key}_al3_vllm": vllm[3]["acceptance_length"]} if 3 in vllm else {}
    data = run["data"]
    values |= {
        "train_sequences": data["train_sequences"],
        "train_response_tokens": data["train_response_tokens"],
        "draft_vocab_size": data["draft_vocab_size"],
        "aux_layer_ids": data["aux_layer_ids"],
        "unseen_chains": run["trtspec"]["scored_by_trtspec"]["chains"],
        "unseen_prompts": run["unseen_prompts"],
    }
    return {"table": {"columns": COLUMNS, "rows": rows}, **values}


def write_result(path: Path, run: dict, args) -> Path:
    from lab._common import write_result as write

    return write(path, run["command"], result_values(run, args))


if __name__ == "__main__":
    sys.exit(main())
