"""`trtspec refresh SPEC --url HOST:PORT --every 30m`: the head follows the traffic by itself.

Each round: `trtspec distill SPEC --from-capture DIR --init LIVE -o NEW` continues the live
head on what serve.capture kept (in a process of its own, at the lowest CPU priority, `nice -n
19`, one torch thread unless TRTSPEC_THREADS says otherwise; the serving engines' thread
governor gives up a core while it runs, engines/torch/threads.py), then `refresh` deploys NEW
only when it beats the live head (distill/refresh.py). A round that trains nothing (too few
captured requests yet) or deploys nothing is logged and the next one comes a period later;
Ctrl-C stops between rounds or ends the training (exit 130).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trtspec import console
from trtspec.distill.refresh import Identical, refresh
from trtspec.distill.swap import Deployed
from trtspec.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, RuntimeFailure, TrtspecError
from trtspec.machine import THREADS_ENV
from trtspec.spec import LoadedSpec

NICE = 19  # the lowest priority: serving always comes first


@dataclass
class LoopOptions:
    every_s: float  # the period between rounds
    capture: Path  # serve.capture's folder
    work: Path  # the refresh folder: each round's head in rounds/, the built heads in v<N>/
    rounds: int | None = None  # None: until interrupted
    distill_args: list[str] = field(default_factory=list)  # passed on, e.g. --max-steps 300


def distill_command(loaded: LoadedSpec, init: Path, out: Path, opts: LoopOptions) -> list[str]:
    """The round's training, as a low-priority process of its own."""
    spec = str(loaded.path)
    args = ["distill", spec, "--from-capture", str(opts.capture), "--init", str(init), "-o", str(out), *opts.distill_args]
    return ["nice", "-n", str(NICE), sys.executable, "-m", "trtspec", *args]


def train(loaded: LoadedSpec, init: Path, out: Path, opts: LoopOptions) -> Path | None:
    """Run the round's distill; the new head, or None when there was not enough to train on."""
    env = {**os.environ, THREADS_ENV: os.environ.get(THREADS_ENV, "1")}
    code = subprocess.run(distill_command(loaded, init, out, opts), env=env, check=False).returncode  # noqa: S603
    if code == EXIT_INTERRUPTED or code < 0:
        raise KeyboardInterrupt
    if code == EXIT_BAD_INPUT:
        console.info("refresh: this round trains nothing (distill refused its input, above); the next round tries again")
        return None
    if code != 0:
        raise RuntimeFailure(f"distill --from-capture failed (exit {code}); its output above says why")
    return out


Round = Callable[[int], str]  # one round (its number) -> the line that says what it did


def run_loop(one_round: Round, opts: LoopOptions, sleep: Callable[[float], None] = time.sleep) -> int:
    """Rounds every ``opts.every_s`` seconds; a failed round is logged and the loop goes on.
    Returns the number of rounds run."""
    n = 0
    while opts.rounds is None or n < opts.rounds:
        n += 1
        try:
            console.info(f"refresh round {n}: {one_round(n)}")
        except TrtspecError as err:  # this round only: the deployment serves on, the next round retries
            console.info(f"refresh round {n}: nothing deployed: {err}")
        if opts.rounds is None or n < opts.rounds:
            sleep(opts.every_s)
    return n


def init_head(loaded: LoadedSpec, live: dict) -> Path:
    """The head a round continues: the live one's distill folder (its manifest names its data),
    the spec's draft.path for the repository's own head, else the served head engine itself."""
    if live.get("source"):
        return Path(live["source"])
    draft = loaded.spec.draft
    if draft is not None and draft.path is not None and loaded.resolve(draft.path).is_dir():
        return loaded.resolve(draft.path)
    return Path(live["head"])  # a head folder too; without a distill manifest, the spec's data are replayed


def loop(loaded: LoadedSpec, url: str, metrics_url: str, opts: LoopOptions, identical: Identical, margin: float) -> int:
    """capture -> distill --from-capture -> refresh, every ``opts.every_s`` seconds."""

    def one_round(n: int) -> str:
        deployed = Deployed(loaded, url, metrics_url)
        out = opts.work / "rounds" / f"head-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        head = train(loaded, init_head(loaded, deployed.live), out, opts)
        if head is None:
            return "nothing to train on yet"
        return refresh(loaded, deployed, head, identical, margin, opts.work).summary()

    return run_loop(one_round, opts)
