"""`distill --from-capture DIR --init HEAD`: a head continued on served traffic (serve.capture),
with the newest captured requests held out, and both heads scored side by side."""

from __future__ import annotations

import json

import pytest
from conftest import write_spec
from test_distill import small_opts
from typer.testing import CliRunner

from trtspec.cli.app import app
from trtspec.distill.run import distill
from trtspec.spec import load_spec
from trtspec.speculative.capture import CaptureTag, parts, read_capture

runner = CliRunner()
TRAFFIC = [
    "def add(a, b):",
    "SELECT name FROM users WHERE",
    '{"name": "x", "id":',
    "ls -la | grep",
    "for i in range(10):",
    "UPDATE users SET",
    "git commit -m",
    "import numpy as np",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_ckpts):
    """A distilled head, deployed with serve.capture on, after answering TRAFFIC."""
    from trtspec.engines.build import build
    from trtspec.runtime import Deployment

    root = tmp_path_factory.mktemp("refine")
    capture = {"dir": "captured", "max_gb": 1, "sample": 1.0}
    spec = write_spec(
        root,
        {"target": tiny_ckpts["target"], "head": root / "head"},
        "head",
        **{"speculative.method": "eagle3", "serve.capture": capture},
    )
    loaded = load_spec(spec)
    distill(loaded, small_opts(root))
    build(loaded, loaded.output_dir())
    dep = Deployment(loaded, loaded.output_dir())
    for n in range(0, len(TRAFFIC), 4):  # the tiny engine's batch
        reqs = [dep.request(dep.encode(p), 12, 3) for p in TRAFFIC[n : n + 4]]
        dep.generate(reqs, tags=[CaptureTag(f"t{i}") for i in range(n, n + len(reqs))])
    dep.close()  # the writer's thread writes what it holds
    assert len(parts(loaded.capture_dir())) == len(TRAFFIC)
    return root, spec, loaded


def _refine(spec, *args):
    return runner.invoke(app, ["distill", str(spec), *args])


def test_a_head_continued_on_captured_traffic_is_scored_beside_the_old_one(served):
    root, spec, loaded = served
    cap = loaded.capture_dir()
    args = ["--from-capture", str(cap), "--init", str(root / "head"), "-o", str(root / "head2")]
    r = _refine(spec, *args, "--max-steps", "6", "--capture-held-out", "0.25", "--json", "--prompts", str(root / "prompts.jsonl"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{") :])
    assert out["held_requests"] == ["t6", "t7"]  # the newest quarter, never trained on
    for head in ("old", "new"):
        assert out[head]["held_out_captured_n"] == 2 and out[head]["verify_prompts_n"] == len(loaded.verify_prompts())
        assert 0.0 <= out[head]["held_out_captured"] <= 1.0 and 0.0 <= out[head]["verify_prompts"] <= 1.0
    manifest = json.loads((root / "head2" / "trtspec-head.json").read_text())
    assert manifest["continued"]["held_requests"] == ["t6", "t7"] and manifest["continued"]["captured_trained"] == 6
    assert manifest["continued"]["replayed"] == 6  # --replay 0.5: as many original sequences as captured ones
    assert manifest["comparison"] == {"old": out["old"], "new": out["new"]}
    # the old head, read only, is unchanged; the new one differs from it
    assert (root / "head" / "model.safetensors").read_bytes() != (root / "head2" / "model.safetensors").read_bytes()


def test_the_verify_prompts_figure_is_the_specs_verify_prompts_alone(served, tmp_path):
    """A head whose recipe has eval prompts: its unseen prompts are the verify prompts and
    those; the verify figure is over the verify prompts alone, the unseen one over both."""
    import shutil

    root, spec, loaded = served
    init = tmp_path / "head"
    shutil.copytree(root / "head", init)
    extra = tmp_path / "eval.jsonl"
    extra.write_text('{"prompt": "Name two rivers."}\n{"prompt": "Count to five."}\n')
    path = init / "trtspec-head.json"
    manifest = json.loads(path.read_text())
    manifest["recipe"]["eval_prompts"] = str(extra)
    path.write_text(json.dumps(manifest))
    args = ["--from-capture", str(loaded.capture_dir()), "--init", str(init), "-o", str(tmp_path / "new")]
    r = _refine(spec, *args, "--max-steps", "2", "--capture-held-out", "0.25", "--json", "--prompts", str(root / "prompts.jsonl"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{") :])
    n = len(loaded.verify_prompts())
    for head in ("old", "new"):
        assert out[head]["verify_prompts_n"] == n and out[head]["unseen_prompts_n"] == n + 2
        assert 0.0 <= out[head]["verify_prompts"] <= 1.0 and 0.0 <= out[head]["unseen_prompts"] <= 1.0


def test_the_held_out_and_verify_prompts_are_never_trained_on(served):
    from trtspec.distill.refine import split_captured

    _, _, loaded = served
    captured = read_capture(loaded.capture_dir())
    train, held = split_captured(captured, 0.25, "d")
    assert [c.record["request_id"] for c in held] == ["t6", "t7"] and len(train) == 6
    assert split_captured(captured, 0.01, "d")[1] == captured[-1:]  # at least one held out


def test_a_repeated_held_out_prompt_is_left_out_of_training(served):
    from trtspec.distill.refine import trainable
    from trtspec.errors import SpecError

    _, _, loaded = served
    captured = read_capture(loaded.capture_dir())

    class Data:  # what trainable reads of prepare()'s result
        layer_ids = (0, 1)
        target = type(
            "T", (), {"config": type("C", (), {"hidden_size": captured[0].sample.features.shape[-1] // 2}), "vocab_size": 10**6}
        )

    kept = trainable(captured[:4], [captured[1].sample, captured[3].sample], Data)
    assert [s.tokens.tolist() for s in kept] == [captured[i].sample.tokens.tolist() for i in (0, 2)]
    with pytest.raises(SpecError, match="every captured request repeats a held-out or verify prompt"):
        trainable(captured[:1], [captured[0].sample], Data)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--from-capture", "{cap}"], "--from-capture and --init go together"),
        (["--from-capture", "{cap}", "--init", "{root}/head", "-o", "{root}/head"], "is also where the new head would go"),
        (["--from-capture", "{root}/nowhere", "--init", "{root}/head", "-o", "{root}/h3"], "is not a folder"),
        (["--from-capture", "{root}/one", "--init", "{root}/head", "-o", "{root}/h3"], "at least 2 are needed"),
        (["--from-capture", "{cap}", "--init", "{root}", "-o", "{root}/h3"], "is not an EAGLE-3 head folder"),
        (["--from-capture", "{cap}", "--init", "{root}/head", "-o", "{root}/h3", "--replay", "1"], "--replay"),
    ],
)
def test_bad_from_capture_input_is_refused_by_name(served, args, message):
    root, spec, loaded = served
    one = root / "one"
    one.mkdir(exist_ok=True)
    first = parts(loaded.capture_dir())[0]
    (one / first.name).write_bytes(first.read_bytes())
    r = _refine(spec, *[a.format(cap=loaded.capture_dir(), root=root) for a in args])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert not (root / "h3").exists()
