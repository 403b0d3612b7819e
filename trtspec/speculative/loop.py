"""The one speculative decoding loop, shared by every runtime.

Each step: the drafter proposes up to k tokens per sequence, or a draft tree (several
candidates per position, speculative/tree.py); the verifier runs the target once over
[context + drafts] (a tree with its tree attention mask) and returns the target's greedy
token after the context and after every draft node; the longest path of drafts that agrees
with them is accepted, plus the target's own next token (the bonus after a fully accepted
path, or the correction at the first disagreement). A chain is the one-branch tree: every
row goes through the same acceptance code. Target-only decoding is
the same loop with a drafter that proposes nothing (k = 0), so both paths share every rule
for EOS, stop sequences and max_tokens. A sequence's first step drafts nothing: its first
token comes from the target's prefill, at target-only speed, and the drafter joins on the
next step.

A step in which no sequence drafts (the load cap or switch_off at 0, or requests asking for no
drafts) may ask the target for a chunk of up to DECODE_CHUNK tokens per sequence in one call
(``Batch(decode_chunk=...)``, the served speculative endpoints), or up to SATURATED_CHUNK while
the caller says the batch is saturated (``Batch.saturated``: nobody can join before a sequence
leaves, and a request waits for the place): the tokens go through the same accept step and
rules, so only the number of calls changes.

A step is three stages with plain data between them: ``propose`` (the drafter's one call)
returns a Proposal, ``score`` (the target's one forward) returns a Verdict per row, and
``accept`` turns each verdict into a Decision (``decide``, a pure function) that is appended
to the row's result under the EOS, stop and max_tokens rules.

``Batch`` is the loop as an object whose sequences join and leave between steps (the Triton
orchestrator's continuous batching); ``generate`` runs one to the end.

Drafter and verifier are plain interfaces: in process they call torch engines; inside the
Triton orchestrator they call the engine models over BLS. The loop never drafts or scores.
What a drafter can do besides ``propose`` is its declared Capabilities
(speculative/capabilities.py), read once when the Batch is built.

Adaptive speculation (method auto, or ``adaptive`` on one method): the drafter is a ``Menu`` of
named drafters with an AdaptivePolicy (speculative/adaptive.py). Each step the drafters that
cost nothing offer their drafts, the policy picks per sequence the drafter and k (0: no draft)
and settles the step's choices together (a draft call and the verify delay the whole batch),
the model draft is asked only for the sequences it was picked for, and the loop times the
drafter's and the target's calls for the policy's costs. The accept step is the same, so the
output is too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypedDict

import torch

from trtspec.errors import RequestError
from trtspec.speculative.adaptive import OFF, AdaptivePolicy, Choice, RequestState, choice_key
from trtspec.speculative.capabilities import Capabilities, Drafter, TokenRows
from trtspec.speculative.metrics import SpecMetrics
from trtspec.speculative.processing import Processing, RowRules, log_prob_logits, processed, warp_params
from trtspec.speculative.sampling import SamplingParams, accept_or_resample, accept_tree, warp
from trtspec.speculative.schedule import LoadPolicy
from trtspec.speculative.tree import DraftTree, TreeShape, accepted_path

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

FinishReason = Literal["length", "eos", "stop"]
RowFlags = Sequence[bool] | None  # one flag per row of a step; None: no row is flagged
SHARED_SCOPE = ""  # the suffix cache scope of a request that names none: the deployment's shared one


@dataclass
class Verdict:
    """The target's greedy tokens after context + draft[:i] for i = 0, 1, ...

    At least up to the first disagreement with the draft, or len(draft) + 1 tokens when the
    whole draft agrees. For a draft tree: len(tree) + 1 tokens, the target's after the context
    then after each node's path (speculative/tree.py). ``margins`` (optional) are the target's
    top-1 minus top-2 logits at the same positions.
    """

    target_ids: list[int]
    margins: list[float] | None = None
    logits: torch.Tensor | None = None  # [len(draft) + 1, vocab]: what requests that need logits decide from
    # True when target_ids past the first disagreement are the target's own greedy
    # continuation (TensorRT-LLM's draft_tokens_external keeps decoding to
    # request_output_len after a rejection; a decode chunk): those tokens are kept, not discarded.
    continued: bool = False
    # The target engine's KV-cache blocks (new, reused, total) for this context, when it
    # reports them: the loop keeps those of a sequence's first forward (its context phase).
    kv_blocks: tuple[int, int, int] | None = None


# One row's draft tree as parent indices (speculative/tree.py); None: the draft is a chain.
TreeRows = Sequence[tuple[int, ...] | None]

# The most tokens the target decodes per sequence in one call when no sequence of a step drafts
# (Batch's decode_chunk, which the served speculative endpoints set): speculation off (the
# load cap or switch_off at 0, or every request's num_draft_tokens 0) then costs one engine
# request per chunk instead of one per token, as the target-only endpoint's decode does. It
# bounds how late the loop sees a load change: a request that arrives, or one that ends at EOS
# or a stop, waits at most a chunk (max_tokens ends fall on a chunk's end, see decode_chunks).
DECODE_CHUNK = 8
# The most tokens per sequence of a decode chunk while the batch is saturated (Batch.saturated,
# which the served scheduler sets before each step: no queued request fits before a running
# sequence leaves, and one waits to take its place). The load then cannot fall until a sequence
# ends, and whoever ends is replaced, so a longer chunk changes no step's draft length; it only
# makes an end at EOS or a stop, a cancel or a timeout wait up to this many forwards to be seen.
SATURATED_CHUNK = 64


@dataclass(frozen=True)
class DecodeChunk:
    """One row the target decodes greedily for several tokens in one call: up to ``tokens``
    tokens after its context, stopping after one of ``end_ids``."""

    tokens: int
    end_ids: frozenset[int]


class VerifyAsks(TypedDict, total=False):
    """What a step asks of the verifier besides the target's greedy tokens; the loop passes a
    key only when some row needs it."""

    # Rows whose Verdict must carry the target's logits (Verdict.logits): sampling, logits
    # processing, log probs or generation logits.
    want_logits: RowFlags
    # Rows on their first step: the loop keeps their Verdict.kv_blocks; a verifier that has to
    # ask for those counts asks only for these rows.
    context_phase: RowFlags
    # Per row the parents of its draft tree's nodes (drafts[j] holds their tokens in node
    # order), or None for a chain; passed only when some row drafted a tree that is not a chain.
    trees: TreeRows
    # Per row a decode chunk: no row drafts, and each row's Verdict is the target's greedy
    # continuation of its context, up to chunk.tokens tokens ending after an end id, with
    # ``continued`` True. Passed only by a Batch built with decode_chunk > 1 (its verifier
    # decodes chunks); a verifier that answers one token instead stays correct.
    decode_chunks: Sequence[DecodeChunk]


class Verifier(Protocol):
    def verify(self, contexts: TokenRows, drafts: TokenRows, **asks: Unpack[VerifyAsks]) -> list[Verdict]:
        """One Verdict per row: the target's tokens after the context and after every draft."""
        ...


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    num_draft_tokens: int = 0
    end_ids: frozenset[int] = frozenset()  # EOS-like ids: end generation, not emitted
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # end generation once emitted
    sampling: SamplingParams | None = None  # None: greedy (token-identical to target-only)
    processing: Processing | None = None  # penalties, min_tokens, bad words, bias (processing.py)
    log_probs: bool = False  # keep the target's log prob of every output token
    generation_logits: bool = False  # keep the target's raw logits at every output token
    # A draft tree shape (speculative/tree.py) for drafters that propose trees; None: a chain
    # of num_draft_tokens. num_draft_tokens 0 turns drafting off either way.
    tree: TreeShape | None = None
    # Suffix decoding's scope of the cache of earlier responses: the request reads and feeds
    # only its own scope's ("": the deployment's shared one); None: neither (speculative/suffix.py).
    suffix_scope: str | None = SHARED_SCOPE

    @property
    def needs_logits(self) -> bool:
        """The loop decides this request's tokens from the target's logits, not its greedy ids."""
        return (
            self.sampling is not None
            or self.log_probs
            or self.generation_logits
            or (self.processing is not None and self.processing.active)
        )

    def rules(self, generated: int) -> RowRules | None:
        """What a mirroring drafter needs to process its logits as the target's are."""
        if self.processing is None or not self.processing.active:
            return None
        return RowRules(self.processing, generated, self.end_ids)


