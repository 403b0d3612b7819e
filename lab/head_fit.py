"""How well a distilled head fits the data it trained on, against prompts it never saw: distill's
own chain scoring (Trainer.report: per-position acceptance k=3, acceptance length) on a seeded
sample of its training sequences, on the held-out prompts and on the unseen prompts. A wide gap
between the first and the last says the head learned its data by heart. The unseen prompts
are also scored in two parts (the spec's verify prompts, what `trtspec bench` runs; the
evaluation prompts) and walked as greedy generation drafts them (ttt.agreement's walk: the
first draft kept at k=1, tokens per forward at k=1..3). Also how far training moved each trained weight from the head's
start (the anchored copy of the target's layer): rms(w - w0) / rms(w0).

    python -m lab.head_fit engine_specs/smollm2-135m-eagle3-demo.yaml \
        --head weights/smollm2-135m-eagle3-head-demo [--train-sample 150] [--result NAME]

The head's work folder (its .NAME.distill capture) must still be there; nothing is generated.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from lab._common import RESULTS, command_line, write_result
from lab.distill_peers import distill_options, load_head


def fit(spec: Path, head_dir: Path, train_sample: int, seed: int = 0) -> dict:
    import torch

    from trtspec.distill.heads import HEAD_MANIFEST
    from trtspec.distill.run import prepare, work_folder, work_lock
    from trtspec.distill.trainer import Trainer
    from trtspec.spec import load_spec

    opts = distill_options(head_dir)
    steps = json.loads((head_dir / HEAD_MANIFEST).read_text())["ttt_steps"]
    work = work_folder(head_dir)
    loaded = load_spec(spec)
    with work_lock(work):
        data = prepare(loaded, opts, work)
    n_verify = len(dict.fromkeys(loaded.verify_prompts()))  # the unseen prompts: the verify prompts first
    head = load_head(head_dir, data.target_hf)
    draft_ids = head.to_target_ids(torch.arange(head.cfg.draft_vocab_size)).tolist()
    trainer = Trainer(head, data.target, draft_ids, opts, steps, data.store)
    sets = {
        f"training ({train_sample} of {len(data.train)} sequences, seed {seed})": random.Random(seed).sample(
            data.train, min(train_sample, len(data.train))
        ),
        "held-out prompts": data.held,
        "unseen prompts": data.unseen,
        "unseen: the spec's verify prompts": data.unseen[:n_verify],
        "unseen: the evaluation prompts": data.unseen[n_verify:],
    }
    out = []
    for name, samples in sets.items():
        m = trainer.report([], samples)
        out.append(
            {
                "set": name,
                "k1_acceptance": round(m["unseen_accepted"][0], 3),
                "acceptance_length_k3": round(m["unseen_acceptance_length"], 3),
                "per_position": [round(a, 3) for a in m["unseen_accepted"]],
                "chains": m["unseen_chains"],
                # as greedy generation drafts them: k=1's first draft kept, tokens per forward per k
                "walk_k1_kept": round(m["unseen_walk_accepted"][0][0], 3),
                "walk_length": [round(t, 3) for t in m["unseen_walk_length"]],
                "walk_forwards": m["unseen_walk_forwards"],
            }
        )
        print(
            f"{name}: k=1 {out[-1]['k1_acceptance']:.3f}, acceptance length k=3 {out[-1]['acceptance_length_k3']:.3f}, {m['unseen_chains']} chains; "
            f"walked: k=1 kept {out[-1]['walk_k1_kept']:.3f}, tokens per forward k=1..3 {out[-1]['walk_length']}",
            flush=True,
        )
    weights = moved(head, data, opts, draft_ids)
    layer = [r for name, r in weights.items() if name.startswith("midlayer.") and name.endswith("_proj.weight")]
    return {
        "sets": out,
        "moved": [{"weight": name, "rms_ratio": r} for name, r in weights.items()],
        "moved_fc": weights.get("fc.weight"),
        "moved_layer_min": min(layer, default=None),
        "moved_layer_max": max(layer, default=None),
    }


def moved(head, data, opts, draft_ids: list[int]) -> dict[str, float]:
    """rms(w - w0) / rms(w0) of each weight training changed, w0 the head distill started from."""
    from trtspec.distill.heads import head_norms, new_head

    start, _ = new_head(
        data.target_hf, data.folder, head.cfg.layer_ids, draft_ids, opts.seed, anchor=opts.anchor, norms=head_norms(opts)
    )
    w0 = dict(start.named_parameters())
    out = {}
    for name, w in head.named_parameters():
        d = (w.detach().float() - w0[name].detach().float()).pow(2).mean().sqrt()
        if float(d) > 0:
            out[name] = round(float(d / w0[name].detach().float().pow(2).mean().sqrt()), 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", type=Path)
    ap.add_argument("--head", type=Path, required=True, help="a head trtspec distill wrote for SPEC, its capture kept")
    ap.add_argument("--train-sample", type=int, default=150, help="training sequences scored (seeded sample)")
    ap.add_argument("--result", help="also write lab/results/RESULT.json")
    args = ap.parse_args()
    values = fit(args.spec, args.head, args.train_sample)
    for w in values["moved"]:
        print(f"moved {w['weight']}: {w['rms_ratio']:.2f} of its rms")
    if args.result:
        print(f"wrote {write_result(RESULTS / f'{args.result}.json', command_line('head_fit.py'), values)}")


if __name__ == "__main__":
    main()
