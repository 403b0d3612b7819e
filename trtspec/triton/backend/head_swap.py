"""A new EAGLE-3 head for a running endpoint, without reloading the model (`trtspec refresh`).

The head runs inside each speculative endpoint instance, beside its loop. `trtspec refresh`
writes the head it deploys into the repository's control file (``CONTROL_FILE``, or the file
$TRTSPEC_HEAD_CONTROL names in the server's environment; written atomically:
a reader sees the old record or the new one); every instance watches that file on a thread of
its own, loads the head it names in the background while the old head keeps drafting, and
then hands it to its scheduler, which stops admitting requests until the ones in flight have
finished on the old head, starts a new batch on the new head and admits again. So no request
is failed, dropped or moved to another head mid-generation, and answers stay the target's
(greedy verification does not depend on the draft).

Version 1 is the head the repository was written with; the file numbers every later one. A
head that cannot be loaded is logged and skipped: the instance keeps the head it serves, and
its ``trtspec_eagle3_head_version`` gauge tells `trtspec refresh` that it never swapped.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trtspec.triton.backend import log

CONTROL_FILE = "eagle3_head.json"  # in the model repository's root ...
CONTROL_ENV = "TRTSPEC_HEAD_CONTROL"  # ... or this file (a volume the server and the refresh job share)
POLL_S = 0.5  # how often an instance looks at the control file


@dataclass(frozen=True)
class HeadRecord:
    """The head the control file says every instance should serve."""

    version: int
    head: str  # the head engine folder
    live: float | None = None  # acceptance at k=1 on held-out captured requests: the head it replaced
    new: float | None = None  # ... and this head


def control_file(repository: Path) -> Path:
    """Where the head to serve is named: $TRTSPEC_HEAD_CONTROL, else the repository's own file."""
    return Path(os.environ.get(CONTROL_ENV) or repository / CONTROL_FILE)


def read_record(path: Path) -> HeadRecord | None:
    """The control file's current head; None when there is none (or it cannot be read)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return HeadRecord(int(data["version"]), str(data["head"]), data.get("live"), data.get("new"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class HeadSwap:
    """One endpoint instance's head: the one it serves, and the next one once loaded."""

    def __init__(self, control: Path, load: Callable[[str], object], folder: str, on_swap: Callable[[HeadRecord], None]):
        self.control = control
        self._load = load  # head folder -> head engine (HeadEngine.load_beside)
        self.head = load(folder)  # the head engine new batches draft with
        self.record = HeadRecord(1, folder)  # what it serves: version 1 is the repository's own head
        self._on_swap = on_swap  # metrics and log, once a head serves
        self._next: tuple[HeadRecord, object] | None = None
        self._tried = 1  # the newest version asked for (loaded or failed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.wake: Callable[[], None] = lambda: None  # the scheduler's, so an idle one swaps at once

    def start(self) -> None:
        threading.Thread(target=self._watch, name="trtspec-head-swap", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Load the head the control file names, if it is newer than any asked for."""
        record = read_record(self.control)
        if record is None or record.version <= self._tried:
            return
        self._tried = record.version
        try:
            engine = self._load(record.head)
        except Exception as err:  # the instance keeps its head; refresh sees the version unchanged
            log.error(f"eagle3 head version {record.version} ({record.head}) could not be loaded: {type(err).__name__}: {err}")
            return
        with self._lock:
            self._next = (record, engine)
        self.wake()

    def due(self) -> bool:
        """A loaded head waits for the batch to drain."""
        with self._lock:
            return self._next is not None

    def apply(self) -> None:
        """The batch is empty: the loaded head serves from now on (the next batch drafts with it)."""
        with self._lock:
            if self._next is None:
                return
            (self.record, self.head), self._next = self._next, None
        self._on_swap(self.record)


def announce(metrics, record: HeadRecord) -> None:
    """A head serves new requests: logged, and on the metrics port (metrics.EndpointMetrics.head)."""
    figures = "" if record.new is None else f"; acceptance at k=1 on held-out captured requests {record.live} -> {record.new}"
    log.info(f"eagle3 head version {record.version} ({record.head}) drafts for new requests{figures}")
    if metrics is not None:
        metrics.head(record.version, record.live, record.new)
