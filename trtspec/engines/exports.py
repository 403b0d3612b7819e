"""A spec's model draft as vLLM and SGLang take it: vLLM's ``speculative_config`` and
SGLang's launch flags, chains and trees, for the same draft folder trtspec serves.

TensorRT-LLM's settings are written by ``engines/trtllm/llmapi.py``. What an engine cannot
express is refused by name (SpecError, exit 2), never approximated: a different tree would
verify other tokens and accept at another rate than the one trtspec measured. The names are
checked against inventories of upstream's fields by the tests (bench/vllm_fields.py,
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
"""

from __future__ import annotations

from trtspec.errors import SpecError
from trtspec.spec import SpeculativeSpec, TreeSpec

VLLM_METHOD = {"eagle3": "eagle3", "draft_target": "draft_model"}
VLLM_TREE_METHODS = ("eagle3",)  # the EAGLE proposer drafts trees (propose_tree)
VLLM_TREE_ENV = {"VLLM_ATTENTION_BACKEND": "TREE_ATTN"}  # vLLM's tree attention backend
SGLANG_ALGORITHM = {"eagle3": "EAGLE3", "draft_target": "STANDALONE"}


def _model_draft(s: SpeculativeSpec, engine: str, methods: dict[str, str]) -> str:
    if s.adapts:
        raise SpecError(
            f"speculative.{'method auto' if s.method == 'auto' else 'adaptive'}: trtspec's per-request choice of "
            f"drafter and k from measured acceptance has no {engine} equivalent written here; export a fixed "
            "method (and its speculative.schedule) instead"
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


def vllm_speculative_config(s: SpeculativeSpec, draft: str) -> dict:
    """vLLM's ``speculative_config`` for the spec's draft at ``draft`` (a folder or Hub id).
    A tree also needs VLLM_TREE_ENV in the server's environment."""
    cfg = {"method": _model_draft(s, "vLLM", VLLM_METHOD), "model": draft, "num_speculative_tokens": s.max_draft_len}
    tree = s.tree
    if tree is None:
        return cfg
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
    return cfg | {"num_speculative_tokens": tree.node_count, "speculative_token_tree": vllm_token_tree(tree)}


def sglang_args(s: SpeculativeSpec, draft: str) -> list[str]:
    """SGLang's launch flags for the spec's draft at ``draft`` (sglang.launch_server ...)."""
    algorithm = _model_draft(s, "SGLang", SGLANG_ALGORITHM)
    tree = s.tree
    if tree is not None and tree.choices is not None:
        raise SpecError(
            "speculative.tree.choices: SGLang builds EAGLE-2's dynamic tree only (--speculative-eagle-topk) "
            "and takes no static choice list; use tree.dynamic for SGLang (or vLLM's speculative_token_tree)"
        )
    top_k, nodes = (tree.dynamic.top_k, tree.dynamic.nodes) if tree is not None else (1, s.max_draft_len)
    flags = {
        "--speculative-algorithm": algorithm,
        "--speculative-draft-model-path": draft,
        "--speculative-num-steps": s.max_draft_len,
        "--speculative-eagle-topk": top_k,
        "--speculative-num-draft-tokens": nodes + 1,  # SGLang counts the root it verifies from
    }
    return [str(x) for flag, value in flags.items() for x in (flag, value)]
