"""The drafters adaptive speculation chooses among (loop.Menu), built from the spec's
speculative settings for every runtime: the in-process Deployment and the Triton orchestrator
each keep one AdaptivePolicy (its measured costs span batches) and build a Menu per batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trtspec.spec import FREE_METHODS, MODEL_METHODS, SuffixSpec
from trtspec.speculative.adaptive import AdaptivePolicy, AdaptiveSettings
from trtspec.speculative.capabilities import Drafter
from trtspec.speculative.drafters import make_drafter
from trtspec.speculative.loop import Menu
from trtspec.speculative.suffix import ResponseCache

AUTO = "auto"


def adaptive_policy(methods: Sequence[str], max_draft_len: int, probe_every: int = 16) -> AdaptivePolicy:
    """A deployment's policy over ``methods`` (the spec's SpeculativeSpec.methods)."""
    free = frozenset(m for m in methods if m in FREE_METHODS)
    return AdaptivePolicy(AdaptiveSettings(tuple(methods), free, max_draft_len, probe_every))


def policy_of(speculative) -> AdaptivePolicy | None:
    """From a SpeculativeSpec: the policy when it adapts, else None."""
    if not speculative.adapts:
        return None
    probe = speculative.auto.probe_every if speculative.auto is not None else 16
    return adaptive_policy(speculative.methods, speculative.max_draft_len, probe)


def make_menu(
    method: str,
    policy: AdaptivePolicy,
    *,
    draft_model: Drafter | None = None,
    suffix: SuffixSpec | None = None,
    cache: ResponseCache | None = None,
    **same: Any,
) -> Menu:
    """The Menu of ``policy``'s methods. Method auto: each drafter alone (suffix settings and
    cache go to suffix, the draft model to draft_target); one adaptive method: its drafter as
    make_drafter builds it (suffix layered on a model draft included). ``same``: make_drafter's
    other keywords (max_ngram, min_ngram, sources), declared there, the same for every method."""
    drafters = {}
    for name in policy.settings.methods:
        own_suffix = suffix if method != AUTO or name == "suffix" else None
        drafters[name] = make_drafter(
            name,
            draft_model=draft_model if name in MODEL_METHODS else None,
            suffix=own_suffix,
            cache=cache if own_suffix is not None else None,
            **same,
        )
    return Menu(drafters, policy)
