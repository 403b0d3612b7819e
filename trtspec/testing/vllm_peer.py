"""vLLM as a peer: one LLM in this process, driven by JSON lines. Runs inside vLLM's own
environment (`make vllm` creates .venv-vllm); trtspec never imports vLLM, it starts this file:

    .venv-vllm/bin/python trtspec/testing/vllm_peer.py   # reads requests on stdin, answers on stdout

One JSON object per line each way; every answer has "ok" (and "error" when false):
  {"op": "load", "model": DIR, "dtype": "float32", "speculative": null | {...vLLM's speculative_config},
   "max_model_len": N, "max_num_seqs": N, "enable_prefix_caching": bool}
      -> {"ok": true, "vllm": version, "torch": version, "seconds": load time}
  {"op": "generate", "prompts": [[ids], ...], "max_tokens": N, "stop_token_ids": [ids]}
      -> {"ok": true, "outputs": [[ids], ...], "seconds": wall time of llm.generate,
          "spec": {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"}}
  {"op": "quit"} -> {"ok": true}, then exit

Greedy (temperature 0), the prompts as token ids (no tokenizer on the way in, no detokenizing
on the way out); all prompts of one request go to one llm.generate call (the concurrency).
"spec" is the change in vLLM's own counters (vllm:spec_decode_*) over that call; all zeros
without a speculative config. vLLM logs to stdout by default, so the answers go to the
process's original stdout and everything else (fd 1 included) to stderr.

Only the standard library and vLLM: this file must not import trtspec (vllm_worker.py starts it
by its path, in vLLM's environment).
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (needs disable_log_stats=False)."""
    out = {name: 0 for name in SPEC_COUNTERS.values()} | {"accepted_per_pos": []}
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POS:
            out["accepted_per_pos"] = [int(v) for v in metric.values]
    return out


def difference(after: dict, before: dict) -> dict:
    out = {key: after[key] - before[key] for key in SPEC_COUNTERS.values()}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"]
    out["accepted_per_pos"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return out


class Peer:
    def __init__(self) -> None:
        self.llm = None

    def load(self, req: dict) -> dict:
        import torch
        import vllm
        from vllm import LLM

        start = time.perf_counter()
        kwargs = dict(
            model=req["model"],
            dtype=req.get("dtype", "float32"),
            max_model_len=req.get("max_model_len"),
            max_num_seqs=req.get("max_num_seqs", 4),
            enable_prefix_caching=req.get("enable_prefix_caching"),
            seed=0,
            disable_log_stats=False,  # the spec_decode counters live in the stats
        )
        if req.get("speculative"):
            kwargs["speculative_config"] = req["speculative"]
        self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})
        return {"vllm": vllm.__version__, "torch": torch.__version__, "seconds": time.perf_counter() - start}

    def generate(self, req: dict) -> dict:
        from vllm import SamplingParams

        if self.llm is None:
            raise RuntimeError("no model loaded; send a load request first")
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(req["max_tokens"]),
            stop_token_ids=list(req.get("stop_token_ids") or []),
            detokenize=False,
        )
        prompts = [{"prompt_token_ids": list(ids)} for ids in req["prompts"]]
        before = spec_counters(self.llm)
        start = time.perf_counter()
        results = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        spec = difference(spec_counters(self.llm), before)
        return {"outputs": [list(r.outputs[0].token_ids) for r in results], "seconds": seconds, "spec": spec}


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the JSON channel: the original stdout
    os.dup2(2, 1)  # anything printed from here on (vLLM's logs) goes to stderr
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    peer = Peer()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "quit":
                answers.write(json.dumps({"ok": True}) + "\n")
                return 0
            if op not in ("load", "generate"):
                raise ValueError(f"unknown op {op!r}; use load, generate or quit")
            answer = {"ok": True} | getattr(peer, op)(req)
        except Exception as e:  # one bad request answers an error; the process stays up
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # Leave at once, skipping the interpreter's shutdown with vLLM's engine in this process:
    # workers whose parent had died were seen spinning on the CPU (state R) until killed.
    os._exit(code)
