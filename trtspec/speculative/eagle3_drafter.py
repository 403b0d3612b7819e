"""EAGLE-3 drafter: a one-layer head that drafts from the target's own hidden states.

For a context x_0..x_{L-1} the target has scored positions 0..L-2 (the last token is the one
it just emitted), and kept the features of the layers the head reads. Head position t takes
(features of target position t, embedding of x_{t+1}) and predicts x_{t+2}; so after catching
up on positions it has not seen, its output at L-2 gives the first draft. Each further draft
feeds the head's own output back (Eagle3Head.feed_back) in place of the target's features, one position at a time:
a chain of k tokens. The head's KV cache is rewound by an integer: positions past L-2 held
draft states and are recomputed from the target's features on the next call.

A draft tree (speculative/tree.py) grows the same way one depth at a time: each node the
tree expands runs through the head once, at the position of its depth, with its parent's
output as its state and attending to the context and its own ancestors only (its cache row
is the next free one after L-2; HeadRow.visible); its top candidates become its children. On
the next call the head recomputes from L-1 with the target's features of the accepted path
(the target engine keeps that path's features; the other branches' are gone), so the head's
states follow the accepted path.

The drafter only proposes; the one loop verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trtspec.engines.torch.eagle3_head import HeadEngine, HeadRow
from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.tree import ROOT, DraftTree, TreeGrowth, TreeShape, top_candidates

# [(tokens, start, stop)] -> per entry the target features [stop - start, n_layers * hidden] of
# those positions, or None when the target has not scored that prefix. One call per step: in
# process it reads TorchEngine.features_of; inside Triton it is one request to the target model.
FeaturesFn = Callable[[list[tuple[list[int], int, int]]], "list[torch.Tensor | None]"]


def engine_features(engine) -> FeaturesFn:
    """The FeaturesFn of a TorchEngine in this process."""
    return lambda wants: [engine.features_of(tokens, a, b) for tokens, a, b in wants]


class Eagle3Drafter(Drafter):
    capabilities = Capabilities(trees=True)

    def __init__(self, head: HeadEngine, features: FeaturesFn):
        self.head = head
        self.features = features
        self.missing_features = 0  # proposals skipped: the target had not scored the context yet

    def propose(self, contexts: Sequence[list[int]], draft_lens: Sequence[int]) -> list[list[int]]:
        with self.head.lock, torch.inference_mode():
            return self._propose(contexts, draft_lens)

    def propose_tree(self, contexts: Sequence[list[int]], shapes: Sequence[TreeShape]) -> list[DraftTree]:
        with self.head.lock, torch.inference_mode():
            return self._propose_tree(contexts, shapes)

    def _propose_tree(self, contexts: Sequence[list[int]], shapes: Sequence[TreeShape]) -> list[DraftTree]:
        head = self.head
        growths = [TreeGrowth(s) for s in shapes]
        live, last = self._catch_up(contexts, [1] * len(contexts))
        ids = head.head.to_target_ids(torch.arange(head.cfg.draft_vocab_size, device=head.device)).cpu()
        outs: dict[tuple[int, int], torch.Tensor] = {}  # (context index, node) -> head output [hidden]
        rows_of: dict[tuple[int, int], int] = {}  # (context index, node) -> its cache row
        if live:
            roots = top_candidates(head.head.draft_logits(last).float().cpu(), max(growths[i].width for i, _ in live), ids)
            for j, (i, _) in enumerate(live):
                outs[(i, ROOT)] = last[j]
                growths[i].grow([roots[j][: growths[i].width]])
        while grow := [(i, slot) for i, slot in live if not growths[i].done]:
            rows = []
            for i, slot in grow:
                g, base = growths[i], len(contexts[i]) - 1  # cache rows 0..L-2 hold the context
                start = base + len(g.expanded)
                visible = torch.zeros((len(g.frontier), start + len(g.frontier)), dtype=torch.bool)
                visible[:, :base] = True
                for r, node in enumerate(g.frontier):
                    rows_of[(i, node)] = start + r
                    a = node
                    while a != ROOT:
                        visible[r, rows_of[(i, a)]] = True
                        a = g.parents[a]
                state = head.head.feed_back(torch.stack([outs[(i, g.parents[n])] for n in g.frontier]))
                depths = [len(g.keys[n]) for n in g.frontier]
                rows.append(
                    HeadRow(slot, start, state, [g.tokens[n] for n in g.frontier], [base - 1 + d for d in depths], visible)
                )
            for (i, _), out in zip(grow, head.extend(rows)):  # each [len(frontier), hidden]
                g = growths[i]
                for r, node in enumerate(g.frontier):
                    outs[(i, node)] = out[r]
                g.grow(top_candidates(head.head.draft_logits(out).float().cpu(), g.width, ids))
        drafted = {i for i, _ in live}  # the others' targets have not scored their context yet
        return [g.tree() if i in drafted else DraftTree((), (), ()) for i, g in enumerate(growths)]

    def _catch_up(self, contexts: Sequence[list[int]], draft_lens: Sequence[int]) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """Run the head over the positions of each context it has not seen (from the target's
        features): the rows that can draft, (context index, head slot), and their outputs at
        position L-2 [rows, hidden], from which the first draft follows."""
        head = self.head
        live: list[tuple[int, int]] = []  # (context index, head slot)
        rows: list[HeadRow] = []
        wants: list[tuple[int, int, int]] = []  # (context index, slot, start)
        for i, (ctx, (slot, reuse)) in enumerate(zip(contexts, head.pool.assign([list(c) for c in contexts]))):
            if draft_lens[i] > 0 and len(ctx) >= 2:
                # The slot's positions 0..reuse-2 saw this context's tokens and target features;
                # recompute from there (at least position n-2, whose output drafts).
                wants.append((i, slot, min(max(reuse - 1, 0), len(ctx) - 2)))
        if not wants:
            return live, torch.zeros(0)
        got = self.features([(list(contexts[i]), start, len(contexts[i]) - 1) for i, _, start in wants])
        for (i, slot, start), feats in zip(wants, got):  # feats [n-1-start, n_layers * hidden]
            if feats is None:  # first step of a request: the target has not run yet
                self.missing_features += 1
                continue
            ctx = contexts[i]
            head.pool.truncate(slot, start + 1)
            rows.append(HeadRow(slot, start, head.fuse(feats), list(ctx[start + 1 :])))
            live.append((i, slot))
        if not rows:
            return live, torch.zeros(0)
        outs = head.extend(rows)
        for i, slot in live:  # valid from now on: positions 0..n-2 (draft positions beyond are rewritten later)
            head.pool.commit(slot, list(contexts[i]))
        return live, torch.stack([o[-1] for o in outs])  # [b, hidden]: outputs at position n-2

    def _propose(self, contexts: Sequence[list[int]], draft_lens: Sequence[int]) -> list[list[int]]:
        head = self.head
        drafts: list[list[int]] = [[] for _ in contexts]
        live, last = self._catch_up(contexts, draft_lens)
        if not live:
            return drafts
        for (i, _), tok in zip(live, head.next_ids(last)):
            drafts[i].append(tok)
        for step in range(1, max(draft_lens[i] for i, _ in live)):
            chain = [j for j, (i, _) in enumerate(live) if draft_lens[i] > step]
            rows = [
                HeadRow(
                    live[j][1],
                    len(contexts[live[j][0]]) - 2 + step,
                    head.head.feed_back(last[j : j + 1]),
                    [drafts[live[j][0]][-1]],
                )
                for j in chain
            ]
            outs = head.extend(rows)
            for j, o in zip(chain, outs):
                last[j] = o[-1]
            ids = head.next_ids(torch.stack([last[j] for j in chain]))
            for j, tok in zip(chain, ids):
                drafts[live[j][0]].append(tok)
        return drafts
