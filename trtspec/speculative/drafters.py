"""Drafters: who proposes the tokens the target verifies.

ModelDrafter runs a draft engine greedily; NgramDrafter (prompt lookup) copies the
continuation of an earlier occurrence of the context's suffix; suffix decoding
(speculative/suffix.py) drafts from the request's own text and earlier responses;
LayeredDrafter sends the suffix draft where its match is long and the model's elsewhere.
All only propose. make_drafter is the one place a spec's method becomes a drafter, for every runtime;
engine_drafter is the draft model's drafter over engines in memory (in process and in the
LLM API's conformance double).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trtspec.engines.torch.engine import ForwardItem, RunFn, TorchEngine
from trtspec.errors import EngineError
from trtspec.spec import DraftKv, SuffixSpec
from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.loop import SHARED_SCOPE
from trtspec.speculative.metrics import SourceCounts
from trtspec.speculative.processing import RowRules, warp_params
from trtspec.speculative.suffix import MODEL, SUFFIX, ResponseCache, Scope, SuffixDrafter
from trtspec.speculative.tree import DraftTree, TreeGrowth, TreeShape, top_candidates


class ModelDrafter(Drafter):
    """Greedy draft model: k single-token steps, batched across sequences.

    The engine's prefix cache makes each step compute only the newest token; tokens the
    target rejected are forgotten on the next call (the cache keeps the common prefix).
    """

    # the requests' penalties, bans and bias shape the drafts too; sampled drafts; trees
    capabilities = Capabilities(mirrors_processing=True, samples=True, trees=True)

    def __init__(self, run: RunFn, vocab_limit: int | None = None, adopt: Callable[[list[ForwardItem]], object] | None = None):
        self.run = run
        # Draft rows beyond the target's vocabulary (embedding padding) are never proposed.
        self.vocab_limit = vocab_limit
        # Called before each greedy draft call (kv_adopter): the draft takes the target's K/V
        # where it lacks much of a context. Sampled drafts compute their own, so a seed draws the
        # same tokens whichever engine computed the prompt first.
        self.adopt = adopt

    def _run(self, items: list[ForwardItem], adopting: bool) -> list[torch.Tensor]:
        if adopting and self.adopt is not None:
            self.adopt(items)
        return self.run(items)

    def _next_logits(self, row: torch.Tensor, rules: RowRules | None, tokens: list[int], drafted: int) -> torch.Tensor:
        """The draft's logits [1, vocab_limit] for the next token, processed as the target's."""
        logits = row[-1:, : self.vocab_limit]
        return logits if rules is None else rules.apply(logits, tokens, drafted)

    def propose(
        self, contexts: Sequence[list[int]], draft_lens: Sequence[int], rules: Sequence[RowRules | None] | None = None
    ) -> list[list[int]]:
        return self._draft(contexts, draft_lens, rules, lambda i, x: int(torch.argmax(x[0])), adopting=True)

    def propose_sampled(self, contexts, draft_lens, params, gens, rules=None) -> list[tuple[list[int], torch.Tensor]]:
        """Drafts drawn from the draft's warped distribution, with those distributions
        ([k, vocab_limit] per sequence) for the rejection step."""
        from trtspec.speculative.sampling import draw, warp

        dists: list[list[torch.Tensor]] = [[] for _ in contexts]

        def pick(i: int, x: torch.Tensor) -> int:
            q = warp(x, warp_params(params[i], rules[i].processing if rules and rules[i] else None))[0]  # [vocab_limit]
            dists[i].append(q)
            return draw(q, gens[i])

        drafts = self._draft(contexts, draft_lens, rules, pick, adopting=False)
        return [(d, torch.stack(q) if q else torch.zeros(0)) for d, q in zip(drafts, dists)]

    def propose_tree(self, contexts: Sequence[list[int]], shapes: Sequence[TreeShape]) -> list[DraftTree]:
        """Draft trees, one draft forward per depth for all sequences: each round scores the
        nodes expanded so far and the frontier under the tree mask (ForwardItem.tree) and
        takes the frontier's top candidates."""
        growths = [TreeGrowth(s) for s in shapes]
        while live := [i for i, g in enumerate(growths) if not g.done]:
            items = []
            for i in live:
                ctx = list(contexts[i])
                tokens, parents, frontier = growths[i].scored()
                if not tokens:  # the first round: the context's last token
                    items.append(ForwardItem(ctx, 1))
                else:
                    items.append(ForwardItem(ctx + tokens, len(frontier), tuple(parents)))
            for i, logits in zip(live, self._run(items, adopting=True)):  # each [len(frontier), vocab]
                growths[i].grow(top_candidates(logits[:, : self.vocab_limit], growths[i].width))
        return [g.tree() for g in growths]

    def _draft(self, contexts, draft_lens, rules, pick: Callable[[int, torch.Tensor], int], adopting: bool) -> list[list[int]]:
        """k single-token steps; ``pick(i, logits [1, vocab_limit])`` chooses row i's next token."""
        drafts: list[list[int]] = [[] for _ in contexts]
        rules = rules or [None] * len(contexts)
        for step in range(max(draft_lens, default=0)):
            live = [i for i, k in enumerate(draft_lens) if k > step]
            logits = self._run([ForwardItem(list(contexts[i]) + drafts[i], 1) for i in live], adopting)
            for i, row in zip(live, logits):
                drafts[i].append(pick(i, self._next_logits(row, rules[i], list(contexts[i]) + drafts[i], step)))
        return drafts


