"""A spec's model draft as vLLM and SGLang take it: vLLM's ``speculative_config`` and
SGLang's launch flags, chains and trees, for the same draft folder trtspec serves.

TensorRT-LLM's settings are written by ``engines/trtllm/llmapi.py``. What an engine cannot
express is refused by name (SpecError, exit 2), never approximated: a different tree would
verify other tokens and accept at another rate than the one trtspec measured. The names are
checked against inventories of upstream's fields by the tests (tests/vllm_fields.py,
tests/sglang_fields.py); the upstream facts, with sources, are in docs/trees.md.

vLLM (vllm/config/speculative.py; trees: vllm-project/vllm PR #20401): a tree is
``speculative_token_tree``, a Python literal of choice tuples that vLLM sorts breadth-first;
``num_speculative_tokens`` is its node count. Its EAGLE proposer drafts ``topk(c)`` children
under every node of a level, so a level's nodes must all have the same children, ranks 0 to
c - 1 (a "fixed branching factor per level"); trees need the tree attention backend
(VLLM_ATTENTION_BACKEND=TREE_ATTN). vLLM has no dynamic tree.

SGLang (python/sglang/srt/server_args.py): EAGLE-2's dynamic tree is
``--speculative-eagle-topk`` > 1 with ``--speculative-num-steps`` (the depth) and
``--speculative-num-draft-tokens`` (the tokens verified, the root included: a chain of k
is steps k, topk 1, k + 1 tokens). SGLang takes no static choice list.

Load and acceptance (docs/adaptive.md, Exports): vLLM switches k by batch size
(``num_speculative_tokens_per_batch_size``, inclusive [first, last, k] ranges: the spec's
``schedule``) and picks no k from acceptance. SGLang's ``--speculative-adaptive`` picks the
draft depth from an EMA of the batch's accepted lengths among the candidate steps of
``--speculative-adaptive-config`` (a JSON file of batch-size slots, python/sglang/srt/
speculative/adaptive_spec_params.py): ``adaptive: true`` on method eagle3, the schedule's cap
per slot. Neither chooses a drafter per request (method auto) or has the acceptance
switch-off; what one lacks is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping

from trtspec.errors import SpecError
from trtspec.spec import SpeculativeSpec, TreeSpec

VLLM_METHOD = {"eagle3": "eagle3", "draft_target": "draft_model"}
VLLM_TREE_METHODS = ("eagle3",)  # the EAGLE proposer drafts trees (propose_tree)
VLLM_TREE_ENV = {"VLLM_ATTENTION_BACKEND": "TREE_ATTN"}  # vLLM's tree attention backend
SGLANG_ALGORITHM = {"eagle3": "EAGLE3", "draft_target": "STANDALONE"}
# adaptive_unsupported_reason: SGLang adapts EAGLE / EAGLE3 drafts (topk 1) only, and falls
# back to a fixed depth with a warning for any other algorithm.
SGLANG_ADAPTIVE_ALGORITHMS = ("EAGLE3",)
SGLANG_ADAPTIVE_CONFIG = "sglang_adaptive.json"  # the file check writes beside the command


def _model_draft(s: SpeculativeSpec, engine: str, methods: dict[str, str]) -> str:
    if s.method == "auto":
        raise SpecError(
            f"speculative.method auto: {engine} drafts with one method and chooses no drafter per request; "
            f"export a spec with one method ({', '.join(methods)}), adaptive if the engine takes it"
        )
    if s.switch_off is not None:
        raise SpecError(
            f"speculative.switch_off: {engine} has no switch-off on acceptance (TensorRT-LLM has); remove switch_off for {engine}"
        )
    if s.method not in methods:
        raise SpecError(
            f"speculative.method {s.method}: trtspec writes {engine} settings for model drafts "
            f"({', '.join(methods)}); set {engine}'s own {s.method} options by hand"
        )
    return methods[s.method]


def vllm_token_tree(tree: TreeSpec) -> str:
    """A static tree as vLLM's ``speculative_token_tree``: "[(0,), (1,), (0, 0)]"."""
    return str([tuple(path) for path in tree.choices])


