"""A drafter's capabilities are declared, checked when its class is defined, and read by the
loop from the declaration alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_loop import OracleVerifier, PerfectDrafter, reference

import trtspec.speculative.loop as loop_module
from trtspec.speculative.capabilities import Capabilities, Drafter
from trtspec.speculative.drafters import LayeredDrafter, ModelDrafter, NgramDrafter
from trtspec.speculative.eagle3_drafter import Eagle3Drafter
from trtspec.speculative.loop import Batch, GenerationRequest, NoDrafter, generate
from trtspec.speculative.suffix import SuffixDrafter
from trtspec.triton.backend.bls import BlsDrafter


def test_a_method_whose_capability_is_not_declared_is_refused_at_class_definition():
    with pytest.raises(TypeError, match=r"Releasing has method release but does not declare it: .*releases=True"):

        class Releasing(Drafter):
            def propose(self, contexts, draft_lens):
                return [[] for _ in contexts]

            def release(self, prompt, output):
                pass


@pytest.mark.parametrize(
    "capabilities, what",
    [(Capabilities(trees=True), "method propose_tree"), (Capabilities(samples=True), "method propose_sampled")],
)
def test_a_declared_capability_without_its_method_is_refused(capabilities, what):
    with pytest.raises(TypeError, match=f"declares .* but has no {what}"):
        type("Claims", (Drafter,), {"capabilities": capabilities, "propose": lambda self, c, n: [[] for _ in c]})


def test_a_keyword_is_a_capability_too():
    """propose taking ``rules`` or ``scopes`` without declaring it would never be passed them."""
    with pytest.raises(TypeError, match="propose's keyword rules but does not declare it"):

        class Mirrors(Drafter):
            def propose(self, contexts, draft_lens, rules=None):
                return [[] for _ in contexts]

    with pytest.raises(TypeError, match="declares scoped but has no propose's keyword scopes"):
        type("Scoped", (Drafter,), {"capabilities": Capabilities(scoped=True), "propose": lambda self, c, n: []})


def test_a_drafter_without_propose_is_refused():
    with pytest.raises(TypeError, match="Silent has no propose"):
        type("Silent", (Drafter,), {})


def test_the_loop_refuses_a_drafter_that_declares_nothing():
    class Undeclared:  # duck-typed: proposes, but states no capabilities
        def propose(self, contexts, draft_lens):
            return [[] for _ in contexts]

    with pytest.raises(TypeError, match="Undeclared is not a Drafter: subclass"):
        Batch(Undeclared(), OracleVerifier())


def test_the_product_drafters_declare_what_they_do():
    assert ModelDrafter.capabilities == Capabilities(mirrors_processing=True, samples=True, trees=True)
    assert BlsDrafter.capabilities == Capabilities(mirrors_processing=True, trees=True)
    assert Eagle3Drafter.capabilities == Capabilities(trees=True)
    assert SuffixDrafter.capabilities == Capabilities(scoped=True, releases=True, offers=True)
    assert LayeredDrafter.capabilities == Capabilities(mirrors_processing=True, scoped=True, releases=True, samples=True)
    assert NgramDrafter.capabilities == NoDrafter.capabilities == Capabilities()


def test_a_declared_release_is_called_once_per_sequence_that_leaves():
    released = []

    class Releasing(PerfectDrafter):
        capabilities = Capabilities(releases=True)

        def release(self, prompt, output):
            released.append((list(prompt), list(output)))

    (res,) = generate([GenerationRequest([1, 2], 12, 3)], Releasing(), OracleVerifier())
    assert res.output_ids == reference(12, (1, 2))
    assert released == [([1, 2], res.output_ids)]


def test_the_loop_probes_no_drafter_for_methods():
    """What a drafter can do comes from its Capabilities, never from getattr/hasattr."""
    tree = ast.parse(Path(loop_module.__file__).read_text())
    probes = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
    ]
    assert probes == []
