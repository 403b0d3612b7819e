"""`trtspec refresh SPEC --url HOST:PORT --head NEW`: put a continued head into a running Triton
deployment, without a restart or a reload, only when it is better (docs/refresh.md).

The new head (a `distill --from-capture` output) and the live one are scored at k=1 on the
held-out captured requests the new head's manifest names (never trained on); unless the new
one beats the live one by --margin, nothing changes (exit 1). Otherwise it is built in the
refresh folder (checked against the target as `trtspec build` checks a head) and put in through
the control file (distill/swap.py): every endpoint instance loads it while the old head drafts, lets the requests in flight finish on the old head, and drafts new requests with
the new one. Then `verify --url` must find the speculative answers identical to target-only,
or the previous head is put back (exit 1). --rollback puts back the head before the live one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trtspec import console
from trtspec.distill.heads import HEAD_MANIFEST
from trtspec.distill.options import DistillOptions
from trtspec.distill.refine import figures, reaching, read_head
from trtspec.distill.swap import Deployed
from trtspec.distill.trainer import Trainer
from trtspec.errors import RequestError, RuntimeFailure, TrtspecError
from trtspec.layout import engine_folder
from trtspec.spec import LoadedSpec
from trtspec.speculative.capture import read_capture


class Refused(TrtspecError):
    """The head is not deployed: it does not beat the live one, or verify found a divergence."""

    exit_code = 1


@dataclass
class RefreshResult:
    action: str  # "deployed" or "rolled back"
    version: int
    head: str  # the head engine folder new requests draft with
    live: float | None = None  # acceptance at k=1 on the held-out captured requests: the head replaced
    new: float | None = None  # ... and the head deployed

    def to_dict(self) -> dict:
        return {"action": self.action, "version": self.version, "head": self.head, "live": self.live, "new": self.new}

    def summary(self) -> str:
        shown = (
            "" if self.live is None else f" (acceptance at k=1 on held-out captured requests: {self.live:.3f} -> {self.new:.3f})"
        )
        return f"{self.action}: version {self.version} serves {self.head}{shown}"


Identical = Callable[[LoadedSpec, str], bool]  # whether `verify --url` passes (the CLI gives it)


def refresh_dir(loaded: LoadedSpec) -> Path:
    """Where refresh builds heads and the loop trains them, unless --refresh-dir says: beside the engines."""
    return loaded.output_dir().with_name(loaded.output_dir().name + ".refresh")


def refresh(
    loaded: LoadedSpec, deployed: Deployed, head: Path, identical: Identical, margin: float = 0.0, folder: Path | None = None
) -> RefreshResult:
    """Deploy ``head`` into ``deployed`` when it beats the live head by ``margin`` at k=1; the
    head engine is built in ``folder`` (default refresh_dir)."""
    check_head(head)
    live_dir = Path(deployed.live["head"])
    live, new = measure(loaded, live_dir, head)
    console.info(f"acceptance at k=1 on the held-out captured requests: live head {live:.3f}, new head {new:.3f}")
    if not new > live + margin:  # it must beat the live head, not tie it
        raise Refused(
            f"{head} is not deployed: {new:.3f} at k=1 on the held-out captured requests, the live head "
            f"{live:.3f} (--margin {margin:g}); the live head still serves"
        )
    built = build_head(loaded, head, deployed.live["version"] + 1, folder)
    entry = _put(deployed, str(built), source=str(head.resolve()), live=live, new=new)
    _check(loaded, deployed, identical, live_dir, f"with {head}")
    console.info(f"deployed: version {entry['version']} serves {built} ({live:.3f} -> {new:.3f} at k=1)")
    return RefreshResult("deployed", entry["version"], str(built), live, new)


def check_head(head: Path) -> None:
    if not head.is_dir():
        raise RequestError(f"--head: {head} is not a folder; pass the folder `distill --from-capture -o NEW` wrote")


def rollback(loaded: LoadedSpec, deployed: Deployed, identical: Identical) -> RefreshResult:
    """Put back the head that served before the live one."""
    if len(deployed.history) < 2:
        raise RequestError(f"--rollback: {deployed.control} records no head before the live one")
    live_dir, previous = Path(deployed.live["head"]), deployed.history[-2]
    entry = _put(deployed, previous["head"], rollback_of=deployed.live["version"])
    _check(loaded, deployed, identical, live_dir, "after the rollback")
    console.info(f"rolled back: version {entry['version']} serves {previous['head']} again")
    return RefreshResult("rolled back", entry["version"], previous["head"])


def _put(deployed: Deployed, head: str, **record) -> dict:
    """``head`` serves every instance; if they do not all take it, the live head is put back."""
    live = deployed.live
    try:
        return deployed.put(head, **record)
    except RuntimeFailure as err:
        deployed.put(live["head"], rollback_of=live["version"] + 1)
        raise RuntimeFailure(f"{err}; the live head serves again") from None


def _check(loaded: LoadedSpec, deployed: Deployed, identical: Identical, back: Path, what: str) -> None:
    """`verify --url` on the new head; a divergence puts ``back`` back (exit 1)."""
    if identical(loaded, deployed.url):
        return
    entry = deployed.put(str(back), rollback_of=deployed.live["version"])
    raise Refused(
        f"verify --url found speculative answers that differ from target-only {what}; version {entry['version']} serves {back} again"
    )


def measure(loaded: LoadedSpec, live: Path, new: Path) -> tuple[float, float]:
    """Acceptance at k=1 of the live and the new head on the held-out captured requests that
    ``new``'s manifest names (distill --from-capture never trained on them)."""
    from transformers import AutoConfig

    from trtspec.engines.eagle3_checkpoint import read_head_config
    from trtspec.engines.torch.engine import TorchEngine

    held = held_out(new)
    folder = engine_folder(loaded.output_dir(), "target")
    hf = AutoConfig.from_pretrained(folder)
    engine = TorchEngine.load(folder, slots=1)
    target = reaching(engine, hf, max(len(s.tokens) for s in held))
    layer_ids = tuple(read_head_config(live, hf.num_hidden_layers).layer_ids)  # the features the server captures
    scores = []
    for path in (live, new):
        head, _, draft_ids = read_head(path, hf.num_hidden_layers, layer_ids, engine.vocab_size)
        trainer = Trainer(head, target, draft_ids, DistillOptions(), 1, None)
        scores.append(figures(trainer, held, [], 0)["held_out_captured"] or 0.0)
    return scores[0], scores[1]


