"""Tiny Llama checkpoints (seeded, about 1 MB) for tests and the tiny-llama spec: the one
factory of test models (llama_config is their shape).

    python -m trtspec.testing.tiny weights/tiny-llama

writes target/, draft/ (the target plus small noise: agrees most of the time), same/ (an
exact copy of the target), unrelated/ (another seed) and other-vocab/ (a model whose
tokenizer differs), each a Hugging Face folder with config, tokenizer and safetensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

CORPUS = """
Speculative decoding makes inference faster without changing its output. A small draft
model proposes several tokens and the large target model checks them all in one pass.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def fibonacci(n):
    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
Summarise the following text in one sentence. Rewrite the paragraph in plain English.
Triton serves models over HTTP and gRPC. TensorRT-LLM builds engines for NVIDIA GPUs.
"""
CHAT_TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]


def make_tokenizer(vocab_size: int = 384, extra_corpus: str = ""):
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS + extra_corpus] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(vocab_size: int, tokenizer, hidden: int = 64, intermediate: int = 160, layers: int = 2, **extra):
    """The tiny Llama shape every test checkpoint has (4 heads, 2 KV heads, 1024 positions,
    untied lm_head), with the special ids of ``tokenizer``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **extra,
    )


def make_model(seed: int, vocab_size: int, noise_from=None, noise: float = 0.0, tokenizer=None):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    # A wide init makes logits peaky, so greedy choices are far from ties.
    model = LlamaForCausalLM(llama_config(vocab_size, tokenizer, initializer_range=0.25)).eval()
    if noise_from is not None:
        with torch.no_grad():
            for p, q in zip(model.parameters(), noise_from.parameters()):
                p.copy_(q + noise * torch.randn_like(q) * q.std())
    return model


def make_tiny_pair(out: Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny checkpoints under ``out``; returns their folders by name."""
    out = Path(out)
    tok = make_tokenizer()
    vocab = 400  # > len(tok): the rows beyond the tokenizer are embedding padding
    target = make_model(seed, vocab, tokenizer=tok)
    models = {
        "target": target,
        "draft": make_model(seed + 1, vocab, noise_from=target, noise=0.03, tokenizer=tok),
        "same": target,
        "unrelated": make_model(seed + 2, vocab, tokenizer=tok),
    }
    folders = {}
    for name, model in models.items():
        folders[name] = out / name
        model.save_pretrained(folders[name], safe_serialization=True)
        tok.save_pretrained(folders[name])
    other_tok = make_tokenizer(extra_corpus="zebra quartz xylophone " * 20)
    folders["other-vocab"] = out / "other-vocab"
    make_model(seed + 3, vocab, tokenizer=other_tok).save_pretrained(folders["other-vocab"])
    other_tok.save_pretrained(folders["other-vocab"])
    return folders


if __name__ == "__main__":
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "weights/tiny-llama")
    for name, folder in make_tiny_pair(dest).items():
        print(f"{name}: {folder}")
