"""Request rules every runtime applies: what a request may ask for, and how text becomes ids.

In process, inside the Triton orchestrator and inside the engine models, a request is checked
here against one :class:`Limits`, so a limit or a message is written once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trtspec.errors import RequestError
from trtspec.spec import EngineSpec
from trtspec.speculative.loop import SHARED_SCOPE, GenerationRequest
from trtspec.speculative.processing import Processing
from trtspec.speculative.sampling import SamplingParams
from trtspec.speculative.tree import TreeShape, tree_shape
from trtspec.tokens import check_token_ids

# The UTF-8 bytes a request's suffix cache scope (a tenant key) may have.
MAX_SCOPE_BYTES = 256


@dataclass(frozen=True)
class Limits:
    """What a request may ask for: the engine's limits and the speculative settings.

    ``max_draft_len`` bounds a request's num_draft_tokens (0: the engine verifies no drafts,
    a draft engine); ``max_input_len`` and ``max_batch_size`` are None where nothing bounds
    them separately; ``default_draft_tokens`` is the num_draft_tokens of a request that sends
    none (:func:`decide_num_draft_tokens`); ``default_tree`` the draft tree shape of a request
    that asks for none (None: chains); ``drafts`` False: an endpoint that checks a request's
    num_draft_tokens but drafts nothing (Triton's target_only control).
    """

    vocab_size: int
    max_seq_len: int
    max_draft_len: int
    max_input_len: int | None = None
    max_batch_size: int | None = None
    default_draft_tokens: int = 0
    default_tree: TreeShape | None = None
    drafts: bool = True

    @classmethod
    def from_spec(cls, spec: EngineSpec, vocab_size: int, role: str = "target") -> Limits:
        lim = spec.limits(role)
        return cls(
            vocab_size=vocab_size,
            max_seq_len=lim.max_seq_len,
            max_draft_len=spec.speculative.max_draft_len if role == "target" else 0,
            max_input_len=lim.max_input_len,
            max_batch_size=lim.max_batch_size,
            default_draft_tokens=spec.speculative.default_draft_tokens if role == "target" else 0,
            default_tree=tree_shape(spec.speculative) if role == "target" else None,
        )

    def check_batch(self, rows: int, what: str = "sequences") -> None:
        if self.max_batch_size is not None and rows > self.max_batch_size:
            raise RequestError(f"batch of {rows} {what} exceeds max_batch_size {self.max_batch_size}; send fewer at once")


def decide_num_draft_tokens(num_draft_tokens: int | None, default: int, max_draft_len: int, drafts: bool = True) -> int:
    """A request's draft length (its num_draft_tokens), decided here and only here: what it
    sent, else the deployment's default_draft_tokens (the spec field; inside the orchestrator,
    the Triton parameter written from it); RequestError outside 0..max_draft_len; 0 where the
    endpoint ``drafts`` nothing (checked all the same). make_request calls it for every
    request, in process and in the served orchestrator, and nothing else does: verify and
    bench report the draft length their requests were given here (the in-process request,
    the served endpoint's default_draft_tokens parameter). The loop drafts at most this many
    per step (loop.Batch.draft_lens); a draft tree request's nodes come from its shape, and
    its num_draft_tokens 0 turns drafting off."""
    n = default if num_draft_tokens is None else num_draft_tokens
    if not 0 <= n <= max_draft_len:
        raise RequestError(f"num_draft_tokens must be in 0..{max_draft_len} (max_draft_len the engines were built for); got {n}")
    return n if drafts else 0


def make_request(
    prompt_ids: list[int],
    max_tokens: int,
    num_draft_tokens: int | None,
    limits: Limits,
    end_ids: frozenset[int] = frozenset(),
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    sampling: SamplingParams | None = None,
    processing: Processing | None = None,
    log_probs: bool = False,
    generation_logits: bool = False,
    tree: TreeShape | Literal["chain"] | None = None,
    suffix_scope: str | None = SHARED_SCOPE,
) -> GenerationRequest:
    """Validate a request against the deployment's limits; RequestError names the fix.
    ``num_draft_tokens`` None: the deployment's default k (``limits.default_draft_tokens``).
    ``tree`` None: the deployment's tree shape (``limits.default_tree``); "chain": a chain.
    ``suffix_scope``: the scope of suffix decoding's response cache the request reads and
    feeds ("": the shared one; None: neither; see check_scope)."""
    shape = limits.default_tree if tree is None else None if tree == "chain" else tree
    _check_prompt(prompt_ids, max_tokens, limits)
    num_draft_tokens = decide_num_draft_tokens(num_draft_tokens, limits.default_draft_tokens, limits.max_draft_len, limits.drafts)
    if processing is not None:
        processing.check_ids(limits.vocab_size)
    if shape is not None and shape.depth > limits.max_draft_len:
        raise RequestError(
            f"the draft tree is {shape.depth} deep, beyond max_draft_len {limits.max_draft_len}; "
            "draft a shallower tree or rebuild with a larger speculative.max_draft_len"
        )
    return GenerationRequest(
        list(prompt_ids),
        max_tokens,
        num_draft_tokens,
        end_ids,
        stop_sequences,
        sampling,
        processing,
        log_probs,
        generation_logits,
        shape if num_draft_tokens > 0 else None,
        check_scope(suffix_scope),
    )


def _check_prompt(prompt_ids: list[int], max_tokens: int, limits: Limits) -> None:
    """The prompt's length and ids, and ``max_tokens``, against the engine's limits."""
    n = len(prompt_ids)
    if n == 0:
        raise RequestError("the prompt is empty; send at least one token of text")
    if limits.max_input_len is not None and n > limits.max_input_len:
        raise RequestError(
            f"prompt has {n} tokens, more than max_input_len {limits.max_input_len}; "
            "shorten it or rebuild with a larger build.max_input_len"
        )
    check_token_ids(prompt_ids, limits.vocab_size)
    if max_tokens <= 0:
        raise RequestError(f"max_tokens must be at least 1 (got {max_tokens})")
    if n + max_tokens > limits.max_seq_len:
        raise RequestError(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds max_seq_len "
            f"{limits.max_seq_len}; lower max_tokens to {limits.max_seq_len - n} or less"
        )


def check_scope(scope: str | bytes | None, name: str = "suffix_scope", limit: int = MAX_SCOPE_BYTES) -> str | None:
    """A request's suffix cache scope, checked: None, or text of at most ``limit`` UTF-8
    bytes without control characters ("" is the deployment's shared scope; bytes are decoded
    as UTF-8 once their size is checked). ``name``: the field as the request's sender knows it,
    for the RequestError; ``limit``: what is left of MAX_SCOPE_BYTES where a prefix joins it."""
    if scope is None:
        return None
    if isinstance(scope, bytes):
        if len(scope) > limit:
            raise RequestError(f"{name} is {len(scope)} bytes, more than {limit}; send a shorter key (a hash of it, say)")
        try:
            scope = scope.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not valid UTF-8; send UTF-8 text") from None
    if not isinstance(scope, str):
        raise RequestError(f"{name} must be text (a tenant key); got {type(scope).__name__}")
    try:
        size = len(scope.encode("utf-8"))
    except UnicodeEncodeError:
        raise RequestError(f"{name} is not valid UTF-8; send UTF-8 text") from None
    if size > limit:
        raise RequestError(f"{name} is {size} bytes, more than {limit}; send a shorter key (a hash of it, say)")
    if any(ord(c) < 32 or ord(c) == 127 for c in scope):
        raise RequestError(f"{name} holds a control character; send printable text")
    return scope


def end_token_ids(tokenizer, engine_folder: Path) -> frozenset[int]:
    """EOS ids from the tokenizer and generation_config.json (chat models list several)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = Path(engine_folder) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    """Prompt text to ids, through the tokenizer's chat template when asked and present."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
