"""Acceptance regression gate: fail verify when speculation stops paying.

Identity proves speculative output is right; acceptance says whether it is worth running. A
draft model swapped, a tokenizer change or a drafter bug that proposes worse tokens keeps
outputs identical and silently costs speed. The gate compares this run with a previous
`verify --json` report of the same spec, prompt set, k and max_tokens:

  acceptance drop   (baseline rate - current rate) / baseline rate, with
                    rate = accepted / drafted (speculative/metrics.py); fails above the limit
  min length        mean acceptance length (tokens per target forward incl. the bonus);
                    fails below the limit (no baseline needed)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import RequestError


def prompt_set_digest(prompts: list[str]) -> str:
    """Identity of a prompt set: sha256 over the prompts in order (first 16 hex digits)."""
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()[:16]


def parse_fraction(text: str) -> float:
    """``5%`` or ``0.05`` -> 0.05; RequestError (exit 2) for anything else."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise RequestError(f"--max-acceptance-drop takes a percentage or a fraction in 0..1 (e.g. 5% or 0.05), not {text!r}")
    return value


def identity(spec: str, prompts: list[str], prompt_set: str, num_draft_tokens: int | None, max_tokens: int) -> dict:
    """What makes two verify reports' acceptance comparable (part of every JSON report)."""
    return {
        "spec": spec,
        "max_tokens": max_tokens,
        "num_draft_tokens": num_draft_tokens,
        "prompt_set": prompt_set,
        "prompt_set_sha256": prompt_set_digest(prompts),
        "prompts": len(prompts),
    }


@dataclass
class GateResult:
    passed: bool
    lines: list[str]  # one per check, pass or fail, each naming the prompt set and figures

    def to_dict(self) -> dict:
        return {"passed": self.passed, "checks": self.lines}


_SAME = ("spec", "prompt_set_sha256", "num_draft_tokens", "max_tokens")


def load_baseline(path: Path, current: dict) -> dict:
    """A previous report comparable with ``current`` (an identity() dict, checked before the
    run; a None value, num_draft_tokens before the deployment decided it, is checked after it
    by :func:`check_same`); else RequestError naming what differs and how to get a comparable
    baseline."""
    try:
        base = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RequestError(f"--baseline {path}: no such file; pass a report written by `trtspec verify --json`") from None
    except (OSError, ValueError) as err:
        raise RequestError(
            f"--baseline {path}: not a JSON verify report ({err}); pass a file written by `trtspec verify --json`"
        ) from None
    if not isinstance(base, dict) or not isinstance(base.get("metrics"), dict) or any(k not in base for k in _SAME):
        raise RequestError(
            f"--baseline {path} is not a trtspec verify report with acceptance figures (or predates them); "
            "write one with `trtspec verify SPEC --json previous.json`"
        )
    check_same(path, base, current)
    return base


def check_same(path: Path, base: dict, current: dict) -> None:
    """RequestError naming the first of ``current``'s known identity values (not None) that
    the baseline report ``base`` (read from ``path``) does not share."""
    for key in _SAME:
        if current[key] is not None and base[key] != current[key]:
            what = "prompt set" if key == "prompt_set_sha256" else key.replace("_", " ")
            mine, theirs = current[key], base[key]
            if key == "prompt_set_sha256":
                mine, theirs = _prompt_set(current), _prompt_set(base)
            raise RequestError(
                f"--baseline {path} was measured with another {what} ({theirs}; this run: {mine}); "
                "acceptance figures only compare on the same spec, prompts, k and max_tokens — "
                "re-run the baseline with the same options"
            )


def _prompt_set(report: dict) -> str:
    return f"{report.get('prompt_set', '?')} [{report['prompts']} prompts, sha256 {report['prompt_set_sha256']}]"


def check(current: dict, baseline: dict | None, max_drop: float | None, min_length: float | None) -> GateResult:
    """Apply the gates to report dicts; each line names the prompt set and both figures."""
    lines, passed = [], True
    where = _prompt_set(current)
    m = current["metrics"]
    if baseline is not None and max_drop is not None:
        old, new = baseline["metrics"]["acceptance_rate"], m["acceptance_rate"]
        drop = (old - new) / old if old > 0 else 0.0
        ok = drop <= max_drop
        passed &= ok
        lines.append(
            f"{'ok' if ok else 'FAILED'}: acceptance rate on {where}: baseline {old:.4f} -> now {new:.4f} "
            f"({drop:+.1%} drop; at most {max_drop:.1%} allowed)"
        )
    if min_length is not None:
        new = m["mean_acceptance_length"]
        old = f"baseline {baseline['metrics']['mean_acceptance_length']:.3f}, " if baseline else ""
        ok = new >= min_length
        passed &= ok
        lines.append(
            f"{'ok' if ok else 'FAILED'}: mean acceptance length on {where}: {old}now {new:.3f} "
            f"tokens/target forward (at least {min_length:g} required)"
        )
    return GateResult(passed, lines)
