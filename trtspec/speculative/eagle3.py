"""EAGLE-3 drafter: a one-layer head that drafts from the target's own hidden states.

For a context x_0..x_{L-1} the target has scored positions 0..L-2 (the last token is the one
it just emitted), and kept the features of the layers the head reads. Head position t takes
(features of target position t, embedding of x_{t+1}) and predicts x_{t+2}; so after catching
up on positions it has not seen, its output at L-2 gives the first draft. Each further draft
feeds the head's own output back in place of the target's features, one position at a time:
a chain of k tokens. The head's KV cache is rewound by an integer: positions past L-2 held
draft states and are recomputed from the target's features on the next call.

The drafter only proposes; the one loop verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from trtspec.engines.torch.eagle3 import HeadEngine, HeadRow

# [(tokens, start, stop)] -> per entry the target features [stop - start, n_layers * hidden] of
# those positions, or None when the target has not scored that prefix. One call per step: in
# process it reads TorchEngine.features_of; inside Triton it is one request to the target model.
FeaturesFn = Callable[[list[tuple[list[int], int, int]]], "list[torch.Tensor | None]"]


def engine_features(engine) -> FeaturesFn:
    """The FeaturesFn of a TorchEngine in this process."""
    return lambda wants: [engine.features_of(tokens, a, b) for tokens, a, b in wants]


class Eagle3Drafter:
    def __init__(self, head: HeadEngine, features: FeaturesFn):
        self.head = head
        self.features = features
        self.missing_features = 0  # proposals skipped: the target had not scored the context yet

    def propose(self, contexts: Sequence[list[int]], ks: Sequence[int]) -> list[list[int]]:
        with self.head.lock, torch.inference_mode():
            return self._propose(contexts, ks)

    def _propose(self, contexts: Sequence[list[int]], ks: Sequence[int]) -> list[list[int]]:
        head = self.head
        drafts: list[list[int]] = [[] for _ in contexts]
        live: list[tuple[int, int]] = []  # (context index, head slot)
        rows: list[HeadRow] = []
        wants: list[tuple[int, int, int]] = []  # (context index, slot, start)
        for i, (ctx, (slot, reuse)) in enumerate(zip(contexts, head.pool.assign([list(c) for c in contexts]))):
            if ks[i] > 0 and len(ctx) >= 2:
                # The slot's positions 0..reuse-2 saw this context's tokens and target features;
                # recompute from there (at least position n-2, whose output drafts).
                wants.append((i, slot, min(max(reuse - 1, 0), len(ctx) - 2)))
        if not wants:
            return drafts
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
            return drafts
        outs = head.extend(rows)
        last = torch.stack([o[-1] for o in outs])  # [b, hidden]: outputs at position n-2
        for (i, slot), tok in zip(live, head.next_ids(last)):
            drafts[i].append(tok)
            # Valid from now on: positions 0..n-2 (draft positions beyond are rewritten later).
            head.pool.commit(slot, list(contexts[i]))
        for step in range(1, max(ks[i] for i, _ in live)):
            chain = [j for j, (i, _) in enumerate(live) if ks[i] > step]
            rows = [
                HeadRow(live[j][1], len(contexts[live[j][0]]) - 2 + step, last[j : j + 1], [drafts[live[j][0]][-1]])
                for j in chain
            ]
            outs = head.extend(rows)
            for j, o in zip(chain, outs):
                last[j] = o[-1]
            ids = head.next_ids(torch.stack([last[j] for j in chain]))
            for j, tok in zip(chain, ids):
                drafts[live[j][0]].append(tok)
        return drafts