@dataclass
class GenerationResult:
    output_ids: list[int] = field(default_factory=list)
    margins: list[float | None] = field(default_factory=list)  # per output token
    log_probs: list[float] = field(default_factory=list)  # per output token, when asked
    generation_logits: list[torch.Tensor] = field(default_factory=list)  # per output token [vocab], when asked
    kv_blocks: tuple[int, int, int] | None = None  # the target's context-phase KV blocks, if reported
    # Per target forward: (len(output_ids) when it began, drafts it scored); each further token
    # of a decode chunk (or of a target that kept decoding) is a forward of its own with none.
    # Verdicts replay the forward that produced a divergent token with exactly this shape.
    steps: list[tuple[int, int]] = field(default_factory=list)
    # Per target forward that scored a draft tree (not a chain): its index in ``steps`` -> the
    # tree's parents and its accepted nodes, so a verdict can replay that forward's shape.
    step_trees: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    end_id: int | None = None  # the end id that finished it (finish_reason "eos")
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PathRun:
    """One timed generation on one path (target-only or speculative), in process or served:
    tokens, optional per-token target margins, metrics, wall time."""

    output_ids: list[int]
    margins: list[float | None]
    metrics: SpecMetrics | None
    seconds: float
    prompt_ids: list[int] | None = None  # as the target saw them (None: not known here)
    steps: list[tuple[int, int]] | None = None  # GenerationResult.steps of a speculative run
    step_trees: dict | None = None  # GenerationResult.step_trees of a speculative run


# on_step(request index, tokens emitted this step, finished?) — streaming hook.
StepCallback = Callable[[int, list[int], bool], None]


class NoDrafter(Drafter):
    """Target-only decoding: propose nothing."""

    def propose(self, contexts, draft_lens):
        return [[] for _ in contexts]


