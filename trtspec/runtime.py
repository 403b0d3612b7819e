"""In-process runtime: load a built deployment and generate with or without speculation.

The Triton orchestrator uses the same request rules (make_request) and the same loop; only
its drafter and verifier differ (they call engine models instead of engines in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trtspec.engines.manifest import check_manifest
from trtspec.engines.torch_engine import TorchEngine
from trtspec.errors import EngineError, RequestError
from trtspec.spec import EngineSpec, LoadedSpec
from trtspec.speculative.drafters import ModelDrafter, NgramDrafter
from trtspec.speculative.loop import (
    Drafter,
    GenerationRequest,
    GenerationResult,
    NoDrafter,
    StepCallback,
    generate,
)
from trtspec.speculative.verifier import LogitsVerifier


@dataclass(frozen=True)
class Limits:
    """What a request may ask for: the engine limits and the speculative settings."""

    max_input_len: int
    max_seq_len: int
    max_draft_len: int
    vocab_size: int

    @classmethod
    def from_spec(cls, spec: EngineSpec, vocab_size: int) -> Limits:
        lim = spec.limits("target")
        return cls(lim.max_input_len, lim.max_seq_len, spec.speculative.max_draft_len, vocab_size)


def make_request(
    prompt_ids: list[int],
    max_tokens: int,
    num_draft_tokens: int,
    limits: Limits,
    end_ids: frozenset[int] = frozenset(),
    stop_sequences: tuple[tuple[int, ...], ...] = (),
) -> GenerationRequest:
    """Validate a request against the deployment's limits; RequestError names the fix."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("the prompt is empty; send at least one token of text")
    if n > limits.max_input_len:
        raise RequestError(
            f"prompt has {n} tokens, more than max_input_len {limits.max_input_len}; "
            "shorten it or rebuild with a larger build.max_input_len"
        )
    bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})"
        )
    if max_tokens <= 0:
        raise RequestError(f"max_tokens must be at least 1 (got {max_tokens})")
    if n + max_tokens > limits.max_seq_len:
        raise RequestError(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len "
            f"{limits.max_seq_len}; lower max_tokens to {limits.max_seq_len - n} or less"
        )
    if not 0 <= num_draft_tokens <= limits.max_draft_len:
        raise RequestError(
            f"num_draft_tokens must be in 0..{limits.max_draft_len} (max_draft_len the "
            f"engines were built for); got {num_draft_tokens}"
        )
    return GenerationRequest(list(prompt_ids), max_tokens, num_draft_tokens, end_ids, stop_sequences)


def end_token_ids(tokenizer, engine_folder: Path) -> frozenset[int]:
    """EOS ids from the tokenizer and generation_config.json (chat models list several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = engine_folder / "generation_config.json"
    if gen.is_file():
        import json

        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


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
        self.engines: dict[str, TorchEngine] = {}
        for role in spec.models():
            folder = output_dir / role
            check_manifest(folder, role, spec.build_hash(role))
            self.engines[role] = TorchEngine.load(folder, slots)
        self.target = self.engines["target"]
        self.draft = self.engines.get("draft")
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.target.folder, trust_remote_code=spec.target.trust_remote_code
        )
        self.end_ids = end_token_ids(self.tokenizer, self.target.folder)
        self.limits = Limits.from_spec(spec, self.target.vocab_size)

    def drafter(self) -> Drafter:
        if self.spec.speculative.method == "ngram":
            return NgramDrafter(self.spec.speculative.max_ngram, self.spec.speculative.min_ngram)
        return ModelDrafter(self.draft.run, min(self.draft.vocab_size, self.target.vocab_size))

    def verifier(self) -> LogitsVerifier:
        return LogitsVerifier(self.target.run)

    def encode(self, prompt: str, chat_template: bool | None = None) -> list[int]:
        use = self.spec.verify.chat_template if chat_template is None else chat_template
        return encode_prompt(self.tokenizer, prompt, use)

    def request(self, prompt_ids: list[int], max_tokens: int, num_draft_tokens: int | None = None):
        k = self.spec.speculative.default_draft_tokens if num_draft_tokens is None else num_draft_tokens
        return make_request(prompt_ids, max_tokens, k, self.limits, self.end_ids)

    def generate(
        self,
        requests: list[GenerationRequest],
        speculative: bool = True,
        on_step: StepCallback | None = None,
    ) -> list[GenerationResult]:
        drafter = self.drafter() if speculative else NoDrafter()
        return generate(requests, drafter, self.verifier(), on_step)

    def forget_prefixes(self) -> None:
        """Empty every engine's prefix cache. Timed comparisons call this before each run:
        otherwise the second path on a prompt reuses the first path's prefill."""
        for engine in self.engines.values():
            engine.forget_prefixes()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
