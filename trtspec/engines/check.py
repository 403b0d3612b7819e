"""`trtspec check`: resolve both checkpoints and report whether the backend can build the pair."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from trtspec.checkpoints import DTYPE_BYTES, estimate_memory, parameter_count
from trtspec.engines.build import _llmapi, backend_for, resolve_pair
from trtspec.engines.exports import (
    SGLANG_ADAPTIVE_CONFIG,
    VLLM_METHOD,
    VLLM_TREE_ENV,
    sglang_adaptive_config,
    sglang_args,
    vllm_speculative_config,
)
from trtspec.errors import SpecError
from trtspec.spec import LoadedSpec


@dataclass
class CheckReport:
    spec: str
    backend: str
    method: str
    max_draft_len: int
    models: list[dict] = field(default_factory=list)  # one row per role

    paired: bool = False  # a draft whose tokenizer was compared with the target's
    # The same draft on vLLM and SGLang (engines/exports.py), per engine: its settings, or why
    # it cannot express this draft; empty for drafts without a model (n-gram, suffix).
    elsewhere: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # settings that build but do not do what they say

    def to_dict(self) -> dict:
        return {"spec": self.spec, "ok": True, "models": self.models, "elsewhere": self.elsewhere, "warnings": self.warnings}

    def render(self, out) -> None:
        from rich.table import Table

        table = Table(title=f"trtspec check: {self.spec} (backend {self.backend})")
        for col in ("role", "source", "architecture", "parameters", "vocab", "dtype", "est. memory"):
            table.add_column(col)
        for r in self.models:
            saved = r.get("quantization_saves_bytes")
            table.add_row(
                r["role"],
                r["source"],
                r["architecture"],
                f"{r['parameters'] / 1e6:.1f}M",
                f"{r['vocab']} (rows {r['embedding_rows']})",
                r["dtype"] + (f" + {r['quantization']}" if r["quantization"] != "none" else ""),
                f"{r['estimated_memory_bytes'] / 2**30:.2f} GiB"
                + (f" ({r['quantization']} saves {saved / 2**20:.0f} MiB)" if saved is not None else ""),
            )
        out.print(table)
        for w in self.warnings:
            out.print(f"warning: {w}", soft_wrap=True)
        out.print(
            f"OK: method {self.method}, max_draft_len {self.max_draft_len}"
            + (
                ""
                if not self.paired
                else "; EAGLE-3 head made for this target"
                if self.method == "eagle3"
                else "; tokenizers identical"
            )
        )
        vllm, sglang = self.elsewhere.get("vllm"), self.elsewhere.get("sglang")
        if vllm is not None:
            env = "".join(f"{k}={v} " for k, v in vllm.get("env", {}).items())
            out.print(
                f"the same draft on vLLM: {env}vllm serve {self.elsewhere['target']} --speculative-config '{json.dumps(vllm['speculative_config'])}'"
                if "speculative_config" in vllm
                else f"vLLM: {vllm['error']}",
                soft_wrap=True,
            )
        if sglang is not None:
            out.print(
                f"the same draft on SGLang: python -m sglang.launch_server --model-path {self.elsewhere['target']} "
                + " ".join(sglang["args"])
                if "args" in sglang
                else f"SGLang: {sglang['error']}",
                soft_wrap=True,
            )
            for name, content in sglang.get("files", {}).items():  # written beside the command
                out.print(f"  with {name}: {json.dumps(content)}", soft_wrap=True)


def check(loaded: LoadedSpec, allow_pickle: bool = False) -> CheckReport:
    """Resolve, pair-check and backend-check both checkpoints; raises with the reason."""
    spec = loaded.spec
    llmapi = _llmapi(loaded)
    if llmapi is not None:  # the LLM API's own checks (an EAGLE-3 head has no tokenizer)
        checkpoints = llmapi.resolve_and_check(loaded, allow_pickle)
        backend = None
    else:
        checkpoints = resolve_pair(loaded, allow_pickle)
        backend = backend_for(spec.backend)
    report = CheckReport(spec.name, spec.backend, spec.speculative.method, spec.speculative.max_draft_len)
    report.warnings = schedule_warnings(spec.speculative.schedule, spec.limits("target").max_batch_size)
    eagle3 = spec.speculative.model_draft == "eagle3"
    report.paired = "draft" in checkpoints and not eagle3
    for role, ckpt in checkpoints.items():
        cfg = ckpt.hf_config()
        if backend is not None:
            backend.check_model(loaded, role, cfg)
        lim = spec.limits(role)
        params = parameter_count(ckpt.weight_files)
        memory = estimate_memory(params, ckpt.model.dtype, cfg, lim.max_batch_size, lim.max_seq_len)
        quantization = ckpt.model.quantization
        saved = None
        if spec.backend == "torch" and quantization != "none":  # TensorRT-LLM sizes its own
            from trtspec.engines.torch.quant import bytes_saved

            saved = bytes_saved(cfg, quantization, DTYPE_BYTES[ckpt.model.dtype])
            memory -= saved
        report.models.append(
            {
                "role": role,
                "source": ckpt.model.source_id + (f"@{ckpt.model.revision}" if ckpt.model.revision else ""),
                "architecture": (cfg.architectures or [cfg.model_type])[0],
                "model_type": cfg.model_type,
                "parameters": params,
                # An EAGLE-3 head has no tokenizer: its vocabulary is the reduced draft vocabulary.
                "vocab": (getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
                if role == "draft" and eagle3
                else len(ckpt.tokenizer()),
                "embedding_rows": cfg.vocab_size,
                "dtype": ckpt.model.dtype,
                "quantization": quantization,
                "estimated_memory_bytes": memory,  # weights (as the engine stores them) + a full KV cache
                **({"quantization_saves_bytes": saved} if saved is not None else {}),
            }
        )
    if "draft" in checkpoints and spec.speculative.method in VLLM_METHOD:
        target, draft = str(checkpoints["target"].folder), str(checkpoints["draft"].folder)
        report.elsewhere = _elsewhere(spec.speculative, target, draft, spec.limits("target").max_batch_size)
    return report


def schedule_warnings(schedule: dict[int, int] | None, max_batch_size: int) -> list[str]:
    """A schedule threshold no step can reach: served, an instance runs at most max_batch_size
    sequences (the rest wait for a place and are not counted), as TensorRT-LLM and vLLM do."""
    dead = sorted(n for n in schedule or {} if n > max_batch_size)
    if not dead:
        return []
    return [
        f"speculative.schedule: threshold {', '.join(map(str, dead))} is above build.max_batch_size ({max_batch_size}) "
        f"and never fires served: no step runs more than {max_batch_size} sequences (requests beyond them wait for a "
        f"place and are not counted, as in TensorRT-LLM and vLLM); lower it to <= {max_batch_size} or raise build.max_batch_size"
    ]


def _elsewhere(s, target: str, draft: str, max_batch_size: int) -> dict:
    """vLLM's speculative_config and SGLang's flags (and adaptive config file) for this draft
    (``target``, ``draft``: the resolved checkpoint folders), or why each cannot have it."""
    out: dict = {"target": target}
    try:
        cfg = vllm_speculative_config(s, draft, max_batch_size)
        out["vllm"] = {"speculative_config": cfg} | ({"env": VLLM_TREE_ENV} if s.tree else {})
    except SpecError as e:
        out["vllm"] = {"error": str(e)}
    try:
        out["sglang"] = {"args": sglang_args(s, draft)}
        if s.adaptive:  # the file --speculative-adaptive-config names
            out["sglang"]["files"] = {SGLANG_ADAPTIVE_CONFIG: sglang_adaptive_config(s)}
    except SpecError as e:
        out["sglang"] = {"error": str(e)}
    return out