class Menu:
    """The drafters adaptive speculation chooses among, by method name in the spec's order, and
    the policy that chooses. ``free``: the names whose drafts cost nothing (n-gram, suffix):
    they offer a draft every step; the others draft only where they are picked. A suffix
    drafter's offer is counted as sent (SourceCounts) only where it is picked."""

    # release takes the request's scope (passed on to the drafters that release, scoped or not)
    capabilities = Capabilities(scoped=True, releases=True)

    def __init__(self, drafters: dict[str, Drafter], policy: AdaptivePolicy):
        self.drafters = drafters
        self.policy = policy
        self.free = policy.settings.free

    def release(self, prompt: list[int], output: list[int], scope: str | None = SHARED_SCOPE) -> None:
        for d in self.drafters.values():
            _release(d, prompt, output, scope)

    def offer(self, name: str, contexts, draft_lens, rules, scopes) -> tuple[list[list[int]], Callable[[int, int], None]]:
        """A free drafter's drafts for every row, and ``take(row, k)``: row's first k tokens go
        to the target (what a suffix drafter then counts as sent)."""
        d = self.drafters[name]
        if not d.capabilities.offers:  # nothing to count: propose as usual
            return _propose(d, contexts, draft_lens, rules, scopes), lambda j, k: None
        found = d.drafts(contexts, draft_lens, scopes)
        return [f.tokens for f in found], lambda j, k: d.sent(found[j].session, len(contexts[j]), found[j].tokens[:k], name)


def accepted_prefix(draft: list[int], verdict: Verdict) -> int:
    """Number of draft tokens the target agreed with; validates the verdict's shape."""
    target = verdict.target_ids
    n = 0
    while n < len(draft) and n < len(target) and draft[n] == target[n]:
        n += 1
    if n >= len(target):
        raise ValueError(
            f"verifier returned {len(target)} token(s) for a draft of {len(draft)}: "
            "it must include the target's next token after the accepted prefix"
        )
    return n


@dataclass
class Proposal:
    """One step's drafts, row j for sequence keys[j]: what the verifier scores next."""

    keys: list[int]  # the sequences the step runs, in the order they were added
    contexts: list[list[int]]  # prompt + output so far
    # Per row the most draft tokens the target scores for it this step (Batch.draft_lens); a
    # tree row's: its node count.
    draft_lens: list[int]
    drafts: list[list[int]]  # at most draft_lens[j] tokens; a drafter may propose fewer (a tree's in node order)
    qs: list[torch.Tensor | None]  # sampled rows' draft distributions [len(draft), vocab]; None: a point mass
    cap: int | None = None  # the load policy's draft-length cap this step (None: no cap)
    # Per row its draft as a tree (a chain: the one-branch tree of drafts[j]); None: built from drafts.
    trees: list[DraftTree] | None = None
    # Adaptive speculation: per row the policy's choice (None: no choice, e.g. a first step).
    choices: list[Choice | None] | None = None
    # ... and per row what each free drafter offered (cut to the row's ceiling), sent or not: the
    # accept step's tokens tell the policy how much of every offer the target would have accepted.
    offers: list[dict[str, list[int]]] | None = None
    # No row drafts and the target decodes several tokens per row in one call (Batch.decode_chunks).
    chunks: list[DecodeChunk] | None = None

    def tree(self, j: int) -> DraftTree:
        return self.trees[j] if self.trees is not None else DraftTree.chain(self.drafts[j])


@dataclass
class Decision:
    """What one row's verdict keeps: the drafts it accepted, then the target's own token(s).
    EOS, stop sequences and max_tokens may still cut ``tokens`` when they are appended."""

    tokens: list[int]
    accepted: int  # drafts accepted (the first ``accepted`` of tokens)
    margins: list[float] | None = None  # the target's top-1 minus top-2 logit at each token
    log_probs: list[float] | None = None  # when the request asks for them
    logit_rows: torch.Tensor | None = None  # [len(tokens), vocab]: generation logits, when asked
    # Further forwards of a target that kept decoding past a rejection (Verdict.continued).
    extra: int = 0
    path: list[int] | None = None  # the accepted draft nodes (a chain's: 0..accepted-1)


@dataclass
class StepReport:
    """What one step did: the counts monitoring reads, in one place."""

    sequences: int = 0  # sequences the step ran (one target forward each)
    drafted: int = 0  # draft tokens proposed this step, all sequences
    accepted: int = 0  # of those, accepted by the target
    draft_len: int = 0  # the largest of the step's draft_lens (0: no sequence drafted)
    # The largest num_draft_tokens of the step's requests (within the load cap), before the
    # loop drafts less near max_tokens or nothing on a sequence's first step: what monitoring shows.
    num_draft_tokens: int = 0
    accepted_each: list[int] = field(default_factory=list)  # per sequence that drafted
    # Further forwards of a target that kept decoding past a rejection, or the further tokens
    # of a decode chunk (Verdict.continued): each yielded one token, as SpecMetrics counts them.
    extra_forwards: int = 0
    emitted: dict[int, list[int]] = field(default_factory=dict)  # key -> tokens appended this step
    # Adaptive speculation: the policy's choice per sequence it chose for ("drafter:k").
    chosen: list[str] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # keys whose generation ended this step


