"""Checkpoint intake: resolve a spec's model source to a local Hugging Face folder.

Sources: a Hub repo at a pinned revision (through huggingface_hub, so HF_HUB_OFFLINE and the
HF cache apply), a local folder, or a GGUF file in either (de-quantized by transformers once,
saved as safetensors and cached by the GGUF's sha256). Weights are read from safetensors
only, unless the user opts in to pickle. Draft and target must share one tokenizer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trtspec.cache import cache_root
from trtspec.errors import CheckpointError
from trtspec.files import FileRecord, file_record
from trtspec.gguf_check import check_gguf
from trtspec.spec import LoadedSpec, ModelSpec

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_META_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Checkpoint:
    """A resolved checkpoint: a local HF-format folder and where it came from."""

    role: str
    model: ModelSpec
    folder: Path  # config.json, tokenizer files and weights
    weight_files: list[Path]
    pickle_weights: bool
    source_weights: dict[str, FileRecord]  # what the user pointed at (GGUF or weights)
    gguf: Path | None = None  # the GGUF file the weights were de-quantized from, if any

    def hf_config(self):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.folder, trust_remote_code=self.model.trust_remote_code)
        except ValueError as e:
            raise CheckpointError(
                f"{self.role}: cannot read config.json in {self.folder} ({e}); "
                "if the model needs custom code, set trust_remote_code: true in the spec"
            ) from e

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.folder, trust_remote_code=self.model.trust_remote_code)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{self.role}: no usable tokenizer in {self.folder} ({e}); the checkpoint must ship its tokenizer files"
            ) from e

    def load_state_dict(self) -> dict:
        """All weight tensors of the checkpoint, as stored."""
        import torch
        from safetensors.torch import load_file

        state: dict = {}
        for f in self.weight_files:
            if f.suffix == ".safetensors":
                state.update(load_file(str(f)))
            else:  # only reachable with --allow-pickle
                state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state


def resolve(loaded: LoadedSpec, role: str, allow_pickle: bool = False) -> Checkpoint:
    model = loaded.spec.models()[role]
    if model.repo is not None:
        folder = _download(role, model, allow_pickle)
    else:
        folder = loaded.resolve(model.path)
        if not folder.is_dir():
            if role == "draft" and loaded.spec.speculative.model_draft == "eagle3":
                raise CheckpointError(
                    f"draft.path: {folder} is not a folder; train the EAGLE-3 head there with "
                    f"`trtspec distill {loaded.path}` or point draft at an existing head"
                )
            raise CheckpointError(
                f"{role}.path: {folder} is not a folder; point it at a Hugging Face "
                "checkpoint folder (config.json, tokenizer, *.safetensors) or fix the path"
            )
    if model.gguf_file is not None:
        gguf = folder / model.gguf_file
        if not gguf.is_file():
            raise CheckpointError(f"{role}.gguf_file: {gguf} not found; fix the file name")
        check_gguf(role, gguf)  # a damaged or foreign file: one line naming the tensor, not a traceback
        record = file_record(gguf)
        converted = _convert_gguf(role, folder, model.gguf_file, record.sha256)
        weights = sorted(converted.glob("*.safetensors"))
        return Checkpoint(role, model, converted, weights, False, {model.gguf_file: record}, gguf)
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{role}: {folder} has no config.json; it is not a Hugging Face checkpoint (for a GGUF file set gguf_file)"
        )
    weights, pickled = _weight_files(role, folder, allow_pickle)
    return Checkpoint(role, model, folder, weights, pickled, {f.name: file_record(f) for f in weights})


def _weight_files(role: str, folder: Path, allow_pickle: bool) -> tuple[list[Path], bool]:
    safe = sorted(folder.glob("*.safetensors"))
    if safe:
        return safe, False
    pickled = sorted(f for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES)
    if not pickled:
        raise CheckpointError(f"{role}: no *.safetensors weights in {folder}; add the weights")
    if not allow_pickle:
        names = ", ".join(f.name for f in pickled[:3])
        raise CheckpointError(
            f"{role}: {folder} only has pickle weights ({names}); pickle can run arbitrary "
            "code when loaded. Convert them to safetensors, or pass --allow-pickle if you "
            "trust the source"
        )
    return pickled, True


def _download(role: str, model: ModelSpec, allow_pickle: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = list(_META_PATTERNS)
    patterns += [model.gguf_file] if model.gguf_file else ["*.safetensors"]
    if allow_pickle and not model.gguf_file:
        patterns += [f"*{s}" for s in PICKLE_SUFFIXES]
    try:
        path = snapshot_download(model.repo, revision=model.revision, allow_patterns=patterns)
    except LocalEntryNotFoundError as e:
        raise CheckpointError(
            f"{role}: {model.repo}@{model.revision} is not in the Hugging Face cache and the "
            "Hub cannot be reached (HF_HUB_OFFLINE or no network); download it on a connected "
            "machine (`hf download REPO --revision REV`) or use a local `path`"
        ) from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{role}: cannot fetch {model.repo}@{model.revision} ({type(e).__name__}: {e}); "
            "check the repo id, the revision and your access token"
        ) from e
    return Path(path)


def _convert_gguf(role: str, folder: Path, gguf_file: str, sha256: str) -> Path:
    """De-quantize a GGUF checkpoint into a cached safetensors folder (once per file)."""
    out = cache_root() / "gguf" / sha256[:32]
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype="float32")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        except (ValueError, OSError, KeyError) as e:
            raise CheckpointError(
                f"{role}: transformers cannot load {folder / gguf_file} ({e}); use a GGUF of a "
                "supported architecture, or a safetensors checkpoint"
            ) from e
        # The loaded model is dense float32; drop the GGUF quantizer marker so it saves.
        model.hf_quantizer = None
        model.is_quantized = False
        model.quantization_method = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------- compatibility


@dataclass
class TokenizerReport:
    compatible: bool
    problems: list[str]


def compare_tokenizers(target_tok, draft_tok, sample: int = 5) -> TokenizerReport:
    """Token->id maps equal (added/special included) and BOS/EOS/PAD ids equal."""
    problems = []
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    diff = sorted(
        (tok for tok in set(tv) | set(dv) if tv.get(tok) != dv.get(tok)),
        key=lambda t: min(tv.get(t, 1 << 62), dv.get(t, 1 << 62)),
    )
    if diff:
        shown = ", ".join(f"{t!r}: target {tv.get(t)} / draft {dv.get(t)}" for t in diff[:sample])
        problems.append(f"{len(diff)} token(s) map to different ids (first: {shown})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        a, b = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if a != b:
            problems.append(f"{name} differs: target {a}, draft {b}")
    return TokenizerReport(not problems, problems)


def require_shared_tokenizer(target_tok, draft_tok) -> None:
    """CheckpointError naming the differences when draft and target tokenizers differ."""
    report = compare_tokenizers(target_tok, draft_tok)
    if not report.compatible:
        raise CheckpointError(
            "draft and target tokenizers are incompatible: "
            + "; ".join(report.problems)
            + ". Speculative decoding needs one shared vocabulary: pick a draft from the "
            "same model family"
        )


def check_embedding_rows(role: str, hf_config, tokenizer) -> None:
    """Embedding rows may exceed the tokenizer's vocab (padding) but never fall short."""
    n_tok = len(tokenizer)
    if hf_config.vocab_size < n_tok:
        raise CheckpointError(
            f"{role}: model has {hf_config.vocab_size} embedding rows but its tokenizer has "
            f"{n_tok} tokens; the checkpoint and tokenizer do not belong together"
        )


def parameter_count(weight_files: list[Path]) -> int:
    """Parameters from safetensors headers (no tensor data read)."""
    from safetensors import safe_open

    total = 0
    for f in weight_files:
        if f.suffix != ".safetensors":
            continue
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def estimate_memory(params: int, dtype: str, hf_config, max_batch: int, max_seq: int) -> int:
    """Bytes for weights plus a full KV cache at max_batch x max_seq."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    b = DTYPE_BYTES[dtype]
    kv_bytes = 2 * hf_config.num_hidden_layers * kv * head_dim * max_seq * max_batch * b
    return params * b + kv_bytes
