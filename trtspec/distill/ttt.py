"""Training-time test (EAGLE-3): the head trained on its own unrolled drafting steps.

One sequence x_0..x_{T-1} with the target's features f_t and greedy labels y_t (the target's
next token after x_0..x_t). Step 0, position t: state fc(f_t), token x_{t+1}, label y_{t+1}
(the token two ahead), attending to step-0 keys at positions <= t. Step j >= 1 replays draft
step j of a context that ended at position t-j+1: the state is step j-1's output at t-1, the
token x_{t+1} (what the draft would have been had the previous drafts been right), and the
keys are step 0's at positions <= t-j plus step i's at position t-j+i for i = 1..j — exactly
what HeadEngine holds at inference (tested: the chain the drafter proposes equals the argmax
of these unrolled steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from trtspec.engines.torch.eagle3_head import Eagle3Head
from trtspec.engines.torch.model import _rotate_half


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64 (padding 0)
    features: torch.Tensor  # [B, T, n_layers * target_hidden]
    labels: torch.Tensor  # [B, T] int64: the target's greedy next token at each position; -1 = none
    response: torch.Tensor  # [B, T] bool: the token at this position is response text (drafted at runtime)
    top_ids: torch.Tensor | None = None  # [B, T, k] int64: the target's top-k next tokens (-1: padding)
    top_logits: torch.Tensor | None = None  # [B, T, k] float32: their logits


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch on ``device`` (the same object on its own device: no copy on CPU)."""
    if batch.tokens.device == device:
        return batch
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return Batch(*(move(getattr(batch, f)) for f in ("tokens", "features", "labels", "response", "top_ids", "top_logits")))


def chain_in_response(batch: Batch, j: int) -> torch.Tensor:
    """[B, T] bool: position t at step j belongs to a chain drafted inside a response.

    Step j at t replays a chain whose first fed token is x_{t-j+1}; the runtime drafts only
    after a response token (a chain after the prompt's last token starts at the first
    response token), so that token must be response text. Prompt and template positions are
    never drafted at runtime: training and scoring on them spends data on nothing."""
    r = batch.response
    n = 1 - j  # position t holds response[t + n]
    if n > 0:
        return torch.cat([r[:, n:], torch.zeros_like(r[:, :n])], dim=1)
    return _shift(r, -n, dim=1)


def step_weights(steps: int, decay: float) -> list[float]:
    """Loss weight of each unrolled step: decay^j, normalised (the recipe's step_decay; EAGLE-3
    uses 0.8^i): the first drafts decide most of the acceptance, a late step is used only after
    all earlier ones were accepted."""
    w = [decay**j for j in range(steps)]
    return [x / sum(w) for x in w]


def add_feature_noise(batch: Batch, amplitude: float, gen: torch.Generator) -> Batch:
    """The batch with uniform noise in [-amplitude, amplitude] added to its features (drawn
    from ``gen`` on the CPU: the same noise for the same seed and step on every device).
    EAGLE-1 trains on noisy features and speculators adds uniform noise of 0.05: at inference
    the head's later steps read its own, imperfect states, never the exact features."""
    if amplitude <= 0:
        return batch
    noise = (torch.rand(batch.features.shape, generator=gen) * 2 - 1) * amplitude
    features = (batch.features.float() + noise.to(batch.features.device)).to(batch.features.dtype)
    return Batch(batch.tokens, features, batch.labels, batch.response, batch.top_ids, batch.top_logits)


def dropout_mask(shape, p: float, gen: torch.Generator | None, like: torch.Tensor) -> torch.Tensor | None:
    """An inverted-dropout mask (kept entries 1/(1-p), dropped 0) drawn from ``gen`` on the CPU,
    as feature noise is: the same masks for the same seed and step on every device; None at p 0."""
    if p <= 0:
        return None
    keep = torch.rand(shape, generator=gen) >= p
    return (keep.to(like.dtype) / (1.0 - p)).to(like.device)