class Batch:
    """The loop as an object, so sequences can join and leave between steps (continuous
    batching): ``add`` a request, ``step`` runs ONE draft + verify over every unfinished
    sequence, ``cancel`` drops one, ``pop`` hands a finished result over.

    A sequence's first step drafts nothing: its first token comes from the target's prefill
    alone (time to first token at target speed), and the drafter catches up on the next
    step. The target still decides every token, so outputs are unchanged.

    ``decode_chunk`` > 1 (a verifier that answers VerifyAsks' decode_chunks): a step in which
    no sequence drafts asks the target for up to that many tokens per sequence in one call
    (``decode_chunks``), or up to ``saturated_chunk`` while ``saturated`` is True (the caller's
    word, renewed before each step, that no request can join before a sequence leaves and one
    waits to take its place); the tokens are appended under the same EOS, stop and max_tokens rules.
    """

    def __init__(
        self,
        drafter: Drafter,
        verifier: Verifier,
        on_step: StepCallback | None = None,
        policy: LoadPolicy | None = None,
        decode_chunk: int = 1,
        saturated_chunk: int | None = None,
    ):
        if not isinstance(drafter, (Drafter, Menu)):
            raise TypeError(
                f"{type(drafter).__name__} is not a Drafter: subclass speculative.capabilities.Drafter "
                "and declare its capabilities"
            )
        self.drafter = drafter
        self.capabilities = drafter.capabilities  # what the drafter can do, read once
        self.verifier = verifier
        self.on_step = on_step
        self.policy = policy  # load-aware draft-length cap and acceptance switch-off (schedule.py)
        self.decode_chunk = decode_chunk  # the most tokens per sequence of a step that drafts nothing
        # ... while ``saturated`` (None: decode_chunk); the caller sets ``saturated`` before a step
        self.saturated_chunk = decode_chunk if saturated_chunk is None else saturated_chunk
        self.saturated = False
        self.requests: dict[int, GenerationRequest] = {}
        self.results: dict[int, GenerationResult] = {}
        self.gens: dict[int, torch.Generator] = {}  # sampled requests' random streams
        # Adaptive speculation (drafter a Menu): each request's recent acceptance per drafter.
        self.menu = drafter if isinstance(drafter, Menu) else None
        self.states: dict[int, RequestState] = {}
        self._next = 0

    def add(self, request: GenerationRequest) -> int:
        """Queue ``request`` for the next step; returns its key (0, 1, ... in call order)."""
        key, self._next = self._next, self._next + 1
        self.requests[key] = request
        self.results[key] = GenerationResult()
        if request.sampling is not None:
            self.gens[key] = request.sampling.generator()
        if self.menu is not None:
            self.states[key] = self.menu.policy.new_request()
        if request.max_tokens <= 0:
            self.results[key].finish_reason = "length"
            if self.on_step:
                self.on_step(key, [], True)
        return key

    @property
    def active(self) -> list[int]:
        """Keys of the sequences the next step runs, in the order they were added."""
        return [key for key, res in self.results.items() if not res.done]

    def cancel(self, key: int) -> GenerationResult:
        """Stop ``key`` now (its tokens so far stay in the result) and forget it. A drafter
        that keeps per-request state (suffix decoding) is told, through ``release``."""
        self.gens.pop(key, None)
        self.states.pop(key, None)
        request, result = self.requests.pop(key), self.results.pop(key)
        _release(self.drafter, request.prompt_ids, result.output_ids, request.suffix_scope)
        return result

    def pop(self, key: int) -> GenerationResult:
        """The result of a finished sequence, forgotten here."""
        if not self.results[key].done:
            raise ValueError(f"sequence {key} has not finished; cancel it instead")
        return self.cancel(key)

    def step(self) -> StepReport:
        """Propose, score, accept: the drafter's one call, the target's one forward, and the
        tokens each sequence keeps, with plain data (Proposal, Verdicts) between them."""
        active = self.active
        if not active:
            return StepReport()
        proposal = self.propose(active)
        if self.menu is None:
            return self.accept(proposal, self.score(proposal))
        clock = self.menu.policy.costs.clock
        start = clock()
        verdicts = self.score(proposal)
        # a prefill's forward is no decode step's cost, nor is a decode chunk's several forwards
        if proposal.chunks is None and all(self.results[i].steps for i in proposal.keys):
            self.menu.policy.costs.verified(sum(len(d) + 1 for d in proposal.drafts), clock() - start)
        return self.accept(proposal, verdicts)

    def propose(self, active: list[int]) -> Proposal:
        """Drafts for the sequences ``active`` (the drafter's only call this step)."""
        requests, results = self.requests, self.results
        contexts = [requests[i].prompt_ids + results[i].output_ids for i in active]
        cap = self.policy.cap(len(active)) if self.policy is not None else None
        draft_lens = self.draft_lens(active, cap)
        chunks = self.decode_chunks(active, draft_lens)
        if chunks is not None:  # nobody drafts: the drafter is not asked
            return Proposal(active, contexts, draft_lens, [[] for _ in active], [None] * len(active), cap, chunks=chunks)
        if self.menu is not None:
            return self._propose_chosen(active, contexts, draft_lens, cap)
        drafts: list[list[int]] = [[] for _ in active]
        qs: list[torch.Tensor | None] = [None for _ in active]
        trees = self._propose_trees(active, contexts, draft_lens, cap)
        for j, tree in trees.items():
            drafts[j], draft_lens[j] = list(tree.tokens), len(tree)
        wants = [j for j, k in enumerate(draft_lens) if k > 0 and requests[active[j]].sampling is None and j not in trees]
        if wants:
            rules = [requests[active[j]].rules(len(results[active[j]].output_ids)) for j in wants]
            scopes = [requests[active[j]].suffix_scope for j in wants]
            proposed = _propose(self.drafter, [contexts[j] for j in wants], [draft_lens[j] for j in wants], rules, scopes)
            for j, d in zip(wants, proposed):
                drafts[j] = list(d[: draft_lens[j]])
        sampled = [j for j, k in enumerate(draft_lens) if k > 0 and requests[active[j]].sampling is not None and j not in trees]
        if sampled:
            _propose_sampled(
                self.drafter,
                sampled,
                contexts,
                draft_lens,
                [requests[active[j]] for j in sampled],
                [self.gens[active[j]] for j in sampled],
                drafts,
                qs,
                [len(results[active[j]].output_ids) for j in sampled],
            )
        rows = [trees[j] if j in trees else DraftTree.chain(d) for j, d in enumerate(drafts)]
        return Proposal(active, contexts, draft_lens, drafts, qs, cap, rows)

    def draft_lens(self, active: list[int], cap: int | None) -> list[int]:
        """The step's draft length per sequence, decided here: its request's num_draft_tokens,
        never past the token budget (n accepted + 1 target token <= tokens left) nor the load
        cap; 0 on a sequence's first step (its first token is the target's prefill). A tree
        row's becomes its tree's node count (_propose_trees); adaptive speculation picks within it."""
        lens = []
        for i in active:
            req, res = self.requests[i], self.results[i]
            left = req.max_tokens - len(res.output_ids) - 1
            n = 0 if not res.steps else max(0, min(req.num_draft_tokens, left))
            lens.append(n if cap is None else min(n, cap))
        return lens

    def decode_chunks(self, active: list[int], draft_lens: list[int]) -> list[DecodeChunk] | None:
        """Per sequence its decode chunk, when the target may decode several tokens for each in
        one call: no sequence drafts this step (the load cap, switch_off, or its request's
        num_draft_tokens at 0; adaptive speculation's own "off" choices are made per step and
        keep one token), each is past its first step (whose first token is the prefill's) and
        is decided from the target's greedy ids (sampling, logits processing, log probs and
        generation logits need the target's logits at every token). Every sequence gets the
        same length: at most decode_chunk, or saturated_chunk while the batch is ``saturated``,
        and never past the fewest tokens any has left, so one that ends at max_tokens ends with
        the chunk and the next step sees the lower load. None: one token each."""
        if self.decode_chunk <= 1 or any(draft_lens):
            return None
        requests, results = self.requests, self.results
        if any(not results[i].steps or requests[i].needs_logits for i in active):
            return None
        most = self.saturated_chunk if self.saturated else self.decode_chunk
        n = min(most, *(requests[i].max_tokens - len(results[i].output_ids) for i in active))
        return [DecodeChunk(n, requests[i].end_ids) for i in active] if n > 1 else None

    def _propose_chosen(self, active: list[int], contexts, ceilings: list[int], cap: int | None) -> Proposal:
        """Adaptive speculation: the free drafters offer, the policy picks (drafter, k) per row
        within its ceiling and then settles the rows' choices together by what the batch gets
        per second, the picked model drafter drafts its rows (timed for the policy)."""
        menu, n = self.menu, len(active)
        rows = [j for j, k in enumerate(ceilings) if k > 0]
        rules = [self.requests[active[j]].rules(len(self.results[active[j]].output_ids)) for j in rows]
        scopes = [self.requests[active[j]].suffix_scope for j in rows]
        sub = ([contexts[j] for j in rows], [ceilings[j] for j in rows])
        offers: dict[int, dict[str, int]] = {j: {} for j in rows}
        offered: dict[str, tuple[list[list[int]], Callable[[int, int], None]]] = {}
        for name in menu.drafters:
            if name in menu.free and rows:
                offered[name] = menu.offer(name, *sub, rules, scopes)
            for r, j in enumerate(rows):
                offers[j][name] = len(offered[name][0][r]) if name in offered else ceilings[j]
        choices = [Choice(OFF, 0)] * n
        for j in rows:
            choices[j] = menu.policy.choose(self.states[active[j]], offers[j], ceilings[j], n)
        choices = menu.policy.settle([self.states[i] for i in active], choices)  # the batch waits for every draft
        drafts: list[list[int]] = [[] for _ in active]
        qs: list[torch.Tensor | None] = [None] * n
        for r, j in enumerate(rows):
            c = choices[j]
            if c.drafter in offered:
                drafts[j] = offered[c.drafter][0][r][: c.k]
                offered[c.drafter][1](r, c.k)
        for name in menu.drafters:
            if name not in menu.free:
                self._draft_picked(name, [j for j in rows if choices[j].drafter == name], active, contexts, choices, drafts, qs)
        draft_lens = [c.k for c in choices]
        chosen = [c if j in offers else None for j, c in enumerate(choices)]
        shown: list[dict[str, list[int]]] = [{} for _ in active]
        for r, j in enumerate(rows):
            shown[j] = {name: offered[name][0][r][: ceilings[j]] for name in offered}
        return Proposal(active, contexts, draft_lens, drafts, qs, cap, choices=chosen, offers=shown)

    def _draft_picked(self, name: str, picked: list[int], active, contexts, choices, drafts, qs) -> None:
        """The model drafter ``name``'s drafts for the rows ``picked`` for it, timed."""
        if not picked:
            return
        drafter, clock = self.menu.drafters[name], self.menu.policy.costs.clock
        draft_lens = [choices[j].k for j in range(len(active))]
        start = clock()
        greedy = [j for j in picked if self.requests[active[j]].sampling is None]
        if greedy:
            rules = [self.requests[active[j]].rules(len(self.results[active[j]].output_ids)) for j in greedy]
            scopes = [self.requests[active[j]].suffix_scope for j in greedy]
            for j, d in zip(
                greedy, _propose(drafter, [contexts[j] for j in greedy], [draft_lens[j] for j in greedy], rules, scopes)
            ):
                drafts[j] = list(d[: draft_lens[j]])
        sampled = [j for j in picked if self.requests[active[j]].sampling is not None]
        if sampled:
            reqs = [self.requests[active[j]] for j in sampled]
            generated = [len(self.results[active[j]].output_ids) for j in sampled]
            _propose_sampled(
                drafter, sampled, contexts, draft_lens, reqs, [self.gens[active[j]] for j in sampled], drafts, qs, generated
            )
        self.menu.policy.costs.drafted(name, max(draft_lens[j] for j in picked), len(picked), clock() - start)

    def _propose_trees(self, active: list[int], contexts, draft_lens: list[int], cap: int | None) -> dict[int, DraftTree]:
        """Row -> its draft tree, for the rows whose request asks for a tree and whose drafter
        proposes trees. A tree is never deeper than the tokens left, nor larger than the load
        cap (nodes: what a verify costs); rows whose tree shrinks to nothing draft nothing.
        Sampled rows get the same trees: their candidates are point masses to rejection
        sampling (sampling.py)."""
        if not self.capabilities.trees:
            return {}
        shapes: dict[int, TreeShape] = {}
        for j, i in enumerate(active):
            shape = self.requests[i].tree
            if shape is None or draft_lens[j] == 0:
                continue
            left = self.requests[i].max_tokens - len(self.results[i].output_ids) - 1
            cut = shape.cut(shape.size if cap is None else cap, left)
            if cut is None:
                draft_lens[j] = 0
            else:
                shapes[j] = cut
        if not shapes:
            return {}
        proposed = self.drafter.propose_tree([contexts[j] for j in shapes], list(shapes.values()))
        return dict(zip(shapes, proposed))

    def score(self, proposal: Proposal) -> list[Verdict]:
        """The target's one forward over every row's context + drafts (the verifier's only call)."""
        asks: VerifyAsks = {}
        wants_logits = [self.requests[i].needs_logits for i in proposal.keys]
        if any(wants_logits):
            asks["want_logits"] = wants_logits
        first = [not self.results[i].steps for i in proposal.keys]
        if any(first):
            asks["context_phase"] = first
        trees = [None if t.is_chain else t.parents for t in (proposal.tree(j) for j in range(len(proposal.keys)))]
        if any(t is not None for t in trees):
            asks["trees"] = trees
        if proposal.chunks is not None:
            asks["decode_chunks"] = proposal.chunks
        return self.verifier.verify(proposal.contexts, proposal.drafts, **asks)

    def accept(self, proposal: Proposal, verdicts: list[Verdict]) -> StepReport:
        """Each row's tokens decided from its verdict and appended to its result, in row order."""
        keys, cap = proposal.keys, proposal.cap
        most = max(self.requests[i].num_draft_tokens for i in keys)
        report = StepReport(
            len(keys), draft_len=max(proposal.draft_lens), num_draft_tokens=most if cap is None else min(most, cap)
        )
        for j, i in enumerate(keys):
            req, res, draft, tree = self.requests[i], self.results[i], proposal.drafts[j], proposal.tree(j)
            decision = decide(
                req, len(res.output_ids), proposal.contexts[j], draft, proposal.qs[j], verdicts[j], self.gens.get(i), tree
            )
            if proposal.choices is not None and (c := proposal.choices[j]) is not None:
                self._observe(i, c, proposal.offers[j] if proposal.offers else {}, draft, decision)
                res.metrics.record_choice(choice_key(c.drafter, c.k))
                report.chosen.append(choice_key(c.drafter, c.k))
            self._record(i, tree, verdicts[j], decision, report)
        if self.policy is not None:
            self.policy.stepped(report.drafted, report.accepted)
        return report

    def _observe(self, key: int, choice: Choice, offers: dict[str, list[int]], draft: list[int], decision: Decision) -> None:
        """Tell the policy what the target accepted of the chosen draft, and, for a greedy request,
        how much of each free drafter's offer it would have accepted: the step's tokens are the
        target's own, so an offer is checked against them without being sent (sampled tokens
        are draws, not the target's answer to the offer)."""
        policy, state = self.menu.policy, self.states[key]
        policy.observe(state, choice.drafter, len(draft), decision.accepted)
        if self.requests[key].sampling is None:
            for name, offer in offers.items():
                if name != choice.drafter:
                    policy.shadow(state, name, offer, decision.tokens)

    def _record(self, key: int, tree: DraftTree, verdict: Verdict, decision: Decision, report: StepReport) -> None:
        """Append one row's decision to its result, metrics and the step's report; tell on_step."""
        req, res = self.requests[key], self.results[key]
        draft = tree.tokens
        res.metrics.record_step(len(draft), decision.accepted, tree.depth)
        if not tree.is_chain:
            path = decision.path or []
            res.metrics.record_nodes([tree.key(n) for n in range(len(tree))], [tree.key(n) for n in path])
            res.step_trees[len(res.steps)] = (tree.parents, tuple(path))
        for _ in range(decision.extra):  # each further token cost the target one decode step
            res.metrics.record_step(0, 0)
        if not res.steps:
            res.kv_blocks = verdict.kv_blocks
        start = len(res.output_ids)
        res.steps.append((start, len(draft)))
        # the further forwards (a decode chunk's, or a target's that kept decoding): one token each
        first = start + len(decision.tokens) - decision.extra
        res.steps += [(first + e, 0) for e in range(decision.extra)]
        emitted = _emit(req, res, decision.tokens, decision.margins, decision.log_probs, decision.logit_rows)
        report.drafted += len(draft)
        report.extra_forwards += decision.extra
        report.accepted += decision.accepted
        if draft:
            report.accepted_each.append(decision.accepted)
        report.emitted[key] = emitted
        if res.done:
            report.finished.append(key)
            if self.policy is not None:
                self.policy.finished(res.metrics.drafted, res.metrics.mean_acceptance_length)
        if self.on_step:
            self.on_step(key, emitted, res.done)


