"""Engine spec: one YAML file per deployment, validated by pydantic.

A spec names the target and draft checkpoints, the speculative method, build limits, the
backend, and the serve and verify settings. Unknown keys are rejected; every error is
rendered as ``<file>: <field.path>: <problem> (<fix>)`` and raised as SpecError (exit 2).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from trtspec.device import check_name as check_device_name
from trtspec.errors import SpecError
from trtspec.files import read_text_file
from trtspec.recipe import DistillRecipe
from trtspec.trtllm_lines.rules import check_trtllm_runtime

Dtype = Literal["float32", "float16", "bfloat16"]
Backend = Literal["torch", "trtllm"]
Method = Literal["draft_target", "eagle3", "ngram", "suffix", "auto"]
DrafterMethod = Literal["draft_target", "eagle3", "ngram", "suffix"]  # one drafter each
MODEL_METHODS = ("draft_target", "eagle3")  # drafted by a model (the spec's `draft`)
FREE_METHODS = ("ngram", "suffix")  # drafted from the text itself, at no model cost
# Where a model draft's K/V for the context comes from: "target" (a draft whose cache has the
# target's shape takes the target's, in process), "own" (the draft computes it).
DraftKv = Literal["target", "own"]
# TensorRT-LLM's quantization names; each backend gives a value its own meaning (docs/trtllm.md,
# docs/quantization.md). int8_wo / int4_wo: weights in 8 / 4 bits, activations in the dtype.
Quantization = Literal["none", "fp8", "int4_awq", "int8_wo", "int4_wo"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
TORCH_QUANTIZATIONS = ("none", "int8_wo", "int4_wo")  # the torch backend's weight-only kernels

MAX_DRAFT_LEN_LIMIT = 16
_UNPINNED_REVISIONS = {"main", "master", "head", "latest"}
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")  # a full git commit id, as the Hub names revisions
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")  # whole name: used with fullmatch


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def _exactly_one(self, first: str, second: str, message: str) -> None:
        """ValueError(``message``) unless exactly one of the fields ``first`` and ``second`` is given."""
        if (getattr(self, first) is None) == (getattr(self, second) is None):
            raise ValueError(message)


class BuildLimits(_Strict):
    """Shapes the engines are built for; requests beyond them are refused."""

    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 4
    max_input_len: Annotated[int, Field(ge=1)] = 1024
    max_seq_len: Annotated[int, Field(ge=2)] = 2048

    @model_validator(mode="after")
    def _input_fits(self) -> BuildLimits:
        if self.max_input_len >= self.max_seq_len:
            raise ValueError(
                f"max_input_len ({self.max_input_len}) must be smaller than max_seq_len "
                f"({self.max_seq_len}) so at least one token can be generated; "
                "lower max_input_len or raise max_seq_len"
            )
        return self


class ModelSpec(_Strict):
    """One checkpoint: a Hub repo at a pinned revision, or a local folder; GGUF optional."""

    repo: str | None = None
    revision: str | None = None
    path: str | None = None
    gguf_file: str | None = None
    dtype: Dtype = "float16"
    trust_remote_code: bool = False
    # TensorRT-LLM options (backend: trtllm); the torch backend requires the defaults.
    tp_size: Annotated[int, Field(ge=1, le=64)] = 1
    pp_size: Annotated[int, Field(ge=1, le=64)] = 1
    quantization: Quantization = "none"
    gpu_device_ids: list[Annotated[int, Field(ge=0)]] | None = None
    build: BuildLimits | None = None  # per-engine override of the spec-level limits

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        self._exactly_one(
            "repo", "path", "give exactly one source: `repo` (a Hub repo id, with `revision`) or `path` (a local folder)"
        )
        if self.repo is not None:
            if not self.revision:
                raise ValueError(
                    f"`repo: {self.repo}` needs a pinned `revision` (a commit sha or tag) so builds are reproducible"
                )
            if self.revision.lower() in _UNPINNED_REVISIONS:
                raise ValueError(f"revision '{self.revision}' is a moving branch; pin a commit sha or tag")
            if self.trust_remote_code and not _COMMIT_SHA.fullmatch(self.revision):
                # Remote code runs at load: a branch or tag can be moved to point at other code.
                raise ValueError(
                    f"trust_remote_code runs the repo's code, so `revision` must be a full 40-character "
                    f"commit sha, not '{self.revision}' (a branch or tag can move); pin the commit"
                )
        elif self.revision is not None:
            raise ValueError("`revision` only applies to `repo`; remove it for a local `path`")
        if self.gguf_file is not None and not self.gguf_file.endswith(".gguf"):
            raise ValueError(f"gguf_file '{self.gguf_file}' must name a .gguf file")
        if self.gpu_device_ids is not None:
            world = self.tp_size * self.pp_size
            if len(self.gpu_device_ids) != world:
                raise ValueError(
                    f"gpu_device_ids lists {len(self.gpu_device_ids)} GPU(s) but tp_size x "
                    f"pp_size = {world}; list exactly {world} device id(s)"
                )
        return self

    @property
    def source_id(self) -> str:
        """Human-readable origin: repo id or local path."""
        return self.repo if self.repo is not None else str(self.path)


class SwitchOffSpec(_Strict):
    """Speculation off for good once acceptance over a window falls below a threshold, one of:
    ``min_acceptance_length``, the mean acceptance length of the last ``window`` finished
    requests that drafted (trtspec's loop; TensorRT-LLM 1.2's acceptance_window /
    acceptance_length_threshold); ``min_acceptance_rate``, the mean over the last ``window``
    decoding steps that drafted of accepted / drafted tokens over the batch (TensorRT-LLM
    1.3+'s acceptance_rate_window_size / acceptance_rate_threshold). trtspec's loop applies
    either, in process and on Triton; the LLM API takes the one its line has."""

    window: Annotated[int, Field(ge=1, le=100_000)]
    min_acceptance_length: Annotated[float, Field(gt=1.0, le=MAX_DRAFT_LEN_LIMIT + 1)] | None = None
    min_acceptance_rate: Annotated[float, Field(gt=0.0, le=1.0)] | None = None

    @model_validator(mode="after")
    def _one_threshold(self) -> SwitchOffSpec:
        self._exactly_one(
            "min_acceptance_length",
            "min_acceptance_rate",
            "give one threshold: min_acceptance_length (mean tokens per target forward of finished "
            "requests) or min_acceptance_rate (accepted / drafted tokens per step; TensorRT-LLM 1.3+)",
        )
        return self


class AutoSpec(_Strict):
    """Method auto (speculative/adaptive.py): per request and per step the loop picks one of
    ``methods`` and k from the request's recent acceptance and the engine's measured costs."""

    methods: Annotated[tuple[DrafterMethod, ...], Field(min_length=1)]
    # Steps between re-probes of a request whose speculation is off, and of a drafter left untried.
    probe_every: Annotated[int, Field(ge=1, le=10_000)] = 16

    @field_validator("methods")
    @classmethod
    def _distinct(cls, methods: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(methods)) != len(methods):
            raise ValueError(f"{list(methods)} lists a method twice; list each once")
        models = [m for m in methods if m in MODEL_METHODS]
        if len(models) > 1:
            raise ValueError(
                f"{' and '.join(models)} both draft with the spec's one `draft` model (a checkpoint, or an "
                "EAGLE-3 head); list one of them"
            )
        return methods


class SuffixSpec(_Strict):
    """Suffix decoding (speculative/suffix.py): for method suffix, or layered on a
    draft_target / eagle3 draft. Defaults as vLLM's suffix decoding."""

    # Longest match + draft considered (vLLM suffix_decoding_max_tree_depth).
    max_depth: Annotated[int, Field(ge=3, le=64)] = 24
    # A draft is at most spec_factor x its match length (vLLM suffix_decoding_max_spec_factor).
    spec_factor: Annotated[float, Field(gt=0, le=16)] = 1.0
    # The draft stops where the estimated probability of its next token (the share of matches
    # that continue so, along the path) falls below this (vLLM suffix_decoding_min_token_prob).
    min_token_prob: Annotated[float, Field(ge=0, le=1)] = 0.1
    # Earlier responses kept per deployment for every request to draft from; 0 keeps requests
    # apart: each drafts from its own prompt and output only.
    cache_responses: Annotated[int, Field(ge=0, le=1_000_000)] = 1000
    # The cache's memory cap, in tokens (about suffix.BYTES_PER_TOKEN bytes each); the oldest
    # responses are evicted first.
    cache_tokens: Annotated[int, Field(ge=2, le=1 << 26)] = 131_072
    # Layered on a model draft: rows whose suffix match is at least this long take the suffix
    # draft, the others the model's (TensorRT-LLM sa_config.threshold).
    threshold: Annotated[int, Field(ge=2, le=64)] = 4
    # The caps above are split into this many equal shares, one per tenant (the OpenAI front's
    # API-key tenants; direct Triton callers are one more): a tenant evicts only its own
    # responses, oldest first. A tenant arriving when every share is held drafts without the
    # cache. 1: one pool for all (a single-tenant deployment that wants the whole cache).
    tenants: Annotated[int, Field(ge=1, le=1024)] = 8
    # Honour the suffix_cache_scope a direct Triton caller sends (inside the direct callers'
    # share). Off: only the OpenAI front (the server's caller key) names scopes; every other
    # request is in the direct callers' one shared scope.
    client_scopes: bool = False


# Draft trees (docs/trees.md): the most nodes one tree verifies in a target forward (the root,
# the last accepted token, not counted) and the most children one node may have.
MAX_TREE_NODES = 64
MAX_TREE_TOP_K = 16
TREE_METHODS = ("draft_target", "eagle3")  # the methods whose drafters propose trees


class DynamicTreeSpec(_Strict):
    """EAGLE-2's dynamic tree: each of max_draft_len steps expands the top_k most probable
    nodes (cumulative draft probability) into their top_k children; the ``nodes`` most
    probable of all drafted nodes are verified."""

    top_k: Annotated[int, Field(le=MAX_TREE_TOP_K)]
    nodes: Annotated[int, Field(le=MAX_TREE_NODES)]

    @field_validator("top_k", "nodes")
    @classmethod
    def _not_a_chain(cls, n: int, info: ValidationInfo) -> int:
        """One child per node, or one node, is a chain."""
        if n < 2:
            what = f"top_k {n} drafts one branch," if info.field_name == "top_k" else f"a tree of {n} node is"
            raise ValueError(f"{what} a chain: remove speculative.tree or set {info.field_name} >= 2")
        return n


class TreeSpec(_Strict):
    """A draft tree: a static choice list or an EAGLE-2 dynamic tree (exactly one).

    ``choices`` names every drafted node by its path from the root: [1] is the root's
    second most probable child, [1, 0] that node's most probable child. Kept breadth-first
    (by depth, then path), the order vLLM and TensorRT-LLM sort choices into."""

    choices: tuple[tuple[int, ...], ...] | None = None
    dynamic: DynamicTreeSpec | None = None

    @field_validator("choices")
    @classmethod
    def _connected(cls, choices: tuple[tuple[int, ...], ...] | None) -> tuple[tuple[int, ...], ...] | None:
        if choices is None:
            return None
        if not choices:
            raise ValueError("no nodes: list each drafted node's path from the root, e.g. [[0], [1], [0, 0]]")
        seen: set[tuple[int, ...]] = set()
        for path in choices:
            if not path:
                raise ValueError("[] names the root, which is the last accepted token and never drafted; remove it")
            if any(i < 0 or i >= MAX_TREE_TOP_K for i in path):
                raise ValueError(f"{list(path)}: child ranks run from 0 to {MAX_TREE_TOP_K - 1}")
            if path in seen:
                raise ValueError(f"{list(path)} is listed twice; list each node once")
            seen.add(path)
        for path in choices:
            if len(path) > 1 and path[:-1] not in seen:
                raise ValueError(f"{list(path)} has no parent: add {list(path[:-1])} or remove it")
        if len(choices) > MAX_TREE_NODES:
            raise ValueError(f"{len(choices)} nodes; a tree verifies at most {MAX_TREE_NODES}")
        if all(set(path) == {0} for path in choices):
            raise ValueError(
                f"{[list(p) for p in choices]} is one branch, a chain: remove speculative.tree and set "
                f"max_draft_len: {max(map(len, choices))}"
            )
        return tuple(sorted(choices, key=lambda p: (len(p), p)))

    @model_validator(mode="after")
    def _one_shape(self) -> TreeSpec:
        self._exactly_one(
            "choices",
            "dynamic",
            "give exactly one shape: `choices` (a static tree, e.g. [[0], [1], [0, 0]]) or `dynamic` (e.g. {top_k: 4, nodes: 8})",
        )
        return self

    @property
    def node_count(self) -> int:
        """Drafted nodes verified per step (the root not counted)."""
        return len(self.choices) if self.choices is not None else self.dynamic.nodes

    def depth(self, max_draft_len: int) -> int:
        """The deepest node: a static tree's longest path, a dynamic tree's max_draft_len."""
        return max(map(len, self.choices)) if self.choices is not None else max_draft_len

    def grown_nodes(self, max_draft_len: int) -> int:
        """The most nodes a drafter scores in one forward while growing the tree (the last
        round, speculative/tree.py TreeGrowth): every node with children, for a static tree;
        the top_k nodes expanded at each depth but the last, for a dynamic tree."""
        if self.choices is not None:
            return len({path[:-1] for path in self.choices if len(path) > 1})
        return self.dynamic.top_k * (max_draft_len - 1)


class SpeculativeSpec(_Strict):
    method: Method = "draft_target"
    max_draft_len: Annotated[int, Field(ge=1, le=MAX_DRAFT_LEN_LIMIT)] = 4
    # The deployment's draft length k: what a request that sends no num_draft_tokens runs with
    # (<= max_draft_len; max_draft_len when not given).
    default_draft_tokens: Annotated[int, Field(ge=0, le=MAX_DRAFT_LEN_LIMIT)]
    # ngram (prompt lookup): longest suffix n-gram tried first, down to min_ngram.
    max_ngram: Annotated[int, Field(ge=1, le=16)] = 3
    min_ngram: Annotated[int, Field(ge=1, le=16)] = 1
    # TensorRT-LLM only: accept drafts by comparing draft and target logits (not greedy
    # token identity); needs --gather_generation_logits. Off: exact greedy acceptance.
    use_draft_logits: bool = False
    # Load-aware speculation: {min active sequences: draft length}, e.g. {1: 4, 4: 2, 8: 0}
    # (0: no drafting at that load). Caps every request's k; `trtspec bench --schedule`
    # measures and recommends one. None: the same k at every load.
    schedule: dict[Annotated[int, Field(ge=1, le=4096)], Annotated[int, Field(ge=0, le=MAX_DRAFT_LEN_LIMIT)]] | None = None
    switch_off: SwitchOffSpec | None = None
    # Suffix decoding's settings: method suffix (None: the defaults), or suffix drafting
    # layered on a draft_target / eagle3 draft (None: not layered).
    suffix: SuffixSpec | None = None
    # A draft tree (draft_target, eagle3): None drafts chains of up to max_draft_len tokens.
    tree: TreeSpec | None = None
    # Method auto's drafters (required with method auto, refused otherwise).
    auto: AutoSpec | None = None
    # k per request per step within [1, max_draft_len] from measured acceptance and costs
    # (speculative/adaptive.py), under the schedule's cap; method auto always adapts.
    adaptive: bool = False
    # "target": a model draft whose K/V cache has the target's shape (layers, KV heads, head_dim,
    # RoPE: a self-draft, e.g. the same model quantized) takes the target's K/V for the context the
    # target computed (a prompt's prefill) instead of computing it again, in process only (Triton's
    # engine models are separate processes). "own": the draft computes its own, in process as
    # served, so both count the same acceptance.
    draft_kv: DraftKv = "own"

    @property
    def methods(self) -> tuple[str, ...]:
        """The drafters the deployment runs: auto's list, else the one method."""
        return self.auto.methods if self.method == "auto" and self.auto is not None else (self.method,)

    @property
    def model_draft(self) -> str | None:
        """The method among ``methods`` that drafts with the spec's `draft` model (None: none)."""
        return next((m for m in self.methods if m in MODEL_METHODS), None)

    @property
    def adapts(self) -> bool:
        """The loop picks k (and, for auto, the drafter) per request per step."""
        return self.adaptive or self.method == "auto"

    @property
    def suffix_drafting(self) -> SuffixSpec | None:
        """The suffix settings drafting uses: method suffix's (defaults if none given), the
        layered ones of draft_target / eagle3, else None."""
        if self.method == "suffix" or (self.method == "auto" and "suffix" in self.methods):
            return self.suffix or SuffixSpec()
        return self.suffix

    @model_validator(mode="before")
    @classmethod
    def _fill_default_draft_tokens(cls, data):
        """default_draft_tokens not given: max_draft_len (the field's default when max_draft_len
        is itself invalid, which fails on its own)."""
        if not isinstance(data, dict):
            return data
        if "num_draft_tokens" in data:
            raise ValueError(
                "num_draft_tokens is the draft length a request sends; the spec's draft length for "
                "requests that send none is default_draft_tokens: rename the key"
            )
        if data.get("default_draft_tokens") is None:
            k = data.get("max_draft_len")
            ok = isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_DRAFT_LEN_LIMIT
            data = {**data, "default_draft_tokens": k if ok else cls.model_fields["max_draft_len"].default}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> SpeculativeSpec:
        if self.schedule is not None:
            points = sorted(self.schedule.items())
            if not points or points[0][0] != 1:
                raise ValueError(
                    "schedule must start at 1 active sequence, e.g. {1: 4, 4: 2, 8: 0} "
                    "(keys: active sequences from which a draft length applies)"
                )
            if any(k > self.max_draft_len for _, k in points):
                raise ValueError(f"schedule draft lengths must be <= max_draft_len ({self.max_draft_len}); got {dict(points)}")
            if any(b[1] > a[1] for a, b in zip(points, points[1:])):
                raise ValueError(
                    f"schedule draft lengths must not grow with load (more sequences, fewer drafts); got {dict(points)}"
                )
        if self.default_draft_tokens > self.max_draft_len:
            raise ValueError(
                f"default_draft_tokens ({self.default_draft_tokens}) exceeds max_draft_len "
                f"({self.max_draft_len}); lower it or raise max_draft_len"
            )
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) exceeds max_ngram ({self.max_ngram})")
        if self.suffix is not None and self.method == "ngram":
            raise ValueError(
                "suffix applies to method suffix, or layered on draft_target / eagle3; "
                "method ngram takes no suffix settings: remove suffix or use method: suffix"
            )
        if self.tree is not None:
            self._check_tree(self.tree)
        self._check_adaptive()
        if self.method == "suffix" and self.suffix is not None and "threshold" in self.suffix.model_fields_set:
            raise ValueError(
                "suffix.threshold chooses between a suffix draft and a model draft; method suffix has "
                "no model draft: remove threshold (or layer suffix on draft_target / eagle3)"
            )
        return self

    def _check_adaptive(self) -> None:
        if (self.method == "auto") != (self.auto is not None):
            raise ValueError(
                "method auto needs `auto: {methods: [draft_target, suffix, ngram]}`"
                if self.method == "auto"
                else f"auto: applies to method auto; remove auto or set method: auto (now {self.method})"
            )
        if self.method != "auto":
            return
        if self.suffix is not None and "suffix" not in self.methods:
            raise ValueError("suffix: auto.methods lists no suffix; add suffix to auto.methods or remove suffix")
        if self.suffix is not None and "threshold" in self.suffix.model_fields_set:
            raise ValueError(
                "suffix.threshold layers a suffix draft on a model draft; method auto chooses between "
                "them from measured acceptance instead: remove threshold"
            )

    def _check_tree(self, tree: TreeSpec) -> None:
        if self.method not in TREE_METHODS:
            raise ValueError(
                f"tree: method {self.method} drafts one continuation, a chain; trees are drafted by "
                f"{' and '.join(TREE_METHODS)}: remove tree or change method"
            )
        if self.adaptive:
            raise ValueError("tree: adaptive picks a chain's length per step; remove tree or adaptive")
        if self.suffix is not None:
            raise ValueError(
                "tree: a layered suffix draft is a chain and would replace the tree on the rows it drafts; remove suffix or tree"
            )
        if tree.choices is not None and tree.depth(self.max_draft_len) > self.max_draft_len:
            raise ValueError(
                f"tree.choices: paths {tree.depth(self.max_draft_len)} deep, beyond max_draft_len "
                f"({self.max_draft_len}); raise max_draft_len or shorten the paths"
            )
        if tree.dynamic is not None:
            d, k = tree.dynamic, self.max_draft_len
            if not k <= d.nodes <= d.top_k * k:
                raise ValueError(
                    f"tree.dynamic.nodes ({d.nodes}) must lie between max_draft_len ({k}), one full "
                    f"branch, and top_k x max_draft_len ({d.top_k * k}), every node the steps keep; "
                    "change nodes, top_k or max_draft_len"
                )
            if (grown := tree.grown_nodes(k)) > MAX_TREE_NODES:
                raise ValueError(
                    f"tree.dynamic: growing the tree scores top_k x (max_draft_len - 1) = {grown} nodes in "
                    f"one draft forward; at most {MAX_TREE_NODES}: lower top_k or max_draft_len"
                )

    @property
    def verify_width(self) -> int:
        """The most draft tokens the target scores in one forward: max_draft_len, or a tree's
        nodes."""
        return max(self.max_draft_len, self.tree.node_count if self.tree is not None else 0)


