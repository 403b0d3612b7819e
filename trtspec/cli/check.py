"""`trtspec check SPEC`: resolve checkpoints and report whether they make a valid pair."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from trtspec import console
from trtspec.checkpoints import estimate_memory, parameter_count, resolve
from trtspec.cli.common import AllowPickleOpt, SpecArg, handle_errors
from trtspec.engines.build import check_pair, check_torch_architecture
from trtspec.spec import load_spec


@handle_errors
def check(
    spec: SpecArg,
    allow_pickle: AllowPickleOpt = False,
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Validate SPEC and its checkpoints: architecture, parameters, vocab, dtypes, memory.

    Exits 0 when the pair can be built, 2 with the reasons when it cannot.

    Examples:
      trtspec check engine_specs/smollm2-135m-cpu.yaml
      trtspec check my-spec.yaml --json
    """
    loaded = load_spec(spec)
    with console.step("resolving checkpoints"):
        ckpts = {role: resolve(loaded, role, allow_pickle) for role in loaded.spec.models()}
    with console.step("checking draft/target compatibility"):
        check_pair(ckpts)
    rows = []
    for role, ckpt in ckpts.items():
        cfg = ckpt.hf_config()
        if loaded.spec.backend == "torch":
            check_torch_architecture(role, cfg)
        else:
            from trtspec.engines.trtllm.checks import check_model

            check_model(loaded.spec, role, cfg)
        lim = loaded.spec.limits(role)
        params = parameter_count(ckpt.weight_files)
        rows.append({
            "role": role,
            "source": ckpt.model.source_id + (f"@{ckpt.model.revision}" if ckpt.model.revision else ""),
            "architecture": (cfg.architectures or [cfg.model_type])[0],
            "model_type": cfg.model_type,
            "parameters": params,
            "vocab": len(ckpt.tokenizer()),
            "embedding_rows": cfg.vocab_size,
            "dtype": ckpt.model.dtype,
            "estimated_memory_bytes": estimate_memory(params, ckpt.model.dtype, cfg, lim.max_batch_size, lim.max_seq_len),
        })
    if as_json:
        console.out.print_json(json.dumps({"spec": loaded.spec.name, "ok": True, "models": rows}))
        return
    table = Table(title=f"trtspec check: {loaded.spec.name} (backend {loaded.spec.backend})")
    for col in ("role", "source", "architecture", "parameters", "vocab", "dtype", "est. memory"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["role"], r["source"], r["architecture"], f"{r['parameters'] / 1e6:.1f}M",
            f"{r['vocab']} (rows {r['embedding_rows']})", r["dtype"],
            f"{r['estimated_memory_bytes'] / 2**30:.2f} GiB",
        )
    console.out.print(table)
    method = loaded.spec.speculative
    console.out.print(
        f"OK: method {method.method}, max_draft_len {method.max_draft_len}"
        + ("; tokenizers identical" if "draft" in ckpts else "")
    )
