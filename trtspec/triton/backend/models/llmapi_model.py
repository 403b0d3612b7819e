"""`tensorrt_llm_bls`, `tensorrt_llm_bls_streaming` (decoupled) and `target_only` for
trtllm.runtime llmapi: the LLM API inside Triton.

Reads its LLM arguments from model.yaml (env LLM_CONFIG_PATH, else <model>/<version>/
model.yaml) as upstream's llmapi model does: `triton_config` is Triton's block, everything
else goes through update_llm_args_with_extra_dict into LLM(**args). Our own code; the request
contract is trtspec's (llmapi_core). Parameter `llmapi_impl` says whether the LLM is
tensorrt_llm or trtspec's CPU conformance double.
"""

from __future__ import annotations

import os
from pathlib import Path

from trtspec.triton.backend.models import pb
from trtspec.triton.backend.params import LlmapiEndpointParams


class TritonPythonModel:
    def initialize(self, args):
        params = LlmapiEndpointParams.from_params(pb.parameters(args))
        config = pb.model_config(args)
        if params.gpu_device_ids:
            # before tensorrt_llm (and CUDA) load, so its workers inherit the restriction
            os.environ["CUDA_VISIBLE_DEVICES"] = params.gpu_device_ids
        from transformers import AutoTokenizer

        from trtspec.speculative.llmapi import load_api, make_llm
        from trtspec.speculative.requests import end_token_ids
        from trtspec.triton.backend.llmapi_core import LlmapiEndpoint

        default = Path(args["model_repository"]) / str(args["model_version"]) / "model.yaml"
        yaml_path = Path(os.environ.get("LLM_CONFIG_PATH", default))
        self.api = load_api(params.llmapi_impl, params.trtllm_line)
        self.llm = make_llm(self.api, yaml_path)
        tokenizer_dir = Path(params.tokenizer_dir)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.core = LlmapiEndpoint(
            params.settings(self.decoupled, int(config["max_batch_size"])),
            tokenizer,
            end_token_ids(tokenizer, tokenizer_dir),
            self.llm,
            self.api,
            max_queue=params.max_queue,  # serve.max_queue
        )

    def execute(self, requests):
        if not self.decoupled:
            answers = self.core.run([pb.inputs_of(r) for r in requests])
            return [pb.error_response(a) if isinstance(a, Exception) else pb.response(a) for a in answers]
        for request in requests:  # each stream runs on its own thread; the LLM API batches them
            # each on its own: execute() never raises (pb.guarded says why)
            pb.guarded(request, lambda r=request: self.core.submit_stream(pb.inputs_of(r), pb.Reply(r)))
        return None

    def finalize(self):
        self.llm.shutdown()
