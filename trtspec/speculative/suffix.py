"""Suffix decoding (arXiv 2411.04975): drafts copied from wherever the text repeats.

Two indexes answer "where did the context's last tokens occur before, and what followed":
each request's own prompt + output (``TokenIndex``, grown as the request decodes) and, per
deployment, the outputs of earlier requests (``ResponseCache``, bounded in tokens and in
responses, oldest evicted first). An occurrence is a *candidate* when the context's last two
tokens match (its last token, where that pair never occurred); its match length is how far
back the match goes (at most ``max_depth``).

A proposal is scored by match length and frequency, as the paper does: for a match length L,
the candidates matching at least L tokens vote on the next token; the draft follows the
majority token while the estimated probability (the share of candidates that continue that
way, multiplied along the path) stays >= ``min_token_prob``, for at most
``min(k, spec_factor * L, max_depth - L)`` tokens. The score is the expected number of
accepted tokens (the sum of the path's probabilities); every distinct L is tried and the best
score wins, so the number of drafted tokens per step follows from how long the match is and
how often its continuation was seen.

The drafter is deterministic (a point mass per token), so speculative sampling stays lossless
exactly as for prompt lookup (speculative/sampling.py). Memory: the per-request indexes live
only while their requests do; the cache holds at most ``cache_tokens`` tokens (about
``BYTES_PER_TOKEN`` bytes each, index included) and ``cache_responses`` responses.
``cache_responses: 0`` keeps requests apart (each drafts only from its own prompt and output).

Scopes: the cache is partitioned by each request's ``suffix_scope`` (GenerationRequest): a
request reads and feeds only its own scope's earlier responses (``SHARED_SCOPE``, the default,
is the deployment's shared one), and a request whose scope is None neither reads nor feeds it.
A scope's tenant is its text before the first "/" (``tenant_of``): the caps are split into
``tenants`` equal shares, one per tenant, and eviction is oldest first within a tenant's share,
so no tenant evicts another's responses.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from trtspec.spec import SuffixSpec
from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.loop import SHARED_SCOPE
from trtspec.speculative.metrics import SourceCounts

# What one cached token costs, index included, at most (measured by tests/test_suffix.py with
# tracemalloc; the cache may hold up to twice its live tokens between compactions).
BYTES_PER_TOKEN = 280
# What one scope costs beyond its tokens, its key of at most 256 bytes included, at most
# (measured by tests/test_suffix.py; only scopes with a live response are kept).
BYTES_PER_SCOPE = 640
_SEPARATOR = -1  # between cached responses: no match or continuation crosses it
_MAX_CANDIDATES = 64  # latest occurrences examined per index
_MAX_SESSIONS = 1024  # per-request indexes kept for requests never released (safety bound)
SUFFIX, MODEL = "suffix", "model"  # draft sources, as SourceCounts and the metrics name them
Scope = str | None  # a request's scope; None: it neither reads nor feeds the response cache


@dataclass(frozen=True)
class SuffixDraft:
    """One row's proposal: the tokens, the match length they follow, and their score (the
    expected number of them the target accepts)."""

    tokens: list[int]
    match: int = 0
    score: float = 0.0
    session: int = -1  # the request's index in SuffixDrafter.sessions


def _key(a: int, b: int) -> int:
    """A pair's key: >= 2**32, apart from every single token's (a token id, or -1)."""
    return ((a + 2) << 32) | (b & 0xFFFFFFFF)


class TokenIndex:
    """A token stream and, for every token and every pair of adjacent tokens, the positions
    where it ends."""

    __slots__ = ("tokens", "at")

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.at: dict[int, array] = {}  # a token (>= 0) or a pair (_key) -> end positions
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        t, at = self.tokens, self.at
        for x in tokens:
            t.append(x)
            keys = (x, _key(t[-2], x)) if len(t) >= 2 else (x,)
            for k in keys:
                pos = at.get(k)
                if pos is None:
                    at[k] = array("i", (len(t) - 1,))
                else:
                    pos.append(len(t) - 1)

    def candidates(self, ctx: list[int], max_depth: int, limit: int, start: int = 0) -> list[tuple[int, int]]:
        """(match length, end position) of the latest occurrences of ctx's last two tokens
        (of its last token where the pair never occurred) within [start, limit) that have a
        token after them; a match does not reach back before ``start``."""
        if not ctx:
            return []
        t, out, n = self.tokens, [], len(ctx)
        for key, m0 in ((_key(ctx[-2], ctx[-1]), 2), (ctx[-1], 1)) if n >= 2 else ((ctx[-1], 1),):
            for p in reversed(self.at.get(key, ())):
                if p >= limit or p + 1 >= len(t):
                    continue
                if p - m0 + 1 < start:
                    break  # positions only fall from here
                m = m0
                while m < max_depth and m < n and p - m >= start and t[p - m] == ctx[n - 1 - m]:
                    m += 1
                out.append((m, p))
                if len(out) >= _MAX_CANDIDATES:
                    break
            if out:
                break
        return out


class _Part:
    """One scope's earlier responses: a token stream and the position of its oldest live token."""

    __slots__ = ("scope", "index", "start")

    def __init__(self, scope: str):
        self.scope = scope
        self.index = TokenIndex()
        self.start = 0

    @property
    def live(self) -> int:
        return len(self.index.tokens) - self.start