def _project(head: Eagle3Head, x: torch.Tensor, cos, sin):
    """q [B, heads, T, d] and k, v [B, heads, T, d] (kv heads repeated) with RoPE."""
    attn, cfg = head.midlayer.self_attn, head.cfg
    b, t, _ = x.shape
    q = attn.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    rep = cfg.num_heads // cfg.num_kv_heads
    return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """x moved n positions later along ``dim`` (position t holds x[t - n]; zeros before)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - n)], dim=dim)


def unrolled_logits(
    head: Eagle3Head,
    embed,
    batch: Batch,
    steps: int,
    cos_table,
    sin_table,
    dropout: float = 0.0,
    gen=None,
    at: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Draft logits of each unrolled step (0..steps-1): [B, T, draft_vocab] at every position;
    with ``at`` (a [B, T] bool mask per step) [N_j, draft_vocab] at step j's marked positions
    only, in row-major order (``unrolled_logits(...)[j][at[j]]``, up to float rounding).

    With ``at``, the LM head runs at the marked positions only and each deeper step runs only
    on the chains they belong to (step j at t continues the chain whose first fed token is
    x_{t-j+1}): in a training batch the scored positions, the responses' chains, are ~40% of
    the positions (prompts, templates and padding are the rest), and a deeper step needs
    nothing else. ``dropout``: the fused input and each step's attention output dropped at
    that rate (masks from ``gen``, drawn at the full [B, T] shape either way: the same masks)."""
    b, t = batch.tokens.shape
    dtype = head.norm.weight.dtype  # the head's own: a served head's Linears may be re-laid by the kernel choice
    nxt = torch.cat([batch.tokens[:, 1:], torch.zeros_like(batch.tokens[:, :1])], dim=1)  # x_{t+1}
    with torch.no_grad():  # the target's embeddings are frozen: no [vocab, hidden] gradient
        embeds = embed(nxt).to(dtype)  # [B, T, hidden]
    pos = torch.arange(t, device=batch.tokens.device)
    cos, sin = (table[pos].to(dtype).view(1, 1, t, -1) for table in (cos_table, sin_table))
    state = head.fuse(batch.features.to(dtype))  # [B, T, hidden]
    if (mask := dropout_mask(state.shape, dropout, gen, state)) is not None:
        state = state * mask
    q, k0, v0 = _project(head, head.midlayer.attention_input(state, embeds), cos, sin)  # [B, h, T, d]
    drop = lambda: dropout_mask(state.shape, dropout, gen, state)  # noqa: E731  [B, T, hidden] or None
    # Step 0 at t attends to step-0 keys at positions <= t.
    out = _finish(head, _attend(head, q, k0, v0, pos.view(t, 1) >= pos.view(1, t), [], []), state, drop())
    if at is not None:
        return [head.draft_logits(out[at[0]])] + _chain_steps(head, out, embeds, k0, v0, steps, cos_table, sin_table, at, drop)
    out_logits = [head.draft_logits(out)]
    keys, values = [k0], [v0]
    for j in range(1, steps):
        state = _shift(head.feed_back(out), 1, dim=1)  # step j at t continues from step j-1's output at t-1
        q, k, v = _project(head, head.midlayer.attention_input(state, embeds), cos, sin)
        keys.append(k)
        values.append(v)
        # Step-0 keys at positions s <= t - j (rows t < j keep key 0 so no row is empty), and
        # step i's key at position t - j + i for i = 1..j.
        allowed = pos.view(1, t) <= (pos.view(t, 1) - j).clamp(min=0)  # [T, S]
        own_k = [_shift(keys[i], j - i, dim=2) for i in range(1, j + 1)]
        own_v = [_shift(values[i], j - i, dim=2) for i in range(1, j + 1)]
        out = _finish(head, _attend(head, q, k0, v0, allowed, own_k, own_v), state, drop())
        out_logits.append(head.draft_logits(out))
    return out_logits


