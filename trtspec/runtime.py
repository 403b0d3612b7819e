"""In-process runtime: load a built deployment and generate with or without speculation.

The Triton orchestrator uses the same request rules (speculative.requests) and the same loop;
only its drafter and verifier differ (they call engine models instead of engines in memory).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from trtspec.device import place
from trtspec.engines.manifest import check_manifest
from trtspec.engines.torch.engine import TorchEngine
from trtspec.errors import EngineError, RequestError
from trtspec.layout import engine_folder
from trtspec.spec import LoadedSpec, SuffixSpec
from trtspec.speculative.adaptive import AdaptivePolicy
from trtspec.speculative.capabilities import Drafter
from trtspec.speculative.capture import CaptureTag, CaptureWriter
from trtspec.speculative.drafters import engine_drafter, make_drafter, response_cache
from trtspec.speculative.loop import (
    SHARED_SCOPE,
    GenerationRequest,
    GenerationResult,
    NoDrafter,
    StepCallback,
    generate,
)
from trtspec.speculative.menus import make_menu, policy_of
from trtspec.speculative.processing import Processing
from trtspec.speculative.requests import Limits, encode_prompt, end_token_ids, make_request
from trtspec.speculative.sampling import SamplingParams
from trtspec.speculative.schedule import LoadPolicy
from trtspec.speculative.tree import TreeShape
from trtspec.speculative.verifier import LogitsVerifier


class Deployment:
    """Built engines of one spec, loaded in memory, with the spec's drafter."""

    def __init__(self, loaded: LoadedSpec, output_dir: Path, slots: int | None = None):
        from transformers import AutoTokenizer

        spec = loaded.spec
        if spec.backend != "torch":
            raise EngineError(
                f"backend {spec.backend} engines run inside tritonserver, not in process; "
                "serve them (`trtspec serve`) and use --url"
            )
        self.loaded = loaded
        self.spec = spec
        # One device for every engine of the deployment (the head reads the target's features).
        self.device = place(spec.device, {role: m.dtype for role, m in spec.models().items()})
        self.engines: dict[str, TorchEngine] = {}
        self.head = None  # an EAGLE-3 head (method eagle3, or auto listing it), reading the target's features
        for role in spec.models():
            folder = engine_folder(output_dir, role)
            check_manifest(folder, role, spec.build_hash(role))
            if role == "draft" and spec.speculative.model_draft == "eagle3":  # eagle3, or auto listing it
                from trtspec.engines.torch.eagle3_head import HeadEngine

                self.head = HeadEngine.load(folder, self.engines["target"], slots)
                self.engines["target"].capture_features(self.head.cfg.layer_ids)
                continue
            self.engines[role] = TorchEngine.load(folder, slots, device=self.device)
        self.target = self.engines["target"]
        self.draft = self.engines.get("draft")
        self.tokenizer = AutoTokenizer.from_pretrained(self.target.folder, trust_remote_code=spec.target.trust_remote_code)
        self.end_ids = end_token_ids(self.tokenizer, self.target.folder)
        self.limits = Limits.from_spec(spec, self.target.vocab_size)
        # The spec's load-aware schedule / switch-off, one per deployment (its window spans calls).
        self.policy = LoadPolicy.from_spec(spec.speculative)
        # Suffix decoding's earlier responses, one cache per deployment (bounded; None: none kept).
        self.suffix_cache = response_cache(spec.speculative.suffix_drafting)
        # Adaptive speculation's policy (method auto, or adaptive): its measured costs span calls.
        self.adaptive = policy_of(spec.speculative)
        # serve.capture (method eagle3 only, so the target keeps the features): None when off.
        self.capture = None
        if spec.serve.capture is not None:
            # labels only of the requests it may keep: generate knows them before it runs them
            self.capture = CaptureWriter(spec.serve.capture, loaded.capture_dir(), self.target, every_row=False)

    def drafter(
        self, method: str | None = None, suffix: SuffixSpec | None = None, policy: AdaptivePolicy | None = None
    ) -> Drafter:
        """The spec's drafter (with the deployment's suffix cache; a loop.Menu when it adapts),
        or ``method``'s over the same engines with ``suffix`` drafting and no cache (bench:
        requests kept apart), a Menu of ``policy``'s methods when one is given."""
        s = self.spec.speculative
        model = engine_drafter(self.target, self.draft, self.head, s.draft_kv)
        if method is None:
            method, suffix, cache, policy = s.method, s.suffix_drafting, self.suffix_cache, self.adaptive
        else:
            cache = None
        kw = dict(max_ngram=s.max_ngram, min_ngram=s.min_ngram, draft_model=model, suffix=suffix, cache=cache)
        if policy is not None:
            return make_menu(method, policy, **kw)
        return make_drafter(method, **kw)

    def verifier(self) -> LogitsVerifier:
        return LogitsVerifier(self.target.run)

    def encode(self, prompt: str, chat_template: bool | None = None) -> list[int]:
        use = self.spec.verify.chat_template if chat_template is None else chat_template
        return encode_prompt(self.tokenizer, prompt, use)

    def decided_draft_tokens(self, num_draft_tokens: int | None) -> int:
        """The num_draft_tokens this deployment's requests get when ``num_draft_tokens`` is asked
        (None: its default), as the request rules decide it for a one-token request."""
        return self.request([0], 1, num_draft_tokens).num_draft_tokens

    def request(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        num_draft_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        processing: Processing | None = None,
        log_probs: bool = False,
        tree: TreeShape | Literal["chain"] | None = None,
        suffix_scope: str | None = SHARED_SCOPE,
    ):
        """A checked request; ``num_draft_tokens`` None: the spec's default_draft_tokens, ``tree`` None: the
        spec's draft tree (the request rules fill both in); tree "chain": draft a chain.
        ``suffix_scope``: the scope of the suffix cache it reads and feeds ("": the shared
        one, None: neither; docs/suffix.md)."""
        return make_request(
            prompt_ids,
            max_tokens,
            num_draft_tokens,
            self.limits,
            self.end_ids,
            sampling=sampling,
            processing=processing,
            log_probs=log_probs,
            tree=tree,
            suffix_scope=suffix_scope,
        )

    def generate(
        self,
        requests: list[GenerationRequest],
        speculative: bool = True,
        on_step: StepCallback | None = None,
        use_schedule: bool = True,
        tags: Sequence[CaptureTag] | None = None,
    ) -> list[GenerationResult]:
        """``use_schedule=False``: every request drafts its own k whatever the load (bench's
        k x concurrency grid measures what a schedule should be). ``tags``: per request, its
        id and capture flag, for serve.capture (None: none is captured)."""
        drafter = self.drafter() if speculative else NoDrafter()
        policy = self.policy if speculative and use_schedule else None
        with self.labelled(requests, tags):
            results = generate(requests, drafter, self.verifier(), on_step, policy)
            if tags is not None:
                self.keep(requests, results, tags)
        return results

    @contextlib.contextmanager
    def labelled(self, requests: Sequence[GenerationRequest], tags: Sequence[CaptureTag] | None) -> Iterator[None]:
        """While it lasts the target keeps the labels of the ``requests`` serve.capture may keep
        (their tags allow it, docs/capture.md), and of no other: the rest pay no top-k."""
        if self.capture is None or tags is None:
            yield
            return
        rows = zip(requests, tags, strict=True)
        prompts = [list(r.prompt_ids) for r, t in rows if self.capture.wants(t.request_id, r.suffix_scope, t.allowed)]
        self.target.want_labels(prompts)
        try:
            yield
        finally:
            self.target.want_labels(prompts, wanted=False)

    def keep(
        self, requests: Sequence[GenerationRequest], results: Sequence[GenerationResult], tags: Sequence[CaptureTag]
    ) -> list:
        """Capture the answered ``requests`` that serve.capture wants (docs/capture.md), from the
        labels the target kept while they were served inside ``labelled`` (generate with tags
        does both): per request, the part its writer thread writes, or None (not kept)."""
        if self.capture is None:
            return [None] * len(requests)
        return [
            self.capture.record(t.request_id, r.prompt_ids, res.output_ids, r.suffix_scope)
            if self.capture.wants(t.request_id, r.suffix_scope, t.allowed)
            else None
            for r, res, t in zip(requests, results, tags, strict=True)
        ]

    def close(self) -> None:
        """serve.capture's writer writes what it holds and stops (nothing else needs closing)."""
        if self.capture is not None:
            self.capture.close()

    def forget_prefixes(self) -> None:
        """Empty every engine's prefix cache. Timed comparisons call this before each run:
        otherwise the second path on a prompt reuses the first path's prefill. The suffix cache
        of earlier responses is emptied for the same reason: a prompt must not draft from its
        own output of an earlier run (verify's warm-up, another path or round)."""
        for engine in self.engines.values():
            engine.forget_prefixes()
        if self.suffix_cache is not None:
            self.suffix_cache.clear()
        if self.head is not None:
            self.head.pool.forget()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class LlmapiDeployment:
    """Both configurations of an llmapi build, loaded: speculative and control LLMs."""

    def __init__(self, loaded, output_dir: Path, impl: str):
        from transformers import AutoTokenizer

        from trtspec.engines.trtllm import llmapi
        from trtspec.speculative.llmapi import load_api, make_llm

        spec = loaded.spec
        folder = Path(output_dir) / llmapi.FOLDER
        manifest = llmapi.read_manifest(folder, spec)
        self.spec = spec
        self.api = load_api(impl, spec.trtllm.line)
        self.impl = impl
        self.speculative = make_llm(self.api, folder / llmapi.SPECULATIVE)
        self.control = make_llm(self.api, folder / llmapi.CONTROL)
        self.tokenizer = AutoTokenizer.from_pretrained(
            manifest.checkpoints["target"], trust_remote_code=spec.target.trust_remote_code
        )

    def generate(self, prompt_ids: list[int], max_tokens: int, speculative: bool):
        from trtspec.speculative.llmapi import greedy_params

        llm = self.speculative if speculative else self.control
        try:
            out = llm.generate([prompt_ids], greedy_params(self.api, max_tokens, speculative))
        except ValueError as e:
            raise RequestError(str(e)) from e
        return out[0].outputs[0]

    def shutdown(self) -> None:
        for llm in (self.speculative, self.control):
            llm.shutdown()