def tenant_of(scope: str) -> str:
    """The tenant whose share holds ``scope``: its text before the first "/" (the OpenAI front
    writes tenant/user; "" is the direct Triton callers' tenant)."""
    return scope.split("/", 1)[0]


class _Share:
    """One tenant's live responses, oldest first, with the scope each is in."""

    __slots__ = ("sizes", "owners", "live_tokens")

    def __init__(self):
        self.sizes: deque[int] = deque()  # live responses' lengths (separator included)
        self.owners: deque[_Part] = deque()  # ... and the scope each is in
        self.live_tokens = 0


class ResponseCache:
    """Earlier responses of one deployment, partitioned by scope (a request reads only its
    own scope's). The caps (``max_tokens`` live tokens, ``max_responses`` responses) are split
    into ``tenants`` equal shares, one per tenant (``tenant_of``): a response evicts the oldest
    of its own tenant's, never another tenant's; a tenant arriving when every share is held is
    not cached. ``tenants`` 1: one pool for every scope, oldest evicted first across them. A scope's evicted tokens stay in its stream until they are as many as its live
    ones, then the stream is rebuilt from the live part; a scope left with no live response is
    dropped, and a tenant left with none frees its share."""

    def __init__(self, max_responses: int, max_tokens: int, tenants: int = 1):
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self.tenants = tenants
        self.share_responses = max(1, max_responses // tenants)  # each tenant's caps
        self.share_tokens = max(2, max_tokens // tenants)
        self.parts: dict[str, _Part] = {}  # scope -> its responses (only scopes with live ones)
        self.shares: dict[str, _Share] = {}  # tenant -> its share (only tenants with live responses)

    @property
    def sizes(self) -> list[int]:
        """Live responses' lengths (separator included), oldest first within each share."""
        return [n for share in self.shares.values() for n in share.sizes]

    @property
    def owners(self) -> list[_Part]:
        return [part for share in self.shares.values() for part in share.owners]

    @property
    def live_tokens(self) -> int:
        return sum(share.live_tokens for share in self.shares.values())

    @property
    def held_tokens(self) -> int:
        """Tokens the streams hold, evicted ones awaiting a compaction included."""
        return sum(len(p.index.tokens) for p in self.parts.values())

    def clear(self) -> None:
        """Forget every response (comparisons start cold: see Deployment.forget_prefixes)."""
        self.parts.clear()
        self.shares.clear()

    def add(self, tokens: Sequence[int], scope: Scope = SHARED_SCOPE) -> None:
        """Remember one response in ``scope`` (a longer one than its share's cap keeps its last
        tokens; scope None, or a new tenant when every share is held: nothing is kept)."""
        if scope is None or self.max_responses <= 0 or self.max_tokens <= 1 or not tokens:
            return
        tenant = tenant_of(scope) if self.tenants > 1 else ""  # one share: one pool for every scope
        share = self.shares.get(tenant)
        if share is None:
            if len(self.shares) >= self.tenants:
                return
            share = self.shares[tenant] = _Share()
        tokens = list(tokens[-(self.share_tokens - 1) :]) + [_SEPARATOR]
        part = self.parts.get(scope)
        if part is None:
            part = self.parts[scope] = _Part(scope)
        part.index.extend(tokens)
        share.sizes.append(len(tokens))
        share.owners.append(part)
        share.live_tokens += len(tokens)
        self._evict(tenant, share)

    def _evict(self, tenant: str, share: _Share) -> None:
        """The share's oldest responses until it is within its caps."""
        evicted: dict[str, _Part] = {}
        while share.sizes and (len(share.sizes) > self.share_responses or share.live_tokens > self.share_tokens):
            n, old = share.sizes.popleft(), share.owners.popleft()
            old.start += n
            share.live_tokens -= n
            evicted[old.scope] = old
        for old in evicted.values():
            if old.live == 0:
                del self.parts[old.scope]
            elif old.start >= old.live:
                old.index, old.start = TokenIndex(old.index.tokens[old.start :]), 0
        if not share.sizes:
            del self.shares[tenant]

    def candidates(self, ctx: list[int], max_depth: int, scope: Scope = SHARED_SCOPE) -> list[tuple[int, list[int], int]]:
        """(match length, stream, end position) as TokenIndex.candidates, over ``scope``'s live
        responses only (none for scope None)."""
        part = None if scope is None else self.parts.get(scope)
        if part is None:
            return []
        t = part.index.tokens
        return [(m, t, p) for m, p in part.index.candidates(ctx, max_depth, len(t), part.start)]


class SuffixDrafter(Drafter):
    """Suffix decoding's drafter: each request's own index plus the deployment's
    ``cache`` (None: requests kept apart), read and fed in each request's scope (``scopes``,
    one per context, from GenerationRequest.suffix_scope; the loop passes them to a drafter
    that is ``scoped``). ``release`` (the loop calls it when a sequence leaves) drops the
    request's index and caches its output in its scope.

    ``sources`` counts drafted and accepted tokens by source ("suffix", or "model" where a
    layered drafter sent the model's draft instead): a draft sent for a context is settled
    when the same request comes back (the tokens that followed show how many the target
    accepted) or leaves."""

    # propose / release take the requests' scopes; a Menu's offers are counted where taken
    capabilities = Capabilities(scoped=True, releases=True, offers=True)

    def __init__(self, settings: SuffixSpec, cache: ResponseCache | None = None, sources: SourceCounts | None = None):
        self.settings = settings
        self.cache = cache
        self.sessions: OrderedDict[int, TokenIndex] = OrderedDict()  # id -> a live request's index
        self._scope: dict[int, Scope] = {}  # id -> its request's scope
        self.sources = sources if sources is not None else SourceCounts()  # may be the deployment's
        self._sent: dict[int, tuple[int, list[int], str]] = {}  # session -> (context length, draft, source)
        self._next = 0

    def propose(
        self, contexts: Sequence[list[int]], draft_lens: Sequence[int], scopes: Sequence[Scope] | None = None
    ) -> list[list[int]]:
        drafts = self.drafts(contexts, draft_lens, scopes)
        for ctx, d in zip(contexts, drafts):
            self.sent(d.session, len(ctx), d.tokens, SUFFIX)
        return [d.tokens for d in drafts]

    def drafts(
        self, contexts: Sequence[list[int]], draft_lens: Sequence[int], scopes: Sequence[Scope] | None = None
    ) -> list[SuffixDraft]:
        """Each row's best suffix draft (not yet counted as sent: see ``sent``); ``scopes`` None:
        every row in the shared scope."""
        used: set[int] = set()
        out = []
        for j, (ctx, k) in enumerate(zip(contexts, draft_lens)):
            ctx, scope = list(ctx), SHARED_SCOPE if scopes is None else scopes[j]
            sid = self._session(ctx, used, scope)
            d = self._draft(self.sessions[sid], ctx, k, scope)
            out.append(SuffixDraft(d.tokens, d.match, d.score, sid))
        return out

    def sent(self, session: int, context_len: int, tokens: list[int], source: str) -> None:
        """``tokens`` went to the target after ``context_len`` tokens of ``session``."""
        if tokens and session in self.sessions:
            self._sent[session] = (context_len, list(tokens), source)

    def release(self, prompt: Sequence[int], output: Sequence[int], scope: Scope = SHARED_SCOPE) -> None:
        """The sequence prompt + output left the loop: forget its index, cache its output in
        its scope (none for scope None)."""
        ctx = list(prompt) + list(output)
        sid = self._find(ctx, set(), scope)
        if sid is not None:
            self._settle(sid, ctx)
            del self.sessions[sid]
            del self._scope[sid]
        if self.cache is not None:
            self.cache.add(output, scope)

    def _settle(self, sid: int, ctx: list[int]) -> None:
        """Count the draft last sent for ``sid``: accepted = how many of its tokens came next."""
        sent = self._sent.pop(sid, None)
        if sent is None:
            return
        start, tokens, source = sent
        n = 0
        while n < len(tokens) and start + n < len(ctx) and ctx[start + n] == tokens[n]:
            n += 1
        self.sources.record(source, len(tokens), n)

    # -- per-request indexes ---------------------------------------------------------------

    def _find(self, ctx: list[int], used: set[int], scope: Scope) -> int | None:
        """The longest live index of ``scope`` whose tokens begin ``ctx`` (not yet used this step)."""
        best, best_len = None, -1
        for sid, idx in self.sessions.items():
            n = len(idx.tokens)
            if sid not in used and self._scope[sid] == scope and best_len < n <= len(ctx) and ctx[:n] == idx.tokens:
                best, best_len = sid, n
        return best

    def _session(self, ctx: list[int], used: set[int], scope: Scope) -> int:
        """The id of ctx's request index (a new one for a new request), grown to ctx."""
        sid = self._find(ctx, used, scope)
        if sid is None:
            sid, self._next = self._next, self._next + 1
            self.sessions[sid] = TokenIndex()
            self._scope[sid] = scope
            while len(self.sessions) > _MAX_SESSIONS:
                old, _ = self.sessions.popitem(last=False)
                self._sent.pop(old, None)
                self._scope.pop(old, None)
        else:
            self._settle(sid, ctx)
        idx = self.sessions[sid]
        self.sessions.move_to_end(sid)
        used.add(sid)
        idx.extend(ctx[len(idx.tokens) :])
        return sid

    # -- scoring ---------------------------------------------------------------------------

    def _draft(self, own: TokenIndex, ctx: list[int], k: int, scope: Scope) -> SuffixDraft:
        s = self.settings
        if k <= 0:
            return SuffixDraft([])
        # Each candidate: (match length, stream, end position); its continuation follows.
        cands = [(m, own.tokens, p) for m, p in own.candidates(ctx, s.max_depth, len(ctx) - 1)]
        if self.cache is not None:
            cands += self.cache.candidates(ctx, s.max_depth, scope)
        best = SuffixDraft([])
        # Each candidate's match length, and that length cut to leave k tokens under max_depth
        # (a match too long to draft after still drafts as a shorter one).
        cap = max(1, s.max_depth - k)
        for length in sorted({m for m, _, _ in cands} | {min(m, cap) for m, _, _ in cands}, reverse=True):
            # The longest matches may leave no room under max_depth; shorter ones still may.
            n_max = min(k, int(s.spec_factor * length), s.max_depth - length)
            pool = [(t, p) for m, t, p in cands if m >= length]
            tokens, score = _follow(pool, n_max, s.min_token_prob)
            if score > best.score:
                best = SuffixDraft(tokens, length, score)
        return best


def _follow(pool: list[tuple[list[int], int]], n_max: int, min_prob: float) -> tuple[list[int], float]:
    """Walk the continuations of ``pool`` (stream, end position): the majority next token
    while the path probability stays >= min_prob. Returns (tokens, sum of probabilities)."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    for step in range(1, n_max + 1):
        votes: dict[int, list[tuple[list[int], int]]] = {}
        for t, p in pool:
            q = p + step
            if q < len(t) and t[q] != _SEPARATOR:
                votes.setdefault(t[q], []).append((t, p))
        if not votes:
            break
        # The most frequent continuation; ties go to the latest occurrence (listed first).
        token, group = max(votes.items(), key=lambda kv: len(kv[1]))
        prob *= len(group) / len(pool)  # ends count against it, as a tree node's count does
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        pool = group
    return tokens, score
