"""The smallest shape for inputs trtspec does not serve, in every generated config.pbtxt.

Triton checks each input's shape against the config before it hands a request to a model:
an input whose shape differs is refused there, before the Python backend copies it into its
shared-memory pool (which grows to the largest request it carried and never shrinks) and
before a stub deserialises it. A config dimension is either exact or variable (-1); Triton
has no "at most N". So:

- an input trtspec does not serve (contract.UNSERVED_INPUTS: images, prompt tables, LoRA
  weights, ...) gets 1 in each variable dimension: its rank stays upstream's, so a client that
  sends it at that size still reaches the refusal that names the feature, and anything larger
  is refused by Triton's shape check with no model process holding it;
- an input trtspec serves keeps its variable dimensions (a prompt's tokens, a list of stop
  words): the models bound them by the spec's limits (contract.check_text_sizes, the engine
  model's length check), and the allocator returns what a refused request's buffers held
  (install.find_allocator).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from trtspec.triton.backend.contract import UNSERVED_INPUTS
from trtspec.triton.repository.pbtxt import TensorSpec


def smallest_unserved(inputs: Sequence[TensorSpec], unserved: Collection[str] = UNSERVED_INPUTS) -> list[TensorSpec]:
    """``inputs`` with every variable dimension of an ``unserved`` input made 1."""
    return [replace(t, dims=[1 if d == -1 else d for d in t.dims]) if t.name in unserved else t for t in inputs]