def _chain_steps(head, out0, embeds, k0, v0, steps: int, cos_table, sin_table, at, drop) -> list[torch.Tensor]:
    """unrolled_logits' steps 1..steps-1 on the chains ``at`` marks, in chain coordinates: row r
    of batch row b is the chain whose first fed token sits at position c = starts[b, r], and
    its step j runs at position c + j - 1 with the state of its own step j - 1 (no shift).
    ``drop()``: the next dropout mask at [B, T, hidden] (None: none), read at the step's positions."""
    b, t = embeds.shape[:2]
    device = embeds.device
    need = torch.zeros_like(at[0])
    for j in range(1, steps):  # chain starts c whose step j is marked at c + j - 1
        need |= _shift_left(at[j], j - 1)
    need[:, 0] = False  # a chain's context holds at least one position
    counts = need.sum(1)
    pos = torch.arange(t, device=device)
    # The most chains a row has, read as a nonzero's size rather than by .item(): the same
    # number, and a step that also runs where values cannot be read (the meta device)
    r = max(1, int((pos < counts.max()).nonzero().shape[0]))
    starts = torch.argsort(torch.where(need, pos, pos + t), dim=1, stable=True)[:, :r]  # each row's chains, ascending
    live = torch.arange(r, device=device).view(1, r) < counts.view(b, 1)
    starts = torch.where(live, starts, torch.ones_like(starts))  # padding chains: read, never selected
    rows = torch.arange(b, device=device).view(b, 1)
    state = head.feed_back(out0)[rows, starts - 1]  # step 1 of chain c continues from step 0 at c - 1
    allowed = pos.view(1, 1, 1, t) <= (starts - 1).view(b, 1, r, 1)  # step-0 keys at positions < c
    own_k: list[torch.Tensor] = []
    own_v: list[torch.Tensor] = []
    logits = []
    for j in range(1, steps):
        where = (starts + j - 1).clamp(max=t - 1)  # [B, R]: the position of step j
        cos, sin = (table[where].to(state.dtype).view(b, 1, r, -1) for table in (cos_table, sin_table))
        q, k, v = _project(head, head.midlayer.attention_input(state, embeds[rows, where]), cos, sin)
        own_k.append(k)
        own_v.append(v)
        mask = drop()
        out = _finish(head, _attend(head, q, k0, v0, allowed, own_k, own_v), state, None if mask is None else mask[rows, where])
        chosen = live & (starts + j - 1 < t) & at[j][rows, where]
        logits.append(head.draft_logits(out[chosen]))
        state = head.feed_back(out)
    return logits


def _attend(head: Eagle3Head, q, k0, v0, allowed, own_k: list, own_v: list) -> torch.Tensor:
    """One unrolled step's attention output [B, L, hidden] (o_proj applied): queries q [B, h, L, d]
    over the step-0 keys and values k0, v0 [B, h, T, d] where ``allowed`` ([.., L, T]), and over
    their own chain's earlier drafting steps, one key and value per query each (own_k[i],
    own_v[i]: [B, h, L, d])."""
    b, _, n, _ = q.shape
    t = k0.shape[2]
    scale = 1.0 / math.sqrt(head.cfg.head_dim)
    scores = [torch.matmul(q, k0.transpose(-1, -2)).masked_fill(~allowed, float("-inf")) * scale]
    scores += [(q * ki).sum(-1, keepdim=True) * scale for ki in own_k]  # [B, h, L, 1] each
    probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
    attn = torch.matmul(probs[..., :t], v0)
    for i, vi in enumerate(own_v):
        attn = attn + probs[..., t + i : t + i + 1] * vi
    return head.midlayer.self_attn.o_proj(attn.transpose(1, 2).reshape(b, n, -1))


def _finish(head: Eagle3Head, attn, state, mask) -> torch.Tensor:
    """The step's layer output from its attention output, dropped by ``mask`` (None: kept)."""
    return head.midlayer.finish(attn if mask is None else attn * mask, state)


def step_targets(batch: Batch, steps: int, response_only: bool = True) -> list[torch.Tensor]:
    """Target ids [B, T] each step is scored against (-1: not scored).

    Position t at step j predicts y_{t+1}; it needs x_{t+1} (t + 1 < T) and a context of at
    least one real position (t >= j); ``response_only``: and a chain drafted inside a response
    (chain_in_response).
    """
    b, t = batch.tokens.shape
    label = torch.cat([batch.labels[:, 1:], torch.full_like(batch.labels[:, :1], -1)], dim=1)
    pos = torch.arange(t, device=batch.tokens.device).view(1, t)
    out = []
    for j in range(steps):
        keep = pos >= j
        if response_only:
            keep = keep & chain_in_response(batch, j)
        out.append(torch.where(keep, label, torch.full_like(label, -1)))
    return out


