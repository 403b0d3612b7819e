"""The backends verify runs on: the torch engines in this process (divergences replayed and
classed), the LLM API in this process, or a served repository over gRPC (triton/client.py)."""

from __future__ import annotations

import time
from pathlib import Path

from trtspec import console
from trtspec.errors import EngineError, RequestError
from trtspec.layout import tokenizer_folder
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.speculative.loop import PathRun
from trtspec.speculative.metrics import SpecMetrics
from trtspec.verify.identity import Divergence, VerifyBackend
from trtspec.verify.verdicts import DEFAULT_EPSILON, DivergenceVerdict, classify, replay


class InProcessBackend:
    """VerifyBackend over a loaded Deployment (torch engines in this process)."""

    def __init__(
        self,
        deployment,
        chat_template: bool | None = None,
        num_draft_tokens: int | None = None,
        epsilon: float | None = None,
    ):
        self.dep = deployment
        self.chat_template = chat_template
        self.num_draft_tokens = num_draft_tokens  # as asked; None: the deployment's default
        self.decided: int | None = None  # as the request rules decided it (decided_draft_tokens)
        self.epsilon = epsilon if epsilon is not None else DEFAULT_EPSILON[deployment.target.manifest.dtype]

    def run(self, prompt: str, max_tokens: int, speculative: bool) -> PathRun:
        ids = self.dep.encode(prompt, self.chat_template)
        req = self.dep.request(ids, max_tokens, self.num_draft_tokens)
        self.decided = req.num_draft_tokens
        self.dep.forget_prefixes()  # neither path may reuse the other's prefill of this prompt
        start = time.perf_counter()
        (res,) = self.dep.generate([req], speculative=speculative)
        seconds = time.perf_counter() - start
        return PathRun(res.output_ids, res.margins, res.metrics if speculative else None, seconds, ids, res.steps, res.step_trees)

    def token_text(self, token_id: int) -> str:
        return self.dep.tokenizer.decode([token_id])

    def decided_draft_tokens(self) -> int | None:
        if self.decided is None:  # asked before the run
            self.decided = self.dep.decided_draft_tokens(self.num_draft_tokens)
        return self.decided

    def classify(self, target: PathRun, spec: PathRun, div: Divergence) -> DivergenceVerdict:
        steps = spec.steps or []
        if not any(s <= div.index <= s + k for s, k in steps):
            return DivergenceVerdict("algorithmic", f"no speculative step produced token {div.index}", self.epsilon)
        engine = self.dep.target
        rep = replay(engine.run, engine.forget_prefixes, spec.prompt_ids, spec.output_ids, steps, div.index, spec.step_trees)
        return classify(rep, div.target_id, div.spec_id, self.dep.end_ids, self.epsilon)


class LlmapiBackend:
    """VerifyBackend over a runtime.LlmapiDeployment (the LLM API in this process)."""

    def __init__(self, dep, chat_template: bool | None = None):
        self.dep = dep
        self.chat_template = dep.spec.verify.chat_template if chat_template is None else chat_template

    def run(self, prompt: str, max_tokens: int, speculative: bool) -> PathRun:
        from trtspec.speculative.llmapi import acceptance
        from trtspec.speculative.requests import encode_prompt

        ids = encode_prompt(self.dep.tokenizer, prompt, self.chat_template)
        start = time.perf_counter()
        out = self.dep.generate(ids, max_tokens, speculative)
        seconds = time.perf_counter() - start
        metrics = None
        counts = acceptance(out) if speculative else None
        if counts is not None:
            # The LLM API reports whole-request totals only: no per-step or per-position counts.
            metrics = SpecMetrics(drafted=counts[1], accepted=counts[0])
        ids_out = [int(t) for t in out.token_ids]
        return PathRun(ids_out, [None] * len(ids_out), metrics, seconds)

    def token_text(self, token_id: int) -> str:
        return self.dep.tokenizer.decode([token_id])

    def decided_draft_tokens(self) -> int:
        """The LLM API drafts the build's max_draft_len (the spec holds default_draft_tokens to it)."""
        return self.dep.spec.speculative.max_draft_len


def open_backend(
    loaded,
    engines_dir: Path,
    url: str | None = None,
    stream: bool = False,
    num_draft_tokens: int | None = None,
    epsilon: float | None = None,
    llmapi_impl: str = TENSORRT_LLM,
) -> tuple[VerifyBackend, str]:
    """The backend verify runs on, and its mode line: the engines in this process (for
    trtllm.runtime llmapi: the LLM API, real or the double), or a served repository over gRPC
    (token texts from the local tokenizer when there is one)."""
    if stream and url is None:
        raise RequestError("--stream verifies a server's streaming endpoint; add --url HOST:PORT")
    llmapi = loaded.spec.backend == "trtllm" and loaded.spec.trtllm.runtime == "llmapi"
    if url is None and llmapi:
        from trtspec.runtime import LlmapiDeployment

        if num_draft_tokens is not None:
            raise RequestError("--num-draft-tokens: the LLM API drafts max_draft_len tokens; drop the flag")
        with console.step(f"loading both LLM API configurations ({llmapi_impl})"):
            dep = LlmapiDeployment(loaded, engines_dir, llmapi_impl)
        label = "llmapi conformance double, not TensorRT-LLM" if dep.api.is_double else f"tensorrt_llm {dep.api.__version__}"
        return LlmapiBackend(dep), f"in-process ({label})"
    if url is None:
        from trtspec.runtime import Deployment

        with console.step("loading engines"):
            dep = Deployment(loaded, engines_dir)
        return InProcessBackend(dep, num_draft_tokens=num_draft_tokens, epsilon=epsilon), "in-process"
    from trtspec.triton.client import GrpcBackend

    tokenizer = None
    folder = tokenizer_folder(engines_dir, loaded.spec.backend)
    if llmapi:  # the LLM API reads the tokenizer from the target checkpoint
        from trtspec.engines.trtllm.llmapi import FOLDER, read_manifest

        try:
            folder = Path(read_manifest(engines_dir / FOLDER, loaded.spec).checkpoints["target"])
        except EngineError:
            pass
    if (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    with console.step(f"connecting to {url}"):
        backend = GrpcBackend(url, tokenizer, loaded.spec.verify.chat_template, num_draft_tokens, stream)
    return backend, f"grpc://{url}" + (" streaming" if stream else "")