def generate(
    requests: Sequence[GenerationRequest],
    drafter: Drafter,
    verifier: Verifier,
    on_step: StepCallback | None = None,
    policy: LoadPolicy | None = None,
) -> list[GenerationResult]:
    """Generation for a batch of requests. Greedy requests: identical tokens whatever the
    drafter. Sampled requests (``sampling`` set): rejection sampling, so every token follows
    the target's distribution whatever the drafter (speculative/sampling.py)."""
    batch = Batch(drafter, verifier, on_step, policy)
    keys = [batch.add(r) for r in requests]  # key i is requests[i]: on_step's index
    while batch.active:
        batch.step()
    return [batch.pop(k) for k in keys]


def _propose(
    drafter: Drafter, contexts, draft_lens, rules: Sequence[RowRules | None], scopes: Sequence[str | None]
) -> list[list[int]]:
    """Greedy drafts; the requests' logits processing goes along to a drafter that mirrors it,
    their suffix scopes to a drafter that is scoped."""
    return drafter.propose(contexts, draft_lens, **_row_keywords(drafter, rules, scopes))


def _row_keywords(drafter: Drafter, rules: Sequence[RowRules | None], scopes: Sequence[str | None]) -> dict:
    """The per-row keywords a drafter takes: ``rules`` where it mirrors processing (and some
    row has rules), ``scopes`` where it is scoped."""
    kw: dict = {}
    if any(r is not None for r in rules) and drafter.capabilities.mirrors_processing:
        kw["rules"] = rules
    if drafter.capabilities.scoped:
        kw["scopes"] = scopes
    return kw