class NgramDrafter(Drafter):
    """Prompt lookup: find the longest suffix n-gram (max_ngram down to min_ngram) that
    occurred earlier in the context and propose what followed its latest occurrence."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, contexts: Sequence[list[int]], draft_lens: Sequence[int]) -> list[list[int]]:
        return [self._lookup(list(ctx), k) for ctx, k in zip(contexts, draft_lens)]

    def _lookup(self, ctx: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            # Latest earlier start j < len(ctx) - n whose n-gram equals the suffix.
            for j in range(len(ctx) - n - 1, -1, -1):
                if ctx[j : j + n] == suffix:
                    return ctx[j + n : j + n + k]
        return []


class LayeredDrafter(Drafter):
    """Suffix drafting layered on a model draft (TensorRT-LLM's ``sa_config``): a row whose
    suffix match is at least ``suffix.settings.threshold`` tokens long gets the suffix draft;
    the others get the model's, asked for those rows only. Drafted and accepted tokens are
    counted per source in ``suffix.sources``. The requests' scopes go to the suffix drafter,
    their logits processing to a model that mirrors it."""

    capabilities = Capabilities(mirrors_processing=True, scoped=True, releases=True, samples=True)

    def __init__(self, suffix: SuffixDrafter, model: Drafter):
        self.suffix = suffix
        self.model = model

    @property
    def sources(self):
        return self.suffix.sources

    def release(self, prompt: Sequence[int], output: Sequence[int], scope: Scope = SHARED_SCOPE) -> None:
        self.suffix.release(prompt, output, scope)

    def _split(self, contexts, draft_lens, scopes):
        """The suffix drafts, and the rows that go to the model instead."""
        drafts = self.suffix.drafts(contexts, draft_lens, scopes)
        threshold = self.suffix.settings.threshold
        to_model = [j for j, d in enumerate(drafts) if not d.tokens or d.match < threshold]
        return drafts, to_model

    def _rules(self, rules: Sequence[RowRules | None] | None, to_model: list[int]) -> dict:
        """The keywords that take the model's rows' logits processing to a model that mirrors it."""
        if rules is None or not self.model.capabilities.mirrors_processing:
            return {}
        return {"rules": [rules[j] for j in to_model]}

    def _sent(self, contexts, drafts, out, to_model) -> None:
        for j, (ctx, d) in enumerate(zip(contexts, drafts)):
            self.suffix.sent(d.session, len(ctx), out[j], MODEL if j in to_model else SUFFIX)

    def propose(self, contexts, draft_lens, rules: Sequence[RowRules | None] | None = None, scopes=None) -> list[list[int]]:
        drafts, to_model = self._split(contexts, draft_lens, scopes)
        out = [d.tokens for d in drafts]
        if to_model:
            sub = ([contexts[j] for j in to_model], [draft_lens[j] for j in to_model])
            for j, d in zip(to_model, self.model.propose(*sub, **self._rules(rules, to_model))):
                out[j] = list(d)
        self._sent(contexts, drafts, out, to_model)
        return out

    def propose_sampled(
        self, contexts, draft_lens, params, gens, rules=None, scopes=None
    ) -> list[tuple[list[int], torch.Tensor]]:
        """Model rows sampled from the model's distributions; suffix rows are point masses
        (one-hot q), as a deterministic drafter's are (speculative/sampling.py)."""
        drafts, to_model = self._split(contexts, draft_lens, scopes)
        out = [(d.tokens, _point_masses(d.tokens)) for d in drafts]
        if to_model:
            sub_ctx, sub_lens = [contexts[j] for j in to_model], [draft_lens[j] for j in to_model]
            kw = self._rules(rules, to_model)
            if self.model.capabilities.samples:
                sampled = self.model.propose_sampled(
                    sub_ctx, sub_lens, [params[j] for j in to_model], [gens[j] for j in to_model], **kw
                )
            else:
                sampled = [(d, _point_masses(d)) for d in self.model.propose(sub_ctx, sub_lens, **kw)]
            for j, (d, q) in zip(to_model, sampled):
                out[j] = (list(d), q)
        self._sent(contexts, drafts, [d for d, _ in out], to_model)
        return out


def _point_masses(tokens: list[int]) -> torch.Tensor:
    """q for a deterministic draft: one-hot rows [len(tokens), max(tokens) + 1] (the
    sampler pads q to the target's vocabulary)."""
    q = torch.zeros(len(tokens), max(tokens, default=0) + 1)
    if tokens:
        q[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return q


def kv_adopter(draft: TorchEngine, target: TorchEngine) -> Callable[[list[ForwardItem]], object]:
    """Before a draft call: the draft adopts the target's K/V (TorchEngine.adopt) for each
    sequence whose context the target holds more than max_draft_len + 1 tokens more of: a
    prompt the target prefilled, or found in its prefix cache. The gap a draft and verify leave
    (at most max_draft_len + 1 tokens) the draft computes itself, over its own K/V."""
    gap = draft.pool.rollback
    return lambda items: draft.adopt(target, [it.tokens[: len(it.tokens) - len(it.tree or ())] for it in items], gap)


def engine_drafter(target: TorchEngine, draft: TorchEngine | None = None, head=None, draft_kv: DraftKv = "own") -> Drafter | None:
    """The draft engine's greedy drafter (never past the target's vocabulary), or EAGLE-3's
    ``head`` (engines.torch.eagle3_head.HeadEngine) reading the target's captured features; None
    without either (method ngram). ``draft_kv`` "target": a draft whose K/V cache has the
    target's shape (a self-draft) takes the target's K/V for the context of its greedy drafts
    (kv_adopter); "own", or any other draft: it computes its own."""
    if draft is not None:
        adopt = kv_adopter(draft, target) if draft_kv == "target" and draft.kv_mismatch(target) is None else None
        return ModelDrafter(draft.run, min(draft.vocab_size, target.vocab_size), adopt)
    if head is not None:
        from trtspec.speculative.eagle3_drafter import Eagle3Drafter, engine_features

        return Eagle3Drafter(head, engine_features(target))
    return None


def make_drafter(
    method: str,
    *,
    max_ngram: int = 3,
    min_ngram: int = 1,
    draft_model: Drafter | None = None,
    suffix: SuffixSpec | None = None,
    cache: ResponseCache | None = None,
    sources: SourceCounts | None = None,
) -> Drafter:
    """The drafter a speculative method uses. ``draft_model`` proposes from the draft engine
    over the runtime's own transport (ModelDrafter in process, BlsDrafter inside Triton); for
    eagle3 it is the head's drafter (speculative.eagle3_drafter.Eagle3Drafter). ``suffix``: method
    suffix's settings, or for draft_target / eagle3 the suffix drafting layered on the model
    draft; ``cache``: the deployment's earlier responses (None: requests kept apart);
    ``sources``: where suffix drafting counts tokens per source (None: the drafter's own)."""
    if method == "ngram":
        return NgramDrafter(max_ngram, min_ngram)
    if method == "suffix":
        return SuffixDrafter(suffix or SuffixSpec(), cache, sources)
    if method in ("draft_target", "eagle3"):
        if draft_model is None:
            raise EngineError(f"method {method} needs a draft engine; build the spec's draft")
        if suffix is not None:
            return LayeredDrafter(SuffixDrafter(suffix, cache, sources), draft_model)
        return draft_model
    raise EngineError(f"no drafter for speculative method {method!r}")


def response_cache(suffix: SuffixSpec | None) -> ResponseCache | None:
    """A deployment's cache of earlier responses for its suffix drafting (None: no suffix
    drafting, or requests kept apart)."""
    if suffix is None or suffix.cache_responses <= 0:
        return None
    return ResponseCache(suffix.cache_responses, suffix.cache_tokens, suffix.tenants)