def uneven_level(choices: tuple[tuple[int, ...], ...]) -> int | None:
    """The first depth (1-based) at which the parents do not all have children 0 .. c - 1
    for one c, or None: vLLM's EAGLE proposer drafts only such trees."""
    depth = max(map(len, choices))
    for d in range(1, depth + 1):
        parents = {p for p in choices if len(p) == d - 1} if d > 1 else {()}
        kids = {parent: sorted(p[-1] for p in choices if len(p) == d and p[:-1] == parent) for parent in parents}
        shapes = {tuple(k) for k in kids.values()}
        if len(shapes) != 1 or list(next(iter(shapes))) != list(range(len(next(iter(shapes))))):
            return d
    return None


def vllm_schedule(schedule: Mapping[int, int], max_batch_size: int) -> dict:
    """A {min active sequences: k} schedule as vLLM's ``speculative_config`` keys:
    num_speculative_tokens (the largest k) and num_speculative_tokens_per_batch_size, inclusive
    [first, last, k] batch-size ranges, the last one up to ``max_batch_size``."""
    points = sorted(schedule.items())
    ranges = []
    for i, (n, k) in enumerate(points):
        last = points[i + 1][0] - 1 if i + 1 < len(points) else max(max_batch_size, n)
        ranges.append([n, last, k])
    top = max(k for _, k in points)
    if top == 0:
        raise ValueError("the schedule drafts nothing at any load: leave speculation off instead")
    return {"num_speculative_tokens": top, "num_speculative_tokens_per_batch_size": ranges}


def vllm_speculative_config(s: SpeculativeSpec, draft: str, max_batch_size: int | None = None) -> dict:
    """vLLM's ``speculative_config`` for the spec's draft at ``draft`` (a folder or Hub id);
    ``max_batch_size`` (the target's) ends the last range of a schedule. A tree also needs
    VLLM_TREE_ENV in the server's environment."""
    cfg = {"method": _model_draft(s, "vLLM", VLLM_METHOD), "model": draft, "num_speculative_tokens": s.max_draft_len}
    if s.adaptive:
        raise SpecError(
            "speculative.adaptive: vLLM picks no k per request from acceptance (its adaptive-k pull request, "
            "#44336, was closed unmerged), only per batch size: remove adaptive for vLLM and keep "
            "speculative.schedule (num_speculative_tokens_per_batch_size)"
        )
    tree = s.tree
    if tree is None:
        return cfg | _vllm_load_schedule(s, max_batch_size)
    if tree.dynamic is not None:
        raise SpecError(
            "speculative.tree.dynamic: vLLM has no dynamic tree, only a static speculative_token_tree; "
            "use tree.choices for vLLM (or SGLang's / TensorRT-LLM's dynamic tree)"
        )
    if s.method not in VLLM_TREE_METHODS:
        raise SpecError(
            f"speculative.tree on method {s.method}: vLLM drafts trees in its EAGLE proposer only; "
            "use method eagle3 or remove tree"
        )
    if (level := uneven_level(tree.choices)) is not None:
        raise SpecError(
            f"speculative.tree.choices: the nodes at depth {level} are not children 0 .. c - 1 of every node "
            f"above them; vLLM drafts the same top c children under each node of a level, so give every "
            "node of a level the same children (or use SGLang's / TensorRT-LLM's dynamic tree)"
        )
    if s.schedule:
        raise SpecError(
            "speculative.schedule on a tree: vLLM's num_speculative_tokens_per_batch_size sets a chain's "
            "length per batch size, and a tree's node count is fixed; remove schedule or tree for vLLM"
        )
    return cfg | {"num_speculative_tokens": tree.node_count, "speculative_token_tree": vllm_token_tree(tree)}