def _release(drafter: Drafter | Menu, prompt: list[int], output: list[int], scope: str | None) -> None:
    """Tell a drafter that releases that the sequence prompt + output left the loop (with its
    suffix cache scope where the drafter is scoped)."""
    if drafter.capabilities.releases:
        drafter.release(prompt, output, *((scope,) if drafter.capabilities.scoped else ()))


def _propose_sampled(drafter, sampled, contexts, draft_lens, reqs, gens, drafts, qs, generated) -> None:
    """Sampled drafts and their distributions; a drafter without ``propose_sampled`` (prompt
    lookup) proposes as usual and counts as a point mass (q None)."""
    sub_ctx, sub_lens = [contexts[j] for j in sampled], [draft_lens[j] for j in sampled]
    rules = [r.rules(g) for r, g in zip(reqs, generated)]
    scopes = [r.suffix_scope for r in reqs]
    if drafter.capabilities.samples:
        kw = _row_keywords(drafter, rules, scopes)
        proposed = drafter.propose_sampled(sub_ctx, sub_lens, [r.sampling for r in reqs], gens, **kw)
        for j, (d, q) in zip(sampled, proposed):
            drafts[j], qs[j] = list(d[: draft_lens[j]]), q[: draft_lens[j]]
    else:
        for j, d in zip(sampled, _propose(drafter, sub_ctx, sub_lens, rules, scopes)):
            drafts[j] = list(d[: draft_lens[j]])


