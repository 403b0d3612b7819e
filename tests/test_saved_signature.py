"""Saved programs check torch's guards once per call signature (engines/torch/saved.py)."""

from __future__ import annotations

import torch

from trtspec.engines.torch.saved import SavedPrograms, signature


class _Program:
    """A stand-in for a loaded AOTCompiledFunction: its guards accept calls whose first tensor
    has ``rows`` rows, and count how often they were checked."""

    def __init__(self, rows: int):
        self.rows, self.checks = rows, 0
        self.fn = lambda *args: rows

    def guard_check(self, *args) -> bool:
        self.checks += 1
        return args[1].shape[0] == self.rows


def _saved(tmp_path, *programs) -> SavedPrograms:
    saved = SavedPrograms(tmp_path, dict)
    saved.variants["step"] = list(programs)
    return saved


def test_a_call_of_a_signature_met_before_runs_its_program_without_checking_the_guards_again(tmp_path):
    one, two = _Program(1), _Program(2)
    saved = _saved(tmp_path, one, two)
    owner = object()
    for _ in range(3):
        assert saved.find("step", None, (owner, torch.zeros(2, 4), [torch.zeros(3)], 5), lambda: None) is two.fn
    assert (one.checks, two.checks) == (1, 1)  # checked on the first call only
    # another shape is another signature: its guards are checked
    assert saved.find("step", None, (owner, torch.zeros(1, 4), [torch.zeros(3)], 5), lambda: None) is one.fn
    assert one.checks == 2


def test_the_signature_tells_apart_what_a_guard_would():
    a, b = torch.zeros(2, 3), torch.zeros(2, 3)
    base = signature((a, b, [a], 4, True))
    assert signature((a.clone(), b.clone(), [a.clone()], 4, True)) != base  # aliasing changed
    assert signature((torch.zeros(2, 3), torch.zeros(2, 3), [torch.zeros(2, 3)], 4, True)) == signature(
        (torch.ones(2, 3), torch.ones(2, 3), [torch.ones(2, 3)], 4, True)
    )  # values are not part of it: a program reads them at each call
    changed = [
        (a.t(), b, [a], 4, True),  # strides
        (a.double(), b, [a], 4, True),  # dtype
        (a, b, [a, a], 4, True),  # list length
        (a, b, [a], 5, True),  # an int argument (a static size)
        (a, b, [a], 4, False),  # a flag
        (a, b, (a,), 4, True),  # a tuple for a list
        (a.requires_grad_(False).clone().requires_grad_(True), b, [a], 4, True),  # autograd
    ]
    for args in changed:
        assert signature(args) != base, args
    with torch.inference_mode():
        assert signature((a, b, [a], 4, True)) != base  # the mode
        c = torch.zeros(2, 3)
    assert signature((c, b, [c], 4, True)) != signature((a, b, [a], 4, True))  # an inference tensor


def test_the_remembered_signatures_are_bounded(tmp_path, monkeypatch):
    from trtspec.engines.torch import saved as module

    monkeypatch.setattr(module, "MAX_VERIFIED", 4)
    program = _Program(1)
    saved = _saved(tmp_path, program)
    for n in range(10):
        saved.find("step", None, (None, torch.zeros(1, n + 1)), lambda: None)
    assert len(saved.verified) <= 4