def _vllm_load_schedule(s: SpeculativeSpec, max_batch_size: int | None) -> dict:
    if not s.schedule:
        return {}
    if max_batch_size is None:
        raise ValueError("a schedule's last range needs the target's max_batch_size")
    try:
        return vllm_schedule(s.schedule, max_batch_size)
    except ValueError as e:
        raise SpecError(f"speculative.schedule: {e}") from None


def sglang_args(s: SpeculativeSpec, draft: str, adaptive_config: str = SGLANG_ADAPTIVE_CONFIG) -> list[str]:
    """SGLang's launch flags for the spec's draft at ``draft`` (sglang.launch_server ...);
    ``adaptive_config``: where sglang_adaptive_config's JSON is written (adaptive specs)."""
    algorithm = _model_draft(s, "SGLang", SGLANG_ALGORITHM)
    steps, top_k, nodes = _sglang_adaptive_depth(s, algorithm) if s.adaptive else _sglang_draft_shape(s)
    flags = {
        "--speculative-algorithm": algorithm,
        "--speculative-draft-model-path": draft,
        "--speculative-num-steps": steps,
        "--speculative-eagle-topk": top_k,
        "--speculative-num-draft-tokens": nodes + 1,  # SGLang counts the root it verifies from
    }
    if s.adaptive:
        flags["--speculative-adaptive-config"] = adaptive_config
    argv = [str(x) for flag, value in flags.items() for x in (flag, value)]
    return ["--speculative-adaptive", *argv] if s.adaptive else argv


def _sglang_draft_shape(s: SpeculativeSpec) -> tuple[int, int, int]:
    """(steps, top k, nodes) of a fixed chain or EAGLE-2 dynamic tree."""
    if s.schedule:
        raise SpecError(
            "speculative.schedule: SGLang takes a draft length per batch size only as the candidate steps "
            "of its adaptive mode (--speculative-adaptive-config); set adaptive: true (method eagle3) or "
            "remove schedule for SGLang"
        )
    tree = s.tree
    if tree is not None and tree.choices is not None:
        raise SpecError(
            "speculative.tree.choices: SGLang builds EAGLE-2's dynamic tree only (--speculative-eagle-topk) "
            "and takes no static choice list; use tree.dynamic for SGLang (or vLLM's speculative_token_tree)"
        )
    top_k, nodes = (tree.dynamic.top_k, tree.dynamic.nodes) if tree is not None else (1, s.max_draft_len)
    return s.max_draft_len, top_k, nodes


def _sglang_adaptive_depth(s: SpeculativeSpec, algorithm: str) -> tuple[int, int, int]:
    """(steps, top k, nodes) SGLang starts an adaptive chain at: the deepest candidate (its
    --speculative-num-steps must be one of them)."""
    if algorithm not in SGLANG_ADAPTIVE_ALGORITHMS:
        raise SpecError(
            f"speculative.adaptive on method {s.method}: SGLang adapts the draft depth of EAGLE drafts only "
            f"({algorithm} falls back to a fixed depth); remove adaptive for SGLang or use method eagle3"
        )
    steps = max(max(c["candidate_steps"]) for c in sglang_adaptive_config(s).values())
    if steps == 0:
        raise SpecError("speculative.schedule drafts nothing at any load: leave speculation off instead")
    return steps, 1, steps  # SGLang adapts chains (topk 1) only


def sglang_adaptive_config(s: SpeculativeSpec) -> dict:
    """--speculative-adaptive-config's JSON: one slot per schedule threshold (SGLang routes a
    batch to the largest key <= its size, as the schedule does), candidate steps 0 (no
    draft) to the cap there; no schedule: one slot from batch size 1 up to max_draft_len."""
    caps = s.schedule or {1: s.max_draft_len}
    return {str(n): {"candidate_steps": list(range(k + 1))} for n, k in sorted(caps.items())}