def decide(
    req: GenerationRequest,
    generated: int,
    context: list[int],
    draft: list[int],
    q: torch.Tensor | None,
    verdict: Verdict,
    gen: torch.Generator | None,
    tree: DraftTree | None = None,
) -> Decision:
    """What the target's verdict keeps of one row's draft (``generated`` tokens already out).
    Greedy requests read its greedy ids; the others its logits, processed as the request
    asks, then argmax or rejection sampling with ``gen`` against the draft distribution q.
    ``tree``: the draft as a tree (None: the chain ``draft``); either way the accepted nodes
    form one path and the tokens kept are that path's, then the target's own."""
    tree = tree if tree is not None else DraftTree.chain(draft)
    if not req.needs_logits:
        if verdict.continued:
            if not tree.is_chain:
                raise ValueError("a verifier that keeps decoding past a rejection scores chains only, not draft trees")
            n = accepted_prefix(draft, verdict)
            # A target that kept decoding after a rejection keeps those tokens.
            keep = len(verdict.target_ids)
            margins = verdict.margins[:keep] if verdict.margins else None
            return Decision(verdict.target_ids[:keep], n, margins, extra=keep - (n + 1), path=list(range(n)))
        path = accepted_path(tree, verdict.target_ids)
        rows = _rows(path)
        new = [tree.tokens[c] for c in path] + [verdict.target_ids[rows[-1]]]
        margins = [verdict.margins[r] for r in rows] if verdict.margins else None
        return Decision(new, len(path), margins, path=path)
    if verdict.logits is None:
        raise RequestError(
            "this verifier returns no logits, so it cannot sample, process logits or return log probs; "
            "send a plain greedy request"
        )
    logits = _processed_rows(verdict.logits, req, context, generated, tree)
    if req.sampling is None:
        path = accepted_path(tree, torch.argmax(logits, dim=-1).tolist())  # lowest index among exact ties
        rows = _rows(path)
        new = [tree.tokens[c] for c in path] + [int(torch.argmax(logits[rows[-1]]))]
        top = torch.topk(logits[rows], k=2, dim=-1).values
        margins = (top[:, 0] - top[:, 1]).tolist()
    else:
        p = warp(logits, warp_params(req.sampling, req.processing))
        if tree.is_chain:
            new, n = accept_or_resample(draft, q, p, gen)
            path = list(range(n))
        else:
            new, path = accept_tree(tree, q, p, gen)
        rows = _rows(path)
        margins = None
    log_probs = None
    if req.log_probs:
        t = req.sampling.temperature if req.sampling is not None else None
        lp = torch.log_softmax(log_prob_logits(logits[rows], req.processing, t).double(), dim=-1)
        log_probs = lp.gather(-1, torch.tensor(new).unsqueeze(-1)).squeeze(-1).tolist()
    # The target's own logits, unprocessed.
    logit_rows = verdict.logits[rows].float() if req.generation_logits else None
    return Decision(new, len(path), margins, log_probs, logit_rows, path=path)


