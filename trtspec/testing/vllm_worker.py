"""vLLM as a peer, driven from outside its environment: one vllm_peer.py process (beside this
file; it imports only vLLM and the standard library) speaking JSON lines, as the lab's peer
benches (lab/peers.py, lab/distill_peers.py) and the product's vLLM contract test
(tests/test_vllm_head.py) run it. vLLM lives in its own environment (`make vllm`: .venv-vllm)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from trtspec.errors import EngineError

PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")


class VllmWorker:
    """One vllm_peer.py process (beside this file) holding one vLLM ``LLM`` (see that file for the protocol).

    vLLM lives in its own environment (`make vllm`: .venv-vllm) and is never imported here.
    Its log goes to ``log``; an error names that file."""

    def __init__(self, python: Path, script: Path, load: dict, env: dict[str, str], log: Path):
        self.log = Path(log)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a", encoding="utf-8") as err:
            self.proc = subprocess.Popen(
                [str(python), str(script)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
            )
        try:
            self.info = self.call({"op": "load"} | load)
        except BaseException:
            self.close()
            raise

    def call(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            try:
                code = self.proc.wait(timeout=30)  # its stdout closed: it is exiting
            except subprocess.TimeoutExpired:
                code = None
            raise EngineError(f"the vLLM peer exited (code {code}){self._last_log_line()}; see its log {self.log}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise EngineError(f"vLLM peer: {answer.get('error')}; see its log {self.log}")
        return answer

    def _last_log_line(self) -> str:
        try:
            lines = [x for x in self.log.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return f": {lines[-1].strip()[:300]}" if lines else ""

    def close(self) -> None:
        """Ask the process to quit; stop it if it does not within 30 s."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()


def vllm_env(kv_cache_gib: int) -> dict[str, str]:
    """The worker's environment: the engine in its process, a KV cache sized for a bench (vLLM's
    CPU default would take GiBs per process), OMP_NUM_THREADS removed. With the engine in the
    worker's own process vLLM 0.32 neither binds its OpenMP threads nor cuts torch to one thread,
    so its threads spin-wait against any other job: on a shared 2-core machine its decode steps
    took seconds. Where acceptance alone is scored beside other work, OMP_WAIT_POLICY=PASSIVE in
    the caller's environment (kept here) stops the spinning; it gave identical acceptance counts."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    return env | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
