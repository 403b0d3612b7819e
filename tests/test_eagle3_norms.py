"""EAGLE-3.1 heads: the optional norms speculators writes (norm_before_fc, fc_norm,
norm_before_residual, norm_output), run by trtspec's head and scored by distill's unroll exactly
as a reference of speculators' forward written here from its source
(speculators 0.9.0 models/eagle3/core.py and model_definitions.py: read, not imported; its
package lives in .venv-speculators, not in this environment), on a speculators-layout
checkpoint converted by trtspec/testing/peer_heads.py. Plain heads keep their exact path; a config
and weights that disagree on a norm are refused by the checkpoint check."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import write_spec
from safetensors.torch import load_file, save_file
from test_eagle3 import DRAFT_IDS, runner
from typer.testing import Result

from trtspec.cli.app import app
from trtspec.testing.peer_heads import LAYER_KEYS, speculators_to_trtspec

NORMS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
FLAG_SETS = {
    "none": {},
    "speculators-defaults": {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True},
    "fc_norm": {"fc_norm": True, "norm_output": True},
    "residual-only": {"norm_before_residual": True},
}
LAYERS = [1, 2]  # the aux layer ids speculators records (a layer's input): the tiny target's outputs 0 and 1


def speculators_checkpoint(target: Path, out: Path, flags: dict, seed: int = 0) -> Path:
    """A random one-layer head in speculators' own layout (config and tensor names as its
    Eagle3DraftModel saves them), every norm weight away from 1 so that each norm matters."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(target)
    g = torch.Generator().manual_seed(seed)
    h, d, n = hf.hidden_size, hf.head_dim if getattr(hf, "head_dim", None) else hf.hidden_size // hf.num_attention_heads, 2
    kv, heads, inter = hf.num_key_value_heads, hf.num_attention_heads, hf.intermediate_size

    def w(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    def norm(size):
        return 1.0 + 0.5 * torch.randn(size, generator=g)

    ids = torch.tensor(DRAFT_IDS)
    t2d = torch.zeros(hf.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    target_state = load_file(str(target / "model.safetensors"))
    state = {
        "embed_tokens.weight": target_state["model.embed_tokens.weight"].float(),
        "fc.weight": w(h, n * h),
        "layers.0.hidden_norm.weight": norm(h),
        "layers.0.input_layernorm.weight": norm(h),
        "layers.0.post_attention_layernorm.weight": norm(h),
        "layers.0.self_attn.q_proj.weight": w(heads * d, 2 * h),
        "layers.0.self_attn.k_proj.weight": w(kv * d, 2 * h),
        "layers.0.self_attn.v_proj.weight": w(kv * d, 2 * h),
        "layers.0.self_attn.o_proj.weight": w(h, heads * d),
        "layers.0.mlp.gate_proj.weight": w(inter, h),
        "layers.0.mlp.up_proj.weight": w(inter, h),
        "layers.0.mlp.down_proj.weight": w(h, inter),
        "norm.weight": norm(h),
        "lm_head.weight": w(len(DRAFT_IDS), h),
        "d2t": ids - torch.arange(len(DRAFT_IDS)),
        "t2d": t2d,
    }
    if flags.get("norm_before_fc"):
        state["input_norm.weight"] = norm(n * h)
    if flags.get("fc_norm"):
        state |= {f"fc_norm.{i}.weight": norm(h) for i in range(n)}
    layer = {k: v for k, v in hf.to_dict().items() if k in LAYER_KEYS}
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": len(DRAFT_IDS),
        "eagle_aux_hidden_state_layer_ids": LAYERS,
        "target_hidden_size": None,
        "transformer_layer_config": {**layer, "model_type": "llama", "num_hidden_layers": 1, "sliding_window": 2048},
        **{k: bool(flags.get(k, False)) for k in NORMS},
    }
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


# ------------------------------------------------------------------ the reference forward


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Reference:
    """speculators' Eagle3DraftModel forward, one drafting chain, no cache: every call runs the
    whole sequence of (state, token) positions causally and returns the last position's logits
    and the state it hands the next step."""

    def __init__(self, folder: Path, target_hf):
        self.s = load_file(str(folder / "model.safetensors"))
        self.cfg = json.loads((folder / "config.json").read_text())
        self.hf = target_hf
        self.eps = target_hf.rms_norm_eps

    def fuse(self, features):  # [N, 2*hidden] -> [N, hidden]
        s, cfg = self.s, self.cfg
        if cfg["norm_before_fc"]:
            features = _rms(features, s["input_norm.weight"], self.eps)
        if cfg["fc_norm"]:
            parts = features.chunk(len(LAYERS), dim=-1)
            features = torch.cat([_rms(p, s[f"fc_norm.{i}.weight"], self.eps) for i, p in enumerate(parts)], dim=-1)
        return features @ s["fc.weight"].T

    def layer(self, states, tokens):  # states [N, hidden], tokens [N] -> (logits [N, V], fed back [N, hidden])
        s, hf, eps = self.s, self.hf, self.eps
        p = "layers.0."
        embeds = _rms(s["embed_tokens.weight"][tokens], s[p + "input_layernorm.weight"], eps)
        hidden = _rms(states, s[p + "hidden_norm.weight"], eps)
        residual = hidden if self.cfg["norm_before_residual"] else states
        x = torch.cat([embeds, hidden], dim=-1)
        n, heads, kv = len(tokens), hf.num_attention_heads, hf.num_key_value_heads
        d = s[p + "self_attn.q_proj.weight"].shape[0] // heads
        q = (x @ s[p + "self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ s[p + "self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        v = (x @ s[p + "self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") or getattr(hf, "rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        q, k = q * cos + _rotate(q) * sin, k * cos + _rotate(k) * sin
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(n, heads * d) @ s[p + "self_attn.o_proj.weight"].T
        h = residual + attn
        m = _rms(h, s[p + "post_attention_layernorm.weight"], eps)
        m = (torch.nn.functional.silu(m @ s[p + "mlp.gate_proj.weight"].T) * (m @ s[p + "mlp.up_proj.weight"].T)) @ s[
            p + "mlp.down_proj.weight"
        ].T
        h = h + m
        normed = _rms(h, s["norm.weight"], eps)
        return normed @ s["lm_head.weight"].T, (normed if self.cfg["norm_output"] else h)

    def chain(self, features, context: list[int], fed: list[int]) -> list[torch.Tensor]:
        """Draft logits of each step for ``context`` (features [len-1, ...] of positions 0..L-2),
        the tokens after the first step being ``fed`` (the drafts, or the true continuation)."""
        states = self.fuse(features)
        tokens = list(context[1:])
        out = []
        for j in range(len(fed) + 1):
            logits, back = self.layer(states, torch.tensor(tokens))
            out.append(logits[-1])
            if j < len(fed):
                states = torch.cat([states, back[-1:]])
                tokens.append(fed[j])
        return out

    def to_target(self, draft_id: int) -> int:
        return int(draft_id + self.s["d2t"][draft_id])


# ------------------------------------------------------------------ fixtures


class _Heads(dict):
    """Per flag set, made on first use: the reference over the speculators checkpoint, its
    trtspec conversion and a deployment of that."""

    def __init__(self, tmp_path_factory, target: Path):
        super().__init__()
        self.factory, self.target = tmp_path_factory, target

    def __missing__(self, name: str):
        from transformers import AutoConfig

        from trtspec.engines.build import build
        from trtspec.runtime import Deployment
        from trtspec.spec import load_spec

        root = self.factory.mktemp(f"norms-{name}")
        src = speculators_checkpoint(self.target, root / "speculators", FLAG_SETS[name])
        head = speculators_to_trtspec(src, root / "head")
        loaded = load_spec(write_spec(root, {"target": self.target, "head": head}, "head", **{"speculative.method": "eagle3"}))
        build(loaded, loaded.output_dir())
        self[name] = (Reference(src, AutoConfig.from_pretrained(self.target)), head, Deployment(loaded, loaded.output_dir()))
        return self[name]


@pytest.fixture(scope="module")
def norm_heads(tmp_path_factory, tiny_ckpts):
    return _Heads(tmp_path_factory, tiny_ckpts["target"])


# ------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("name", list(FLAG_SETS))
def test_trtspec_drafts_what_speculators_forward_computes(norm_heads, name):
    """The drafter (KV cache, feedback through Eagle3Head.feed_back) gives the reference's draft
    logits at every step of a k=4 chain, for each set of norms and for none."""
    from trtspec.engines.torch.engine import ForwardItem

    ref, _, dep = norm_heads[name]
    target, head = dep.target, dep.head
    seen: list[torch.Tensor] = []
    real = head.head.draft_logits
    head.head.draft_logits = lambda out: seen.append(real(out)) or seen[-1]
    try:
        dep.forget_prefixes()
        ctx = dep.encode("Speculative decoding makes inference faster")
        target.run([ForwardItem(ctx, 1)])
        drafts = dep.drafter().propose([ctx], [4])[0]
    finally:
        del head.head.draft_logits
    feats = target.features_of(ctx, 0, len(ctx) - 1).float()
    want = ref.chain(feats, ctx, drafts[:-1])
    assert len(seen) == len(want) == 4
    for j, (got, w) in enumerate(zip(seen, want)):
        torch.testing.assert_close(got.float().reshape(-1), w, rtol=1e-4, atol=1e-4, msg=f"step {j}")
        assert drafts[j] == ref.to_target(int(torch.argmax(w)))


@pytest.mark.parametrize("name", list(FLAG_SETS))
def test_distill_scores_the_head_speculators_forward_runs(norm_heads, name):
    """distill's unrolled steps (the scoring path of trtspec's acceptance figures) at position
    c - 1 + j are the reference's step j for the context ending at c, fed the true tokens."""
    from trtspec.distill.data import capture, collate
    from trtspec.distill.ttt import unrolled_logits

    ref, _, dep = norm_heads[name]
    target, head = dep.target, dep.head
    seq = dep.encode("Pack my box with five dozen liquor jugs, then pack another box")
    sample = capture(target, seq[:6], seq[6:])
    with torch.no_grad():
        lg = unrolled_logits(head.head, target.model.model.embed_tokens, collate([sample], 1000), 3, target.cos, target.sin)
    feats = sample.features.float() if sample.features is not None else None
    assert feats is not None
    for c in (2, 5, len(seq) - 4):
        want = ref.chain(feats[:c], seq[: c + 1], seq[c + 1 : c + 3])
        for j in range(3):
            torch.testing.assert_close(lg[j][0, c - 1 + j].float(), want[j], rtol=1e-4, atol=1e-4, msg=f"c={c} step {j}")


def test_a_plain_head_runs_the_plain_layer_exactly(norm_heads):
    """No norm set: no extra tensors or modules, and each place the norms enter is the plain
    computation bit for bit (fuse is fc, feed_back is the output itself, the residual the state)."""
    _, folder, dep = norm_heads["none"]
    head = dep.head.head
    cfg = json.loads((folder / "config.json").read_text())
    assert not any(cfg[k] for k in NORMS)
    assert not hasattr(head, "input_norm") and not hasattr(head, "fc_norm")
    assert not any(k.startswith(("input_norm", "fc_norm")) for k in head.state_dict())
    x = torch.randn(5, head.fc.in_features, dtype=head.fc.weight.dtype)
    with torch.no_grad():
        assert torch.equal(head.fuse(x), head.fc(x))
        out, state = torch.randn(2, 5, head.cfg.hidden_size), torch.randn(2, 5, head.cfg.hidden_size)
        assert head.feed_back(out) is out
        mid = head.midlayer
        assert torch.equal(mid.finish(out, state), (out + state) + mid.mlp(mid.post_attention_layernorm(out + state)))


# ------------------------------------------------------------------ conversion and refusals


def test_the_conversion_is_trtspecs_head_layout_with_the_norms_carried(norm_heads):
    _, folder, _ = norm_heads["speculators-defaults"]
    cfg = json.loads((folder / "config.json").read_text())
    names = set(load_file(str(folder / "model.safetensors")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["norm_before_fc"] and cfg["norm_before_residual"] and cfg["norm_output"] and not cfg["fc_norm"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert "input_norm.weight" in names and "midlayer.hidden_norm.weight" in names
    assert not any(n.startswith("layers.") for n in names) and "embed_tokens.weight" not in names and "t2d" not in names


def _check(tmp_path: Path, tiny_ckpts, head: Path) -> Result:
    spec = write_spec(tmp_path, {"target": tiny_ckpts["target"], "head": head}, "head", **{"speculative.method": "eagle3"})
    return runner.invoke(app, ["check", str(spec)])


def _edit(src: Path, dst: Path, config: dict | None = None, drop: str | None = None, tensors: dict | None = None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text()) | (config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != drop} | (tensors or {})
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize(
    "source, edit, message",
    [
        (
            "speculators-defaults",
            {"drop": "input_norm.weight"},
            "config.json sets norm_before_fc: true but the head lacks tensor input_norm.weight (128,)",
        ),
        (
            "fc_norm",
            {"drop": "fc_norm.1.weight"},
            "config.json sets fc_norm: true but the head lacks tensor fc_norm.1.weight (64,)",
        ),
        (
            "speculators-defaults",
            {"tensors": {"input_norm.weight": torch.ones(64)}},
            "input_norm.weight has shape (64,), norm_before_fc over 2 feature layer(s) of hidden size 64 needs (128,)",
        ),
        (
            "speculators-defaults",
            {"config": {"norm_before_fc": False}},
            "the head holds input_norm.weight but config.json does not set norm_before_fc: true",
        ),
        ("fc_norm", {"config": {"norm_before_fc": True}}, "norm_before_fc and fc_norm are both true"),
        ("none", {"config": {"norm_output": "yes"}}, "norm_output is 'yes'; set it to true or false"),
    ],
)
def test_check_refuses_norms_that_config_and_weights_disagree_on(tmp_path, tiny_ckpts, norm_heads, source, edit, message):
    bad = _edit(norm_heads[source][1], tmp_path / "bad-head", **edit)
    r = _check(tmp_path, tiny_ckpts, bad)
    assert r.exit_code == 2, r.output
    assert "Error:" in r.output and message in r.output
    assert r.output.count("Error:") == 1


def test_check_accepts_a_head_with_norms(tmp_path, tiny_ckpts, norm_heads):
    r = _check(tmp_path, tiny_ckpts, norm_heads["speculators-defaults"][1])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("name", ["speculators-defaults", "fc_norm"])
def test_a_tree_of_a_head_with_norms_is_the_reference_at_every_node(norm_heads, name):
    """Each node of a draft tree is the reference's candidate of its rank, the reference fed the
    node's ancestors (the tree's states fed back through the same norms as a chain's)."""
    from trtspec.engines.torch.engine import ForwardItem
    from trtspec.speculative.tree import ROOT, StaticTree

    ref, _, dep = norm_heads[name]
    dep.forget_prefixes()
    ctx = dep.encode("Speculative decoding makes inference faster")
    dep.target.run([ForwardItem(ctx, 1)])
    shape = StaticTree.of([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)])
    (tree,) = dep.drafter().propose_tree([ctx], [shape])
    feats = dep.target.features_of(ctx, 0, len(ctx) - 1).float()
    assert len(tree) == 7
    for n in range(len(tree)):
        path, a = [], tree.parents[n]
        while a != ROOT:
            path.insert(0, tree.tokens[a])
            a = tree.parents[a]
        logits = ref.chain(feats, ctx, path)[-1]
        ranked = [ref.to_target(int(i)) for i in torch.topk(logits, 3).indices]
        assert tree.tokens[n] == ranked[tree.ranks[n]], f"node {tree.key(n)}"
