"""The bigram target (``make_bigram_target``: greedy next token g(x) = ``bigram_map``, one-hot
embeddings, lm_head = the matrix of g) and an EAGLE-3 head that reproduces it exactly: test
fixtures for method eagle3 (the tiny models' shape comes from trtspec.testing.tiny.llama_config).

Exact head: the features at position t are e_{x_t}; ``fc`` maps them to e_{g(x_t)}, which is
e_{x_{t+1}} whenever x_{t+1} came from the target; the head's MLP is a lookup table that
advances one-hot states by g (its attention output is zero), so the layer output is
e_{g(x_{t+1})}: the token two ahead, and fed back, the next one, and so on. Its draft
vocabulary is the image of g (d2t maps it back), so every draft the target sees is right.
"""

from __future__ import annotations

from pathlib import Path

import torch


def bigram_map(vocab: int, lo: int = 10, hi: int = 60) -> list[int]:
    """g: every token maps into lo..hi-1 (never a special token such as EOS)."""
    span = hi - lo
    return [lo + (7 * a + 3) % span for a in range(vocab)]


def make_bigram_target(out: Path, tokenizer_from: Path, hidden: int | None = None, layers: int = 2, seed: int = 0) -> Path:
    """A target whose greedy next token depends only on the current token, g(x) = bigram_map,
    with the tokenizer of ``tokenizer_from`` (a test fixture for method eagle3).

    Attention and MLP outputs are zero (o_proj, down_proj = 0), so every layer's output at
    position t is the embedding of x_t and the greedy next token is argmax lm_head(norm(e_x)).
    hidden None: one-hot embeddings (hidden = vocab) and lm_head = the matrix of g, so that is
    exactly g(x) (make_exact_head below drafts it exactly); otherwise random
    embeddings of that width (g is then what they make it)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from trtspec.testing.tiny import llama_config

    tok = AutoTokenizer.from_pretrained(tokenizer_from)
    vocab = 400
    width = hidden or vocab
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(vocab, tok, width, width, layers)).eval()
    g = bigram_map(vocab)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        if hidden is None:
            model.model.embed_tokens.weight.copy_(torch.eye(vocab))
            lm = torch.zeros(vocab, vocab)
            lm[torch.tensor(g), torch.arange(vocab)] = 1.0
            model.lm_head.weight.copy_(lm)
        else:
            model.model.embed_tokens.weight.normal_(0, 1.0)
            model.lm_head.weight.normal_(0, 1.0)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def make_exact_head(target_folder: Path, out: Path) -> Path:
    """The head that reproduces a one-hot bigram target exactly (see the module docstring)."""
    from transformers import AutoConfig

    from trtspec.distill.heads import new_head, save_head
    from trtspec.engines.eagle3_checkpoint import default_layer_ids

    hf = AutoConfig.from_pretrained(target_folder)
    vocab = hf.vocab_size
    g = _bigram_of(target_folder)
    image = sorted(set(g.tolist()))
    layer_ids = default_layer_ids(hf.num_hidden_layers)
    head, config = new_head(hf, target_folder, layer_ids, image, seed=0, anchor=False)
    step = torch.zeros(vocab, vocab)
    step[g, torch.arange(vocab)] = 1.0  # column a is e_{g(a)}
    eye = torch.eye(vocab)
    with torch.no_grad():
        fc = torch.zeros(vocab, len(layer_ids) * vocab)
        fc[:, :vocab] = step  # e_{x_t} -> e_{g(x_t)} from the first feature layer
        head.fc.weight.copy_(fc)
        head.midlayer.self_attn.o_proj.weight.zero_()
        # MLP input: post-norm of a one-hot state, s * e_a; silu(c * s) * s on coordinate a.
        s = float(1.0 / torch.sqrt(torch.tensor(1.0 / vocab) + hf.rms_norm_eps))
        c = 4.0
        m = float(torch.nn.functional.silu(torch.tensor(c * s))) * s
        head.midlayer.mlp.gate_proj.weight.copy_(c * eye)
        head.midlayer.mlp.up_proj.weight.copy_(eye)
        head.midlayer.mlp.down_proj.weight.copy_((step - eye) / m)  # adds e_{g(a)} - e_a
        head.lm_head.weight.copy_(eye[torch.tensor(image)] * 10.0)
    save_head(out, head, config)
    return Path(out)


def serve_exact_eagle3(tmp_path_factory, tiny_ckpts, name: str, **overrides):
    """A real tritonserver serving method eagle3 with a bigram target and its exact head (spec
    overrides as write_spec's), as a generator for fixtures: yields (loaded spec, in-process
    Deployment of the same engines, server, repository), stops the server after. Skips where
    no tritonserver can be installed."""
    from conftest import require_tritonserver, serve_built, write_spec

    from trtspec.spec import load_spec

    require_tritonserver()
    root = tmp_path_factory.mktemp(name)
    target = make_bigram_target(root / "target", tiny_ckpts["target"])
    ckpts = {"target": target, "head": make_exact_head(target, root / "head")}
    loaded = load_spec(write_spec(root / "spec", ckpts, "head", **{"speculative.method": "eagle3", **overrides}))
    for server, deployment, repo in serve_built(loaded, root, root / "backend-cache"):
        yield loaded, deployment, server, repo


def _bigram_of(target_folder: Path) -> torch.Tensor:
    """g as the target holds it: column a of a one-hot target's lm_head is e_{g(a)}."""
    from safetensors.torch import load_file

    return load_file(Path(target_folder) / "model.safetensors")["lm_head.weight"].argmax(dim=0)