def _rows(path: list[int]) -> list[int]:
    """The verdict rows of an accepted path's tokens: after the context, then after each node."""
    return [0] + [c + 1 for c in path]


def _processed_rows(logits: torch.Tensor, req: GenerationRequest, context, generated: int, tree: DraftTree) -> torch.Tensor:
    """The verdict's logits [len(tree) + 1, vocab] processed as the request asks; a tree's row
    j + 1 continues context + node j's path (its penalties count that path's tokens only)."""
    if tree.is_chain:
        return processed(logits, req.processing, context, generated, list(tree.tokens), req.end_ids)
    if req.processing is None or not req.processing.active:
        return logits
    rows = [processed(logits[:1], req.processing, context, generated, (), req.end_ids)]
    for node in range(len(tree)):
        path = [tree.tokens[c] for c in tree.path(node)]
        rows.append(
            processed(logits[node + 1 : node + 2], req.processing, list(context) + path, generated + len(path), (), req.end_ids)
        )
    return torch.cat(rows)


def finish(req: GenerationRequest, tokens: list[int], margins: list[float] | None = None) -> GenerationResult:
    """The result of target-only decoding done in one engine request: the same EOS, stop
    and max_tokens rules as the loop, applied to the tokens the engine returned."""
    res = GenerationResult()
    if req.max_tokens <= 0:
        res.finish_reason = "length"
        return res
    emitted = _emit(req, res, list(tokens), margins)
    for _ in emitted:  # one target decode step per token
        res.metrics.record_step(0, 0)
    if res.finish_reason is None:  # the engine stopped first (its end_id): an EOS end
        res.finish_reason = "eos"
    return res


def _emit(req: GenerationRequest, res: GenerationResult, new: list[int], margins, log_probs=None, logit_rows=None) -> list[int]:
    """Append tokens one by one, stopping exactly where token-by-token decoding would."""
    emitted = []
    for pos, tok in enumerate(new):
        if tok in req.end_ids:
            res.finish_reason = "eos"
            res.end_id = tok
            break
        res.output_ids.append(tok)
        res.margins.append(margins[pos] if margins else None)
        if log_probs is not None:
            res.log_probs.append(log_probs[pos])
        if logit_rows is not None:
            # A copy of its own: a view would keep the whole step's logits alive (every row
            # of the batch x every scored position x vocab) for as long as the result lives.
            res.generation_logits.append(logit_rows[pos].clone())
        emitted.append(tok)
        if any(_ends_with(res.output_ids, s) for s in req.stop_sequences):
            res.finish_reason = "stop"
            break
        if len(res.output_ids) >= req.max_tokens:
            res.finish_reason = "length"
            break
    return emitted


def _ends_with(seq: list[int], suffix: tuple[int, ...]) -> bool:
    return len(suffix) > 0 and len(seq) >= len(suffix) and tuple(seq[-len(suffix) :]) == suffix
