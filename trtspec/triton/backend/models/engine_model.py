"""`tensorrt_llm` / `tensorrt_llm_draft`: a torch engine behind the tensorrt_llm tensor contract.

Dynamic batching hands execute() every request queued meanwhile (from several orchestrator
instances, or several rows of one); they are answered by ONE batched run of the engine, which
keeps its prefix KV cache between requests (re-sent sequences are not recomputed).

Config parameters: engine_dir, role, kv_cache_slots, max_draft_len, vocab_limit (optional),
exclude_input_in_output, capture_layers (optional, eagle3: answer hidden_states_from requests),
capture (optional, serve.capture as JSON: keep the answered requests the endpoints send; their
parts are written on a thread of their own, drained when the model is unloaded).
"""

from __future__ import annotations

import json
from pathlib import Path

from trtspec.engines.torch.engine import TorchEngine
from trtspec.errors import RequestError
from trtspec.spec import CaptureSpec
from trtspec.speculative.capture import CaptureWriter
from trtspec.speculative.requests import Limits
from trtspec.triton.backend import callers, log
from trtspec.triton.backend.engine_core import EngineCore
from trtspec.triton.backend.models import pb


def capture_writer(text: str, engine: TorchEngine) -> CaptureWriter:
    """serve.capture's writer from the model parameter (JSON of its CaptureSpec, dir absolute)."""
    spec = CaptureSpec(**json.loads(text))
    return CaptureWriter(spec, Path(spec.dir), engine)


class TritonPythonModel:
    def initialize(self, args):
        params = pb.parameters(args)
        config = pb.model_config(args)
        # a server's engine: every matmul shape made now, so serving never adds one (engine.py).
        # Compiled steps where measured faster (compiled.py), each kind compiled now at every
        # thread count the governor compares, so no request waits for a compile.
        self.engine = TorchEngine.load(Path(params["engine_dir"]), int(params["kv_cache_slots"]), warm=True)
        limits = Limits(
            vocab_size=self.engine.vocab_size,
            max_seq_len=self.engine.max_seq_len,
            max_draft_len=int(params.get("max_draft_len", "0")),
            max_batch_size=int(config["max_batch_size"]),
        )
        vocab_limit = int(params["vocab_limit"]) if "vocab_limit" in params else None
        exclude = params.get("exclude_input_in_output", "false").lower() == "true"
        features_of = capture = None
        if params.get("capture_layers"):  # method eagle3: keep the features the head reads
            self.engine.capture_features(tuple(int(x) for x in params["capture_layers"].split(",")))
            features_of = self.engine.features_of
        if params.get("capture"):  # serve.capture: keep the answered requests the endpoints send
            capture = capture_writer(params["capture"], self.engine)
        self.core = EngineCore(self.engine.run, limits, vocab_limit, exclude, features_of, lambda: self.engine.last_use, capture)
        self.capture = capture  # closed (its parts written) when the model is unloaded
        self.name = args["model_name"]
        self.key = callers.server_key()  # only the repository's own BLS models may call (callers.py)
        if self.key is None:  # fail closed: no caller can be told from the endpoints
            log.error(callers.no_key_error(self.name))

    def execute(self, requests):
        """One batched engine run for the requests of this repository's endpoints; any other
        caller is refused by name before its inputs are read (callers.py says why), and every
        caller where this server has no key."""
        inside = [pb.from_inside(r, self.key) for r in requests]
        answers = iter(self.core.infer([pb.inputs_of(r) for r, ok in zip(requests, inside) if ok]))
        outside = RuntimeError(callers.no_key_error(self.name))
        if self.key is not None:
            outside = RequestError(callers.outside_error(self.name))
        out = []
        for ok in inside:
            a = next(answers) if ok else outside
            out.append(pb.error_response(a) if isinstance(a, Exception) else pb.response(a))
        return out

    def finalize(self):
        """Unload: serve.capture's writer writes the parts it holds, then stops."""
        if self.capture is not None:
            self.capture.close()