def ttt_loss(
    head,
    embed,
    batch: Batch,
    steps: int,
    t2d: torch.Tensor,
    cos,
    sin,
    soft: bool = False,
    weights: list[float] | None = None,
    response_only: bool = True,
    reach: bool = False,
    loss: Literal["kl", "lk"] = "kl",
    dropout: float = 0.0,
    gen: torch.Generator | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cross-entropy per step, weighted by ``weights`` (default: equal), over the positions
    step_targets scores (``response_only``: chains inside responses only).

    Hard labels: against the target's greedy token (labels outside the draft vocabulary are not
    trained on). ``soft``: against the target's distribution at that position, its top-k
    logits restricted to the draft vocabulary and renormalised (SpecForge's EAGLE-3 recipe
    trains on the target's probabilities over the draft vocabulary too): every position also
    teaches how sure the target is and what its runner-up is, more signal per captured token.
    Positions are those the hard loss scores; the greedy token is the top-1 of the same logits.
    ``reach``: each step's loss is a mean over its positions weighted by reach_weights.
    ``loss``: with soft labels, "kl" is the cross-entropy above (KL up to the target's entropy),
    "lk" is -log of the acceptance rate (soft_lk_loss). With hard labels the two coincide: the
    target's distribution is its greedy token, the acceptance rate is the draft's probability of
    it, and -log of that is the hard cross-entropy. ``dropout``, ``gen``: unrolled_logits'.
    ``temperature`` (soft labels, "kl"): both distributions softened by T, the loss scaled by T^2
    (Hinton et al.'s distillation), so the gradient's size does not shrink with T.
    """
    if soft and batch.top_ids is None:
        raise ValueError("soft labels need the captured top-k logits (Batch.top_ids)")
    targets = step_targets(batch, steps, response_only)
    at = [tgt >= 0 for tgt in targets]  # the positions each step is scored at: its logits are made there only
    logits = unrolled_logits(head, embed, batch, steps, cos, sin, dropout, gen, at=at)  # [N_j, draft_vocab] each
    draft_tgts = [torch.where(tgt >= 0, t2d[tgt.clamp(min=0)], torch.full_like(tgt, -1)) for tgt in targets]
    target_dist = _soft_targets(batch, t2d, temperature) if soft else None
    reached = reach_weights(logits, draft_tgts, at) if reach else [None] * steps
    losses = [
        _step_loss(
            lg, tgt[m], draft_tgt[m], None if target_dist is None else tuple(x[m] for x in target_dist), w, loss, temperature
        )
        for lg, tgt, draft_tgt, m, w in zip(logits, targets, draft_tgts, at, reached)
    ]
    w = torch.tensor(weights if weights is not None else [1.0 / steps] * steps, device=losses[0].device)
    # A batch may hold no scored position for some step (all prompt): cross_entropy is nan there.
    return (torch.stack(losses).nan_to_num(0.0) * w).sum(), logits


def reach_weights(logits: list[torch.Tensor], draft_tgts: list[torch.Tensor], at: list[torch.Tensor]) -> list[torch.Tensor]:
    """[N_j] per unrolled step, at its scored positions ``at[j]`` (``logits[j]``: the head's
    there): the probability that a greedy chain reaches step j at t, as the head sees it: the
    product of its probabilities of the target's tokens at the chain's earlier steps (step i at
    t - j + i; 0 where that token is outside the draft vocabulary or not scored). No gradient
    flows through it. Step 0 weighs 1 everywhere. At runtime step j drafts only after drafts
    0..j-1 were accepted; weighting by it trains the later steps on the chains that get there
    (GRIFFIN masks the chains that do not)."""
    with torch.no_grad():
        right = []  # [B, T] per step
        for lg, d, m in zip(logits, draft_tgts, at):
            p = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
            p[m] = torch.softmax(lg.float(), dim=-1).gather(-1, d[m].clamp(min=0).unsqueeze(-1)).squeeze(-1) * (d[m] >= 0)
            right.append(p)
        out = []
        for j, m in enumerate(at):
            w = torch.ones_like(right[0])
            for i in range(j):
                w = w * _shift(right[i], j - i, dim=1)
            out.append(w[m])
    return out


def _soft_targets(batch: Batch, t2d: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary at each position's next token, its
    logits divided by ``temperature``: (draft ids [B, T, k] (-1: outside), their probabilities
    [B, T, k], whether any is inside [B, T])."""
    # Position t at step j predicts the target's next token at t + 1 (as step_targets).
    ids = _shift_left_3d(batch.top_ids, 1, fill=-1)  # [B, T, k]
    draft = torch.where(ids >= 0, t2d[ids.clamp(min=0)], torch.full_like(ids, -1))
    keep = draft >= 0
    lg_t = (_shift_left_3d(batch.top_logits, 1, fill=0.0) / temperature).masked_fill(~keep, float("-inf"))
    probs = torch.softmax(lg_t, dim=-1).nan_to_num(0.0)  # rows with no draft-vocab token: all 0
    return draft, probs, keep.any(-1)


def soft_lk_loss(lg: torch.Tensor, draft: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """-log alpha per position [B, T] (LK losses, Samarin et al. 2026, arXiv 2602.23881): alpha =
    sum_x min(p_x, q_x) is the probability that speculative sampling accepts a draft token drawn
    from the head's distribution q when the target's is p; minimising -log alpha trains the
    acceptance rate itself, where the KL is its proxy. Its gradient is the total-variation
    distance's scaled by 1/alpha, so it does not vanish while alpha is small.

    ``lg`` [B, T, draft_vocab] the head's logits; ``draft`` [B, T, k] the target's top-k ids in
    the draft vocabulary (-1: outside it); ``probs`` [B, T, k] p on them, renormalised over the
    ids inside (as the KL's). p is 0 everywhere else: the target's mass outside its captured
    top-k, and outside the draft vocabulary, counts for nothing (the draft can never get a
    token accepted there), and q's mass outside the support adds nothing to alpha. In log space
    (log alpha = logsumexp_x min(log p_x, log q_x)): exact where q is tiny. A position with no
    id inside the draft vocabulary gets 0 (the caller does not score it)."""
    inside = draft >= 0
    both = torch.minimum(torch.log(probs), _draft_logq(lg, draft)).masked_fill(~inside, float("-inf"))  # [B, T, k]
    both = both.masked_fill(~inside.any(-1, keepdim=True), 0.0)  # no -inf-only row: no nan gradient
    return -torch.logsumexp(both, dim=-1).masked_fill(~inside.any(-1), 0.0)


def _soft_kl_loss(lg: torch.Tensor, draft: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy to the target's top-k distribution per position [B, T] (ttt_loss's soft)."""
    return -(probs * _draft_logq(lg, draft).masked_fill(~(draft >= 0), 0.0)).sum(-1)


def _draft_logq(lg: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """The head's log-probabilities [B, T, k] of the target's top-k ids (-1 read as id 0: masked by the caller)."""
    return torch.log_softmax(lg.float(), dim=-1).gather(-1, draft.clamp(min=0))


def _step_loss(lg, tgt, draft_tgt, target_dist, reached, loss: str = "kl", temperature: float = 1.0) -> torch.Tensor:
    """One unrolled step's loss: the mean over its scored positions, weighted by ``reached``
    when given; soft "kl" at ``temperature``: the head's logits over T, the loss x T^2. Every
    argument holds the step's positions only: ``lg`` [N, draft_vocab], the rest [N] (the
    soft distribution's [N, k])."""
    if target_dist is None:
        if reached is None:
            return F.cross_entropy(lg.float(), draft_tgt, ignore_index=-1)
        per_pos = F.cross_entropy(lg.float(), draft_tgt, ignore_index=-1, reduction="none")
        scored = draft_tgt >= 0
    else:
        draft, probs, has = target_dist
        if loss == "lk":
            per_pos = soft_lk_loss(lg, draft, probs)  # [B, T]
        else:
            if temperature == 1.0:  # the default: no extra [B, T, draft_vocab] copy a step
                per_pos = _soft_kl_loss(lg, draft, probs)
            else:
                per_pos = _soft_kl_loss(lg / temperature, draft, probs) * temperature**2
        scored = (tgt >= 0) & has
        if reached is None:
            return per_pos[scored].sum() / scored.sum().clamp(min=1)
    return (per_pos * reached)[scored].sum() / reached[scored].sum().clamp(min=1e-8)


def _shift_left_3d(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """Position p of [B, T, k] holds x[:, p + n] (``fill`` past the end)."""
    return torch.cat([x[:, n:], torch.full_like(x[:, :n], fill)], dim=1)


TOP_R = 3  # ranks the recall per depth is reported at (top-1/2/3: what a tree's width needs)


@torch.no_grad()
def agreement(head, embed, batches: Iterable[Batch], steps: int, cos, sin) -> dict:
    """Held-out agreement with the target over chains drafted inside responses, summed over
    batches (one batch at a time: memory stays that of one batch, whatever the held-out size).

    top1[j]: fraction of step-j drafts equal to the target's token. acceptance_length: tokens
    per target forward a k=steps chain would get, 1 + mean run of consecutive right drafts,
    from every chain start in a response where the whole chain can be scored. accepted[j]: the
    per-position acceptance, P(draft j right | drafts 0..j-1 right), over the same chains —
    what the Leviathan bound of each k is computed from (distill recommends k with it).

    For trees (a node keeps its r most likely drafts), over the same chains:
    top_r[j][r-1]: P(the target's token at depth j is among the head's r most likely), the
    head fed the target's tokens before it (the tree's node on the right path);
    top_r_accepted[j][r-1]: the same given that the target's tokens at depths 0..j-1 were
    among the top r too (a tree r wide at every depth); its r=1 column is ``accepted``.

    What the runtime sees, for k = 1..steps (walk_*[k-1]): greedy generation drafts only where
    its last step ended, so it walks each response once: from the first response token, k
    drafts (fewer near the end: never past the response), the right ones and the target's
    token kept, the next chain from there. Right drafts come in runs (an easy stretch of text),
    and after a right one the runtime skips the chains that start inside the run, so fewer of
    its drafts are right than of all chains. walk_length[k-1]: tokens per drafting forward
    (1 + drafts kept), what the bound of k is computed from; walk_accepted[k-1][j]: P(draft j
    kept | drafts before it kept) along the walk; walk_forwards[k-1]: its drafting forwards.
    """
    counts = _Agreement(steps, min(TOP_R, head.cfg.draft_vocab_size))
    for batch in batches:
        targets = step_targets(batch, steps)
        at = [tgt >= 0 for tgt in targets]
        right, in_top = counts.score_steps(head, unrolled_logits(head, embed, batch, steps, cos, sin, at=at), targets, at)
        counts.count_chains(batch, targets, right, in_top)
        counts.count_walks(batch, right)
    return counts.result()


class _Agreement:
    """agreement's counts, summed over batches."""

    def __init__(self, steps: int, ranks: int):
        self.steps, self.ranks = steps, ranks
        self.right_n, self.scored_n = [0] * steps, [0] * steps
        self.alive_n = [0] * (steps + 1)  # chains whose first j drafts are all right
        self.hit_n = [[0] * ranks for _ in range(steps)]  # chain starts whose depth-j token is in the top r
        self.alive_r_n = [[0] * ranks for _ in range(steps + 1)]  # chains whose depths < j are all in the top r
        self.run_sum, self.chains = 0.0, 0
        self.walk_forwards, self.walk_tokens = [0] * steps, [0] * steps  # per k: drafting forwards, tokens they gave
        self.walk_reached = [[0] * steps for _ in range(steps)]  # per k, per draft j: forwards whose draft j was checked
        self.walk_right = [[0] * steps for _ in range(steps)]  # ... and kept

    def score_steps(self, head, logits, targets, at) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per unrolled step (``logits[j]``: the head's at its scored positions ``at[j]``): where
        its draft is right ([B, T]) and where the target's token is within its top r
        ([B, T, ranks]), counting step j's right drafts."""
        right, in_top = [], []
        for lg, tgt, m in zip(logits, targets, at):
            want = tgt[m]  # [N]
            top = head.to_target_ids(torch.topk(lg.float(), self.ranks, dim=-1).indices)  # [N, ranks]
            ok = torch.zeros_like(m)
            ok[m] = top[:, 0] == want
            self.right_n[len(right)] += int(ok.sum())
            self.scored_n[len(right)] += int(m.sum())
            right.append(ok)
            hits = torch.zeros((*m.shape, self.ranks), dtype=torch.bool, device=m.device)
            hits[m] = (top == want.unsqueeze(-1)).cumsum(-1) > 0  # within the top r
            in_top.append(hits)
        return right, in_top

    def count_chains(self, batch: Batch, targets, right, in_top) -> None:
        """Every chain start in a response where the whole chain can be scored: how far its
        drafts stay right, and stay within the top r."""
        steps, ranks = self.steps, self.ranks
        b, t = batch.tokens.shape
        # A chain drafted from a context ending at position p + 1 uses step j at position p + j.
        full = torch.ones(b, t, dtype=torch.bool, device=batch.tokens.device)
        for j in range(steps):
            full &= _shift_left(targets[j] >= 0, j)
        starts = full & chain_in_response(batch, 0)
        alive = starts.clone()
        self.alive_n[0] += int(alive.sum())
        alive_r = starts.unsqueeze(-1).expand(b, t, ranks).clone()
        for r in range(ranks):
            self.alive_r_n[0][r] += int(starts.sum())
        runs = torch.zeros(b, t, device=batch.tokens.device)
        for j in range(steps):
            alive &= _shift_left(right[j], j)  # [B, T]: steps 0..j of the chain starting at p are right
            self.alive_n[j + 1] += int(alive.sum())
            runs += alive.float()
            hit = _shift_left_3d(in_top[j], j, fill=False)  # [B, T, ranks]
            alive_r &= hit
            for r in range(ranks):
                self.hit_n[j][r] += int((hit[..., r] & starts).sum())
                self.alive_r_n[j + 1][r] += int(alive_r[..., r].sum())
        self.run_sum += float(runs[starts].sum())
        self.chains += int(starts.sum())

    def count_walks(self, batch: Batch, right) -> None:
        """Each response walked as greedy generation drafts it, once per k (agreement's walk_*)."""
        rows = [r.tolist() for r in right]  # per step j: [B][T] bool
        labels = batch.labels.tolist()
        for b, resp in enumerate(batch.response.tolist()):
            where = [t for t, r in enumerate(resp) if r]
            if not where:
                continue
            # The first response token and the response's length: its last token is the label of
            # the last position (the target never ran over it) where that label is known.
            first, n = where[0], where[-1] - where[0] + 1 + (labels[b][where[-1]] >= 0)
            for k in range(1, self.steps + 1):
                out = 1  # the first response token comes from the prefill, undrafted
                while (kk := min(k, n - out - 1)) > 0:  # never a draft past the response's end
                    p = first + out - 2  # the chain from a context ending at token p + 1 (ttt.py)
                    kept = 0
                    while kept < kk and rows[kept][b][p + kept]:
                        kept += 1
                    self.walk_forwards[k - 1] += 1
                    self.walk_tokens[k - 1] += kept + 1
                    for j in range(min(kept + 1, kk)):
                        self.walk_reached[k - 1][j] += 1
                        self.walk_right[k - 1][j] += j < kept
                    out += kept + 1

    def result(self) -> dict:
        steps, ranks, chains = self.steps, self.ranks, self.chains
        ratio = lambda a, n: a / n if n else 0.0  # noqa: E731
        return {
            "top1": [ratio(r, n) for r, n in zip(self.right_n, self.scored_n)],
            "acceptance_length": 1.0 + self.run_sum / chains if chains else 1.0,
            "accepted": [ratio(self.alive_n[j + 1], self.alive_n[j]) for j in range(steps)],
            "top_r": [[ratio(self.hit_n[j][r], chains) for r in range(ranks)] for j in range(steps)],
            "top_r_accepted": [
                [ratio(self.alive_r_n[j + 1][r], self.alive_r_n[j][r]) for r in range(ranks)] for j in range(steps)
            ],
            "chains": chains,
            "walk_length": [ratio(self.walk_tokens[k], self.walk_forwards[k]) or 1.0 for k in range(steps)],
            "walk_accepted": [
                [ratio(self.walk_right[k][j], self.walk_reached[k][j]) for j in range(k + 1)] for k in range(steps)
            ],
            "walk_forwards": list(self.walk_forwards),
        }


def _shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """Position p holds x[p + n] (False past the end)."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)
