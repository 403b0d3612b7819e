"""What a drafter can do, declared once: the loop reads a drafter's Capabilities when it is
built and never probes the drafter for methods.

Every drafter subclasses :class:`Drafter` and states its capabilities as a class attribute;
the adaptive Menu of drafters (loop.Menu) states its own. The class is checked when it is defined: a
method that needs a capability it does not declare, or a capability without its method, is a
TypeError naming both, so a drafter cannot quietly lose a capability the loop would use.

    propose(contexts, draft_lens, **keywords)      every drafter
      keyword rules=  (one RowRules or None per context)        mirrors_processing
      keyword scopes= (one suffix cache scope per context)      scoped
    release(prompt, output[, scope])                 releases (scope: when also scoped)
    propose_tree(contexts, shapes)                   trees
    propose_sampled(contexts, draft_lens, params, gens, **keywords)   samples
    drafts(contexts, draft_lens, scopes) and sent(session, context_len, tokens, source)
                                                     offers (a free drafter in a Menu that
                                                     counts an offer only where it is taken)
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

TokenRows = Sequence[list[int]]  # one list of token ids per row (sequence) of a step


@dataclass(frozen=True)
class Capabilities:
    """A drafter's capabilities beyond ``propose``; each says which method or keyword it adds."""

    # propose / propose_sampled take ``rules``: the requests' logits processing shapes the drafts
    # too (a drafter without it drafts as usual, which costs acceptance, never correctness).
    mirrors_processing: bool = False
    # propose / propose_sampled take ``scopes`` (each request's suffix cache scope) and
    # release takes the scope as its third argument.
    scoped: bool = False
    releases: bool = False  # release(prompt, output): told when a sequence leaves the loop
    trees: bool = False  # propose_tree: drafts the trees of requests that ask for one
    samples: bool = False  # propose_sampled: sampled drafts with their distributions
    offers: bool = False  # drafts + sent: offers drafts and counts those the target is sent


# Each capability that adds methods -> those methods; each that adds a keyword -> the keyword.
METHODS = {"releases": ("release",), "trees": ("propose_tree",), "samples": ("propose_sampled",), "offers": ("drafts", "sent")}
KEYWORDS = {"mirrors_processing": "rules", "scoped": "scopes"}


class Drafter:
    """Proposes draft tokens; what else it can do is its ``capabilities``."""

    capabilities: ClassVar[Capabilities] = Capabilities()

    def propose(self, contexts: TokenRows, draft_lens: Sequence[int], **keywords) -> list[list[int]]:
        """Up to draft_lens[i] draft tokens continuing contexts[i] (fewer is allowed)."""
        raise NotImplementedError

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        check_capabilities(cls)


def check_capabilities(cls: type) -> None:
    """TypeError where ``cls``'s methods and its declared capabilities disagree."""
    if inspect.getattr_static(cls, "propose") is Drafter.__dict__["propose"]:
        raise TypeError(f"drafter {cls.__name__} has no propose: every drafter proposes")
    declared = cls.capabilities
    if not isinstance(declared, Capabilities):
        raise TypeError(f"{cls.__name__}.capabilities must be a Capabilities, not {type(declared).__name__}")
    for name, methods in METHODS.items():
        for method in methods:
            has = callable(inspect.getattr_static(cls, method, None))
            if has != getattr(declared, name):
                raise TypeError(_mismatch(cls, name, f"method {method}", has))
    takes = inspect.signature(cls.propose).parameters
    for name, keyword in KEYWORDS.items():
        has = keyword in takes
        if has != getattr(declared, name):
            raise TypeError(_mismatch(cls, name, f"propose's keyword {keyword}", has))


def _mismatch(cls: type, capability: str, what: str, has: bool) -> str:
    if has:
        return (
            f"drafter {cls.__name__} has {what} but does not declare it: set capabilities = Capabilities({capability}=True, ...)"
        )
    return f"drafter {cls.__name__} declares {capability} but has no {what}: add it or drop {capability} from its capabilities"
