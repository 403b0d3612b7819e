"""The running deployment `trtspec refresh` changes: which head it serves, and the swap.

The server is reached at --url (gRPC) to check that it serves this spec's engines with an
EAGLE-3 endpoint, and at its metrics port to see every speculative endpoint instance take the
new head (``trtspec_eagle3_head_version``). The head itself is put in through the control file
(triton/backend/head_swap.py: the repository's, or $TRTSPEC_HEAD_CONTROL's), written
atomically; the file also keeps every version deployed, newest last (what --rollback returns to).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from pathlib import Path

from trtspec import console
from trtspec.errors import RequestError, RuntimeFailure
from trtspec.files import write_json_atomic
from trtspec.layout import BLS_MODEL, engine_folder
from trtspec.spec import LoadedSpec
from trtspec.triton.backend.head_swap import CONTROL_ENV, control_file

HEAD_PARAM = "eagle3_head_dir"  # the endpoints' config parameter: the repository's own head (version 1)
VERSION_METRIC = "trtspec_eagle3_head_version"
SWAP_WAIT_S = 300.0  # how long every instance may take to load the head and drain its batch


class Deployed:
    """This spec's deployment as served at ``url``, its metrics at ``metrics_url`` (HOST:PORT)."""

    def __init__(self, loaded: LoadedSpec, url: str, metrics_url: str):
        self.url, self.metrics_url = url, metrics_url
        self.control = control_file(loaded.repo_dir())
        if not os.environ.get(CONTROL_ENV) and not (loaded.repo_dir() / BLS_MODEL).is_dir():
            raise RequestError(
                f"{loaded.repo_dir()} holds no model repository; refresh a deployment `trtspec serve` runs from this spec's repository"
            )
        served, own = Path(self._served_head()), engine_folder(loaded.output_dir(), "draft")
        if served.resolve() != own.resolve():
            raise RequestError(
                f"the server at {url} was started with the head {served}, not this spec's ({own}); fix --url or the spec"
            )
        self.history = self._read_history(served)

    def _served_head(self) -> str:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        try:
            client = grpcclient.InferenceServerClient(self.url)
            config = client.get_model_config(BLS_MODEL, as_json=True, client_timeout=10)["config"]
        except (InferenceServerException, ValueError) as err:
            raise RequestError(
                f"cannot reach {BLS_MODEL} at {self.url} ({str(err).splitlines()[0]}); fix --url HOST:PORT "
                "(the gRPC port of the running `trtspec serve`)"
            ) from None
        head = config.get("parameters", {}).get(HEAD_PARAM, {}).get("string_value")
        if not head:
            raise RequestError(
                f"the server at {self.url} serves no EAGLE-3 head of its own; refresh swaps the head of method eagle3 on the torch backend"
            )
        return head

    def _read_history(self, served: Path) -> list[dict]:
        if not self.control.is_file():
            return [{"version": 1, "head": str(served)}]  # as `trtspec serve` started it
        try:
            history = json.loads(self.control.read_text(encoding="utf-8"))["history"]
            if not isinstance(history, list) or not history or not all("version" in h and "head" in h for h in history):
                raise ValueError("no versions")
        except (OSError, ValueError, KeyError, TypeError):
            raise RequestError(
                f"{self.control} is not a refresh record; restore it or remove it (version 1 serves then)"
            ) from None
        return history

    @property
    def live(self) -> dict:
        return self.history[-1]

    def put(self, head: str, **figures) -> dict:
        """Every instance serves ``head`` as the next version (waits until they all do)."""
        entry = {"version": self.live["version"] + 1, "head": head, **figures}
        write_json_atomic(self.control, entry | {"history": self.history + [entry]})
        self.history = self.history + [entry]
        self._wait(entry["version"])
        return entry

    def _wait(self, version: int, timeout_s: float = SWAP_WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while (seen := self.versions()) != {version}:
            if time.monotonic() > deadline:
                raise RuntimeFailure(
                    f"the server's instances serve head versions {sorted(seen)} after {timeout_s:g} s, not {version}; "
                    "its log says why (a head that cannot be loaded)"
                )
            time.sleep(0.25)
        console.info(f"every speculative endpoint instance drafts with head version {version}")

    def versions(self) -> set[int]:
        """The head version of every speculative endpoint instance, from the metrics port."""
        try:
            with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=10) as r:  # noqa: S310 - http only
                text = r.read().decode("utf-8", "replace")
        except OSError as err:
            raise RuntimeFailure(f"cannot read the server's metrics at {self.metrics_url} ({err}); pass --metrics-port") from None
        pattern = rf"^{VERSION_METRIC}\{{[^}}]*\}} ([0-9.e+]+)$"
        return {int(float(v)) for v in re.findall(pattern, text, flags=re.MULTILINE)}