def held_out(new: Path) -> list:
    """The captured requests ``new`` was held out from, as distill samples."""
    path = new / HEAD_MANIFEST
    try:
        continued = json.loads(path.read_text(encoding="utf-8"))["continued"]
        ids, folder = set(continued["held_requests"]), Path(continued["capture"])
    except (OSError, ValueError, KeyError, TypeError):
        raise RequestError(
            f"--head: {new} names no held-out captured requests ({HEAD_MANIFEST}); refresh takes a head `distill --from-capture` wrote"
        ) from None
    held = [c.sample for c in read_capture(folder) if c.record.get("request_id") in ids]
    if not held:
        raise RequestError(f"--head: none of its held-out captured requests is left in {folder} (purged?); distill it again")
    return held


def build_head(loaded: LoadedSpec, head: Path, version: int, folder: Path | None = None) -> Path:
    """``head`` built as the deployment's head engine in ``folder``/v<version> (default
    refresh_dir); the built head engine folder."""
    from trtspec.engines.build import build

    spec = loaded.spec
    other = LoadedSpec(
        spec=spec.model_copy(update={"draft": spec.draft.model_copy(update={"path": str(head.resolve())})}), path=loaded.path
    )
    out = (folder or refresh_dir(loaded)) / f"v{version}"
    build(other, out, force=True, roles=("draft",))  # checked against the target as build checks a pair
    return engine_folder(out, "draft").resolve()