# The largest serve.max_response_mb: one response is one gRPC message, and protobuf refuses a
# message of 2 GiB or more (Triton's and tritonclient's gRPC limits are INT32_MAX bytes).
MAX_RESPONSE_MB = 2047


class CaptureSpec(_Strict):
    """serve.capture: the served traffic kept for `distill --from-capture` (docs/capture.md).
    Off unless set: it stores users' text and the target's features."""

    dir: str  # relative to the spec file
    max_gb: Annotated[float, Field(gt=0)]  # the folder's bound: the oldest parts go first
    sample: Annotated[float, Field(gt=0, le=1)]  # the share of requests kept (chosen by request id)
    exclude_tenants: list[str] = []  # tenants (an API key's) whose requests are never kept

    @field_validator("dir")
    @classmethod
    def _dir_named(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("dir is empty; name the folder captured requests are kept in")
        return v


class ServeSpec(_Strict):
    host: str = "127.0.0.1"
    http_port: Annotated[int, Field(ge=1, le=65535)] = 8000
    grpc_port: Annotated[int, Field(ge=1, le=65535)] = 8001
    metrics_port: Annotated[int, Field(ge=1, le=65535)] = 8002
    instance_count: Annotated[int, Field(ge=1, le=64)] = 1
    streaming: bool = True
    # Requests each text endpoint holds waiting for a batch slot; beyond it, overload is
    # answered at once with UNAVAILABLE instead of queueing without bound.
    max_queue: Annotated[int, Field(ge=1, le=100_000)] = 64
    # The most one response may hold (MB); a request that would make more (generation_logits:
    # rows x max_tokens x vocab x 4 bytes) is refused by name (triton/backend/contract.py).
    # At most MAX_RESPONSE_MB: a response is one gRPC message.
    max_response_mb: Annotated[int, Field(ge=1)] = 32
    repo_dir: str | None = None  # default model_repo/<name>
    capture: CaptureSpec | None = None  # off: no request is kept

    @field_validator("max_response_mb")
    @classmethod
    def _response_fits_a_message(cls, mb: int) -> int:
        if mb > MAX_RESPONSE_MB:
            raise ValueError(
                f"{mb} MB cannot be answered: a response is one gRPC message, which protobuf caps at 2 GiB; "
                f"set at most {MAX_RESPONSE_MB} (the server's /dev/shm must also hold it: the Python backend "
                "passes every response through its shared-memory pool there)"
            )
        return mb

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServeSpec:
        ports = [self.http_port, self.grpc_port, self.metrics_port]
        if len(set(ports)) != 3:
            raise ValueError(f"http_port, grpc_port and metrics_port must differ (got {ports})")
        return self


class TrtllmSpec(_Strict):
    """backend trtllm: which runtime, and which TensorRT-LLM line the files are written for.

    llmapi: the LLM API (PyTorch backend) loads Hugging Face checkpoints directly; speculative
    decoding is a `speculative_config` in a YAML read by trtllm-serve, trtllm-bench and Triton.
    engine: TensorRT engines from `trtllm-build` served by tensorrtllm_backend (TensorRT-LLM
    <= 1.2 only; upstream removed that path from 1.3). `line` picks the spellings: 1.2.x names
    draft-target `DraftTarget` and EAGLE-3 `Eagle`, 1.3+ names them `Draft_Target` and `Eagle3`.
    """

    runtime: Literal["llmapi", "engine"] = "llmapi"
    line: Literal["1.2", "1.3+"] = "1.2"
    # Both Triton endpoints (speculative and control) hold an LLM on the same GPU, so each
    # takes less than upstream's 0.9 default of the memory left after loading weights.
    kv_cache_free_gpu_memory_fraction: Annotated[float, Field(gt=0, le=1)] = 0.45
    max_num_tokens: Annotated[int, Field(ge=1)] = 8192  # upstream's default, written explicitly


class VerifySpec(_Strict):
    prompts: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    prompts_file: str | None = None  # JSONL: {"prompt": "..."} per line
    max_tokens: Annotated[int, Field(ge=1)] = 64
    chat_template: bool = True


class EngineSpec(_Strict):
    name: str
    backend: Backend = "torch"
    # Where the torch backend runs: cpu | cuda | cuda:N | auto (trtspec/device.py). Not part
    # of the build hash: one engine folder loads on any device.
    device: str = "cpu"
    target: ModelSpec
    draft: ModelSpec | None = None
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec)
    build: BuildLimits = Field(default_factory=BuildLimits)
    trtllm: TrtllmSpec = Field(default_factory=TrtllmSpec)  # backend trtllm only
    output_dir: str | None = None  # engines/<name> relative to the working directory
    serve: ServeSpec = Field(default_factory=ServeSpec)
    verify: VerifySpec = Field(default_factory=VerifySpec)
    # The EAGLE-3 head's recipe for `trtspec distill` (trtspec/recipe.py); flags given override it.
    distill: DistillRecipe | None = None

    @field_validator("name")
    @classmethod
    def _name_is_slug(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(
                f"'{v}' is not a usable name; use lowercase letters, digits, '.', '_' or '-' (it becomes folder and model names)"
            )
        return v

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        return check_device_name(v)

    def _check_capture(self) -> None:
        method = self.speculative.method
        if self.serve.capture is not None and (method != "eagle3" or self.backend != "torch"):
            raise ValueError(
                "serve.capture keeps the features an EAGLE-3 head reads, which only a torch engine serving "
                f"method eagle3 has (this spec: backend {self.backend}, method {method}); remove serve.capture"
            )

    @model_validator(mode="after")
    def _cross_field(self) -> EngineSpec:
        method = self.speculative.method
        if self.backend != "torch" and "device" in self.model_fields_set:
            raise ValueError(
                "`device` applies to backend: torch; TensorRT-LLM picks its GPUs with gpu_device_ids, so remove device"
            )
        if method == "draft_target" and self.draft is None:
            raise ValueError("method draft_target needs a `draft` model; add one or use method: ngram")
        if method == "eagle3" and self.draft is None:
            raise ValueError(
                "method eagle3 needs `draft`: the EAGLE-3 head folder (path, or repo + revision "
                "of a Hub EAGLE-3 checkpoint); train one with `trtspec distill SPEC`"
            )
        if self.distill is not None and method != "eagle3":
            raise ValueError(
                f"distill: the recipe trains an EAGLE-3 head, and method {method} drafts without one; "
                "remove distill or set speculative.method: eagle3"
            )
        self._check_capture()
        if method in ("ngram", "suffix") and self.draft is not None:
            raise ValueError(f"method {method} uses no draft model; remove `draft`")
        if method == "auto":
            self._check_auto_draft()
        if self.backend == "trtllm":
            check_trtllm_runtime(self)
        elif "trtllm" in self.model_fields_set:
            raise ValueError("`trtllm` settings only apply to backend: trtllm; remove them")
        if self.speculative.model_draft == "eagle3":  # method eagle3, or auto listing it
            if self.draft.gguf_file is not None:
                raise ValueError("draft.gguf_file: an EAGLE-3 head is a safetensors folder; remove gguf_file")
        if self.draft is not None:
            check_draft_limits(self.limits("target"), self.limits("draft"))
        if self.verify.max_tokens >= self.build.max_seq_len:
            raise ValueError(
                f"verify.max_tokens ({self.verify.max_tokens}) must be below build.max_seq_len ({self.build.max_seq_len})"
            )
        if self.backend == "torch":
            check_torch_models(self)
        return self

    def _check_auto_draft(self) -> None:
        """Method auto drafts with the `draft` model exactly when it lists draft_target (a
        checkpoint) or eagle3 (an EAGLE-3 head)."""
        listed = self.speculative.model_draft
        if listed is not None and self.draft is None:
            raise ValueError(f"auto.methods lists {listed}, which drafts with a `draft` model; add draft or remove {listed}")
        if listed is None and self.draft is not None:
            raise ValueError(
                f"auto.methods ({', '.join(self.speculative.methods)}) use no draft model; remove `draft` or list draft_target or eagle3"
            )

    def models(self) -> dict[str, ModelSpec]:
        """The models to build, by role."""
        roles = {"target": self.target}
        if self.draft is not None:
            roles["draft"] = self.draft
        return roles

    def limits(self, role: str) -> BuildLimits:
        override = self.models()[role].build
        return override if override is not None else self.build

    def build_hash(self, role: str) -> str:
        """Hash of everything that shapes the engine of ``role`` (not serve/verify)."""
        payload = {
            "format": 1,
            "backend": self.backend,
            "model": self.models()[role].model_dump(mode="json"),
            "limits": self.limits(role).model_dump(mode="json"),
            "max_draft_len": self.speculative.max_draft_len,
            "use_draft_logits": self.speculative.use_draft_logits,
        }
        if self.backend == "trtllm" and self.trtllm.runtime == "llmapi":
            payload["trtllm"] = self.trtllm.model_dump(mode="json")
            # draft_kv is trtspec's in-process choice: no part of a TensorRT-LLM build
            payload["speculative"] = self.speculative.model_dump(mode="json", exclude={"draft_kv"})
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def check_torch_models(spec: EngineSpec) -> None:
    """Raise ValueError (rendered as a spec error) for TensorRT-LLM settings on backend torch."""
    for role, model in spec.models().items():
        if model.tp_size != 1 or model.pp_size != 1:
            raise ValueError(
                f"{role}: tp_size and pp_size are TensorRT-LLM options; the torch backend "
                "needs tp_size 1 and pp_size 1 (or set backend: trtllm)"
            )
        if model.quantization not in TORCH_QUANTIZATIONS:
            raise ValueError(
                f"{role}.quantization: {model.quantization} is a TensorRT-LLM quantization; "
                f"the torch backend runs {', '.join(TORCH_QUANTIZATIONS)} (or set backend: trtllm)"
            )
        if model.quantization != "none" and role == "draft" and spec.speculative.model_draft == "eagle3":
            raise ValueError(
                "draft.quantization: the torch backend runs an EAGLE-3 head as trained; "
                "remove quantization (the target may be quantized)"
            )
        if model.quantization != "none" and spec.device != "cpu":
            raise ValueError(
                f"{role}.quantization: {model.quantization} runs PyTorch's CPU weight-only "
                f"kernels; set device: cpu (not {spec.device}) or quantization: none"
            )
        if model.gpu_device_ids is not None:
            raise ValueError(f"{role}: gpu_device_ids only applies to backend: trtllm")
    if spec.speculative.use_draft_logits:
        raise ValueError(
            "speculative.use_draft_logits only applies to backend: trtllm; the torch "
            "backend accepts drafts by exact greedy token identity"
        )


def check_draft_limits(target: BuildLimits, draft: BuildLimits) -> None:
    """A draft engine drafts for every row the target runs, over the whole sequence: built
    smaller, it would fail whole batches at run time. Refuse it here (ValueError)."""
    small = [
        f"{name} {getattr(draft, name)} < the target's {getattr(target, name)}"
        for name in ("max_batch_size", "max_input_len", "max_seq_len")
        if getattr(draft, name) < getattr(target, name)
    ]
    if small:
        raise ValueError(
            f"draft.build is smaller than the target's limits ({'; '.join(small)}); the draft must take "
            "every row and token the target takes: raise draft.build or remove it to use the target's"
        )


class LoadedSpec(BaseModel):
    """A validated spec plus where it came from (relative paths resolve against it)."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    spec: EngineSpec
    path: Path

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def resolve(self, p: str) -> Path:
        q = Path(p).expanduser()
        return q if q.is_absolute() else (self.base_dir / q).resolve()

    def output_dir(self, override: str | Path | None = None) -> Path:
        if override is not None:
            return Path(override).expanduser().resolve()
        if self.spec.output_dir is not None:
            return self.resolve(self.spec.output_dir)
        return (Path.cwd() / "engines" / self.spec.name).resolve()

    def repo_dir(self, override: str | Path | None = None) -> Path:
        if override is not None:
            return Path(override).expanduser().resolve()
        if self.spec.serve.repo_dir is not None:
            return self.resolve(self.spec.serve.repo_dir)
        return (Path.cwd() / "model_repo" / self.spec.name).resolve()

    def capture_dir(self) -> Path | None:
        """serve.capture.dir resolved against the spec file; None when capture is off."""
        c = self.spec.serve.capture
        return None if c is None else self.resolve(c.dir)

    def verify_prompts(self) -> list[str]:
        """Inline prompts followed by those of prompts_file (JSONL, key "prompt")."""
        prompts = list(self.spec.verify.prompts)
        if self.spec.verify.prompts_file:
            prompts += read_prompts(self.resolve(self.spec.verify.prompts_file))
        return prompts


def read_prompts(path: Path, what: str = "verify.prompts_file") -> list[str]:
    """Prompts of a JSONL file, one {"prompt": "..."} object per line: the one prompt reader
    (``what`` names the setting or option the file came from in errors)."""
    return [row["prompt"] for row in read_prompt_rows(path, what)]


def read_prompt_rows(path: Path, what: str) -> list[dict]:
    """The JSON objects of a prompts file, each checked to hold a non-empty "prompt"."""
    if not path.is_file():
        raise SpecError(f"{what}: {path} does not exist; create it or fix the path")
    try:
        text = read_text_file(path, what)
    except OSError as e:
        raise SpecError(f"{what}: cannot read {path} ({e.strerror}); fix the path or permissions") from e
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path}:{n}: not valid JSON ({e.msg}); one object per line") from e
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise SpecError(f'{path}:{n}: expected {{"prompt": "<non-empty text>"}}')
        rows.append(row)
    return rows


def load_spec(path: str | Path) -> LoadedSpec:
    """Read, parse and validate an engine spec; raise SpecError with every problem."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise SpecError(f"spec file {p} not found; pass the path of an engine spec YAML")
    try:
        data = yaml.safe_load(read_text_file(p, "spec file"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(f"{p}:{where}: invalid YAML ({problem}); fix the syntax") from e
    if not isinstance(data, dict):
        raise SpecError(f"{p}: the spec must be a YAML mapping with at least name and target")
    try:
        spec = EngineSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(render_validation_error(p, e)) from e
    return LoadedSpec(spec=spec, path=p.resolve())


def _allowed_keys(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


_MODELS_BY_PATH: dict[str, type[BaseModel]] = {
    "": EngineSpec,
    "target": ModelSpec,
    "draft": ModelSpec,
    "speculative": SpeculativeSpec,
    "speculative.tree": TreeSpec,
    "speculative.tree.dynamic": DynamicTreeSpec,
    "build": BuildLimits,
    "target.build": BuildLimits,
    "draft.build": BuildLimits,
    "serve": ServeSpec,
    "verify": VerifySpec,
    "trtllm": TrtllmSpec,
    "distill": DistillRecipe,
}


def render_validation_error(path: Path, err: ValidationError) -> str:
    """One line per problem: ``<file>: <field.path>: <reason>``."""
    lines = []
    for e in err.errors():
        loc = [str(x) for x in e["loc"]]
        field = ".".join(loc) or "(top level)"
        kind = e["type"]
        if kind == "extra_forbidden":
            parent = ".".join(loc[:-1])
            model = _MODELS_BY_PATH.get(parent)
            allowed = f" (allowed: {_allowed_keys(model)})" if model else ""
            reason = f"unknown key; remove or rename it{allowed}"
        elif kind == "missing":
            reason = "required key is missing; add it"
        elif kind.startswith("value_error"):
            reason = str(e["msg"]).removeprefix("Value error, ")
        else:
            reason = f"{e['msg']} (got {e.get('input')!r})"
        # a reason that says what the key takes reads as a sentence about it
        lines.append(f"{path}: {field} {reason}" if reason.startswith("takes ") else f"{path}: {field}: {reason}")
    return "\n".join(lines)
