"""The co-designed heads side by side, as a picture: per-position acceptance and the expected
acceptance length of each head on the same unseen chains (distill's report: the demo's
capture, 1,042 chains of prompts no head saw), from the committed result files.

    python -m lab.plot_heads            # writes docs/images/codesign-heads.png (make figures)

Heads: trtspec's from lab/results/distill-ablation-xeon.json (one change from the default
recipe each), speculators' and SpecForge's from lab/results/distill-peers.json (trained on
the same data, converted to trtspec's head layout and run by trtspec).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from lab._common import ROOT

RESULTS = ROOT / "lab" / "results"
OUT = ROOT / "docs" / "images" / "codesign-heads.png"
# ablation variant -> its label in the plot
TRTSPEC_HEADS = {
    "soft": "trtspec, depth 1 (the default)",
    "soft-ttt3": "trtspec, 3 TTT steps",
    "norms-ttt3": "trtspec, 3 TTT steps + EAGLE-3.1 norms",
}

PEER_TRAINERS = ("speculators", "SpecForge")  # distill-peers rows of the peer trainers' heads


def heads(results: Path = RESULTS) -> dict[str, list[float]]:
    """Per-position acceptance (P(draft j right | drafts before it right), j = 1..3) per head."""
    rows = {r["variant"]: r for r in json.loads((results / "distill-ablation-xeon.json").read_text())["values"]["rows"]}
    out = {label: rows[v]["per_position"][:3] for v, label in TRTSPEC_HEADS.items() if v in rows}
    peers = json.loads((results / "distill-peers.json").read_text())["values"]["table"]["rows"]
    for row in peers:
        if row[0].startswith(PEER_TRAINERS):
            # "1.644 (0.37 / 0.47 / 0.56)": trtspec's scoring of the peer's head, per position
            match = re.search(r"\(([\d. /]+)\)", row[3])
            if match:
                trainer = row[0].split(",")[0].split(" ")[0]  # "SpecForge 0.2.0, 1 epoch" -> "SpecForge"
                out[f"{trainer} ({row[0].split(', ')[-1]})"] = [float(x) for x in match.group(1).split("/")]
    return out


def expected_lengths(per_position: list[float]) -> list[float]:
    """Expected tokens per target forward at k = 1..len: 1 + a1 + a1 a2 + ..."""
    out, run, total = [], 1.0, 1.0
    for a in per_position:
        run *= a
        total += run
        out.append(total)
    return out


def plot(data: dict[str, list[float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(data))
    for n, (label, acc) in enumerate(data.items()):
        xs = [j + 1 + (n - (len(data) - 1) / 2) * width for j in range(len(acc))]
        left.bar(xs, acc, width, label=label)
        right.plot(range(1, len(acc) + 1), expected_lengths(acc), marker="o", label=label)
    left.set(xlabel="draft position j", ylabel="acceptance at j (given 1..j-1 accepted)", xticks=[1, 2, 3], ylim=(0, 1))
    left.set_title("per position, unseen prompts")
    right.set(xlabel="k (draft tokens)", ylabel="expected tokens per target forward", xticks=[1, 2, 3])
    right.set_title("acceptance length")
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    print(f"wrote {plot(heads(args.results), args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
