"""`trtspec verify`: prove greedy speculative outputs are token-identical to target-only.

Per prompt, both paths run greedily and are compared by token id. At the first divergence
the report gives its index, both tokens (id and text) and the target's top-1 minus top-2
logit margin there, so a numerical near-tie is told apart from a bug. Runs are interleaved
per prompt (alternating which path goes first) after a warm-up, so noise hits both alike;
in process, engine prefix caches are emptied before every timed run.
"""

from __future__ import annotations

import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from trtspec import console
from trtspec.acceptance import identity
from trtspec.errors import EngineError, RequestError
from trtspec.files import write_json_atomic, write_text_atomic
from trtspec.layout import tokenizer_folder
from trtspec.speculative.loop import PathRun
from trtspec.speculative.metrics import SpecMetrics
from trtspec.verdicts import DEFAULT_EPSILON, DivergenceVerdict, classify, replay


class VerifyBackend(Protocol):
    """Runs one prompt on one path; in process or over gRPC."""

    def run(self, prompt: str, max_tokens: int, speculative: bool) -> PathRun: ...

    def token_text(self, token_id: int) -> str: ...

    # Optional: classify(target, spec, div) -> DivergenceVerdict (trtspec.verdicts). A backend
    # without it (gRPC: the served endpoints return neither step boundaries nor logits)
    # leaves divergences unclassified, which fail under every --fail-on.


@dataclass
class Divergence:
    index: int
    target_id: int | None  # None: the path had already ended
    target_text: str
    spec_id: int | None
    spec_text: str
    target_margin: float | None  # target-only run's top-1 minus top-2 logit at index
    spec_margin: float | None
    verdict: DivergenceVerdict | None = None

    @property
    def verdict_class(self) -> str:
        return self.verdict.verdict if self.verdict else "unclassified"

    def describe(self) -> str:
        margin = "n/a" if self.target_margin is None else f"{self.target_margin:.4g}"
        text = (
            f"token {self.index}: target {self.target_id} {self.target_text!r} vs speculative "
            f"{self.spec_id} {self.spec_text!r} (target top-2 margin {margin})"
        )
        if self.verdict:
            text += f"; {self.verdict.verdict}: {self.verdict.reason}"
        return text


@dataclass
class PromptResult:
    index: int
    prompt: str
    identical: bool
    target_tokens: int
    spec_tokens: int
    target_seconds: float
    spec_seconds: float
    divergence: Divergence | None
    metrics: SpecMetrics | None
    target_ids: list[int] = field(repr=False, default_factory=list)
    spec_ids: list[int] = field(repr=False, default_factory=list)
    # (first output index, drafts) per speculative step; empty where the backend does not say (--url)
    spec_steps: list[tuple[int, int]] = field(repr=False, default_factory=list)


@dataclass
class VerifyReport:
    spec_name: str
    mode: str  # "in-process" or "grpc://host:port"
    max_tokens: int
    results: list[PromptResult]
    prompt_set: str = "prompts"  # where the prompts came from, for gate messages
    num_draft_tokens: int | None = None  # k the speculative path was asked for

    @property
    def identical(self) -> bool:
        return all(r.identical for r in self.results)

    def count(self, verdict: str) -> int:
        return sum(r.divergence is not None and r.divergence.verdict_class == verdict for r in self.results)

    def passes(self, fail_on: str = "any") -> bool:
        """``any``: every prompt identical. ``algorithmic``: numerical divergences (near-ties
        flipped by the forward's shape) are tolerated; algorithmic and unclassified are not."""
        if fail_on == "any":
            return self.identical
        return all(r.divergence is None or r.divergence.verdict_class == "numerical" for r in self.results)

    @property
    def metrics(self) -> SpecMetrics:
        total = SpecMetrics()
        for r in self.results:
            if r.metrics is not None:
                total = total.merge(r.metrics)
        return total

    def tokens_per_second(self, path: str) -> float:
        toks = sum(r.target_tokens if path == "target" else r.spec_tokens for r in self.results)
        secs = sum(r.target_seconds if path == "target" else r.spec_seconds for r in self.results)
        return toks / secs if secs > 0 else 0.0

    @property
    def speedup(self) -> float:
        base = self.tokens_per_second("target")
        return self.tokens_per_second("speculative") / base if base > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            **identity(self.spec_name, [r.prompt for r in self.results], self.prompt_set, self.num_draft_tokens, self.max_tokens),
            "mode": self.mode,
            "identical": self.identical,
            "diverged": sum(not r.identical for r in self.results),
            "verdicts": {v: self.count(v) for v in ("numerical", "algorithmic", "unclassified")},
            "target_tokens_per_s": self.tokens_per_second("target"),
            "speculative_tokens_per_s": self.tokens_per_second("speculative"),
            "speedup": self.speedup,
            "metrics": self.metrics.to_dict(),
            "results": [
                {
                    "index": r.index,
                    "prompt": r.prompt,
                    "identical": r.identical,
                    "target_tokens": r.target_tokens,
                    "spec_tokens": r.spec_tokens,
                    "target_seconds": r.target_seconds,
                    "spec_seconds": r.spec_seconds,
                    "divergence": asdict(r.divergence) if r.divergence else None,
                    "metrics": r.metrics.to_dict() if r.metrics else None,
                    "target_ids": r.target_ids,
                    "spec_ids": r.spec_ids,
                    "spec_steps": [list(step) for step in r.spec_steps],
                }
                for r in self.results
            ],
        }


def first_divergence(target: PathRun, spec: PathRun, text) -> Divergence | None:
    a, b = target.output_ids, spec.output_ids
    for i in range(max(len(a), len(b))):
        ta = a[i] if i < len(a) else None
        tb = b[i] if i < len(b) else None
        if ta != tb:
            return Divergence(
                index=i,
                target_id=ta,
                target_text=text(ta) if ta is not None else "<end>",
                spec_id=tb,
                spec_text=text(tb) if tb is not None else "<end>",
                target_margin=target.margins[i] if i < len(target.margins) else None,
                spec_margin=spec.margins[i] if i < len(spec.margins) else None,
            )
    return None


def _classify(backend, target: PathRun, spec: PathRun, div: Divergence) -> DivergenceVerdict:
    if hasattr(backend, "classify"):
        return backend.classify(target, spec, div)
    return DivergenceVerdict(
        "unclassified",
        "over --url the target cannot be replayed; run `trtspec verify SPEC` in process to class it",
        None,
    )


def run_verify(
    backend: VerifyBackend,
    prompts: list[str],
    max_tokens: int,
    spec_name: str,
    mode: str = "in-process",
    progress=None,
    prompt_set: str = "prompts",
    num_draft_tokens: int | None = None,
) -> VerifyReport:
    """Compare both paths on every prompt; ``progress(i, n)`` is called after each."""
    # Warm-up (untimed): first calls pay allocation and lazy-initialisation costs.
    backend.run(prompts[0], min(max_tokens, 4), speculative=False)
    backend.run(prompts[0], min(max_tokens, 4), speculative=True)
    results = []
    for i, prompt in enumerate(prompts):
        # Alternate which path goes first: a server's prefix cache (which trtspec cannot empty
        # over gRPC) then favours neither path.
        if i % 2 == 0:
            target = backend.run(prompt, max_tokens, speculative=False)
            spec = backend.run(prompt, max_tokens, speculative=True)
        else:
            spec = backend.run(prompt, max_tokens, speculative=True)
            target = backend.run(prompt, max_tokens, speculative=False)
        div = first_divergence(target, spec, backend.token_text)
        if div is not None:
            div.verdict = _classify(backend, target, spec, div)
        results.append(
            PromptResult(
                index=i,
                prompt=prompt,
                identical=div is None,
                target_tokens=len(target.output_ids),
                spec_tokens=len(spec.output_ids),
                target_seconds=target.seconds,
                spec_seconds=spec.seconds,
                divergence=div,
                metrics=spec.metrics,
                target_ids=target.output_ids,
                spec_ids=spec.output_ids,
                spec_steps=list(spec.steps or []),
            )
        )
        if progress:
            progress(i + 1, len(prompts))
    return VerifyReport(spec_name, mode, max_tokens, results, prompt_set, num_draft_tokens)


class InProcessBackend:
    """VerifyBackend over a loaded Deployment (torch engines in this process)."""

    def __init__(
        self,
        deployment,
        chat_template: bool | None = None,
        num_draft_tokens: int | None = None,
        epsilon: float | None = None,
    ):
        self.dep = deployment
        self.chat_template = chat_template
        self.k = num_draft_tokens
        self.epsilon = epsilon if epsilon is not None else DEFAULT_EPSILON[deployment.target.manifest.dtype]

    def run(self, prompt: str, max_tokens: int, speculative: bool) -> PathRun:
        ids = self.dep.encode(prompt, self.chat_template)
        req = self.dep.request(ids, max_tokens, self.k)
        self.dep.forget_prefixes()  # neither path may reuse the other's prefill of this prompt
        start = time.perf_counter()
        (res,) = self.dep.generate([req], speculative=speculative)
        seconds = time.perf_counter() - start
        return PathRun(res.output_ids, res.margins, res.metrics if speculative else None, seconds, ids, res.steps)

    def token_text(self, token_id: int) -> str:
        return self.dep.tokenizer.decode([token_id])

    def classify(self, target: PathRun, spec: PathRun, div: Divergence) -> DivergenceVerdict:
        steps = spec.steps or []
        if not any(s <= div.index <= s + k for s, k in steps):
            return DivergenceVerdict("algorithmic", f"no speculative step produced token {div.index}", self.epsilon)
        engine = self.dep.target
        rep = replay(engine.run, engine.forget_prefixes, spec.prompt_ids, spec.output_ids, steps, div.index)
        return classify(rep, div.target_id, div.spec_id, self.dep.end_ids, self.epsilon)


class LlmapiBackend:
    """VerifyBackend over a runtime.LlmapiDeployment (the LLM API in this process)."""

    def __init__(self, dep, chat_template: bool | None = None):
        self.dep = dep
        self.chat_template = dep.spec.verify.chat_template if chat_template is None else chat_template

    def run(self, prompt: str, max_tokens: int, speculative: bool) -> PathRun:
        from trtspec.speculative.llmapi import acceptance
        from trtspec.speculative.requests import encode_prompt

        ids = encode_prompt(self.dep.tokenizer, prompt, self.chat_template)
        start = time.perf_counter()
        out = self.dep.generate(ids, max_tokens, speculative)
        seconds = time.perf_counter() - start
        metrics = None
        counts = acceptance(out) if speculative else None
        if counts is not None:
            # The LLM API reports whole-request totals only: no per-step or per-position counts.
            metrics = SpecMetrics(drafted=counts[1], accepted=counts[0])
        ids_out = [int(t) for t in out.token_ids]
        return PathRun(ids_out, [None] * len(ids_out), metrics, seconds)

    def token_text(self, token_id: int) -> str:
        return self.dep.tokenizer.decode([token_id])


def open_backend(
    loaded,
    engines_dir: Path,
    url: str | None = None,
    stream: bool = False,
    num_draft_tokens: int | None = None,
    epsilon: float | None = None,
    llmapi_impl: str = "tensorrt_llm",
) -> tuple[VerifyBackend, str]:
    """The backend verify runs on, and its mode line: the engines in this process (for
    trtllm.runtime llmapi: the LLM API, real or the double), or a served repository over gRPC
    (token texts from the local tokenizer when there is one)."""
    if stream and url is None:
        raise RequestError("--stream verifies a server's streaming endpoint; add --url HOST:PORT")
    llmapi = loaded.spec.backend == "trtllm" and loaded.spec.trtllm.runtime == "llmapi"
    if url is None and llmapi:
        from trtspec.runtime import LlmapiDeployment

        if num_draft_tokens is not None:
            raise RequestError("--num-draft-tokens: the LLM API drafts max_draft_len tokens; drop the flag")
        with console.step(f"loading both LLM API configurations ({llmapi_impl})"):
            dep = LlmapiDeployment(loaded, engines_dir, llmapi_impl)
        label = "llmapi conformance double, not TensorRT-LLM" if dep.api.is_double else f"tensorrt_llm {dep.api.__version__}"
        return LlmapiBackend(dep), f"in-process ({label})"
    if url is None:
        from trtspec.runtime import Deployment

        with console.step("loading engines"):
            dep = Deployment(loaded, engines_dir)
        return InProcessBackend(dep, num_draft_tokens=num_draft_tokens, epsilon=epsilon), "in-process"
    from trtspec.triton.client import GrpcBackend

    tokenizer = None
    folder = tokenizer_folder(engines_dir, loaded.spec.backend)
    if llmapi:  # the LLM API reads the tokenizer from the target checkpoint
        from trtspec.engines.trtllm.llmapi import FOLDER, read_manifest

        try:
            folder = Path(read_manifest(engines_dir / FOLDER, loaded.spec).checkpoints["target"])
        except EngineError:
            pass
    if (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    with console.step(f"connecting to {url}"):
        backend = GrpcBackend(url, tokenizer, loaded.spec.verify.chat_template, num_draft_tokens, stream)
    return backend, f"grpc://{url}" + (" streaming" if stream else "")


# ----------------------------------------------------------------------- reports


def render_table(report: VerifyReport, console) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"trtspec verify: {report.spec_name} ({report.mode}, max_tokens {report.max_tokens})")
    for col in ("#", "prompt", "identical", "tokens", "accepted/drafted", "mean acc. len", "first divergence"):
        table.add_column(col, overflow="fold")
    for r in report.results:
        m = r.metrics
        table.add_row(
            str(r.index),
            Text(_short(r.prompt, 40)),
            "yes" if r.identical else _verdict_cell(r.divergence),
            f"{r.target_tokens}/{r.spec_tokens}",
            f"{m.accepted}/{m.drafted}" if m else "-",
            f"{m.mean_acceptance_length:.2f}" if m else "-",
            Text(r.divergence.describe()) if r.divergence else "",
        )
    console.print(table)
    m = report.metrics
    n_bad = sum(not r.identical for r in report.results)
    verdict = (
        "all identical"
        if report.identical
        else (
            f"[red]{n_bad} of {len(report.results)} diverged[/red] ("
            + ", ".join(f"{report.count(v)} {v}" for v in ("numerical", "algorithmic", "unclassified") if report.count(v))
            + ")"
        )
    )
    console.print(
        f"{len(report.results)} prompts: {verdict} | acceptance rate {m.acceptance_rate:.3f} "
        f"({m.accepted}/{m.drafted}) | mean acceptance length {m.mean_acceptance_length:.2f} "
        f"tokens/target forward | per-position "
        f"[{', '.join(f'{x:.2f}' for x in m.per_position_rate)}]"
    )
    console.print(
        f"target-only {report.tokens_per_second('target'):.1f} tok/s | speculative "
        f"{report.tokens_per_second('speculative'):.1f} tok/s | speedup {report.speedup:.2f}x"
    )


def _verdict_cell(div: Divergence) -> str:
    if div.verdict_class == "numerical":
        return "[yellow]NO (numerical)[/yellow]"
    return f"[red]NO ({div.verdict_class})[/red]"


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def write_json(report: VerifyReport, path: Path) -> None:
    write_json_atomic(path, report.to_dict())


def write_junit(report: VerifyReport, path: Path, fail_on: str = "any") -> None:
    """One testcase per prompt; a divergence is a failure (type = its verdict class) with its
    description. With ``fail_on="algorithmic"`` a numerical divergence passes and is
    described in the testcase's system-out."""

    def failed(r: PromptResult) -> bool:
        return r.divergence is not None and (fail_on == "any" or r.divergence.verdict_class != "numerical")

    failures = sum(failed(r) for r in report.results)
    suite = ET.Element(
        "testsuite",
        name=f"trtspec.verify.{report.spec_name}",
        tests=str(len(report.results)),
        failures=str(failures),
        errors="0",
        time=f"{sum(r.target_seconds + r.spec_seconds for r in report.results):.3f}",
    )
    for r in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"trtspec.verify.{report.spec_name}",
            name=f"prompt_{r.index}",
            time=f"{r.target_seconds + r.spec_seconds:.3f}",
        )
        if r.divergence:
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="verdict", value=r.divergence.verdict_class)
            if r.divergence.verdict:
                for key, value in r.divergence.verdict.evidence.items():
                    ET.SubElement(props, "property", name=key, value=str(value))
        if failed(r):
            fail = ET.SubElement(case, "failure", message=r.divergence.describe(), type=r.divergence.verdict_class)
            fail.text = f"prompt: {r.prompt}\n{r.divergence.describe()}"
        out = ET.SubElement(case, "system-out")
        out.text = f"prompt: {r.prompt}\ntokens: target {r.target_tokens}, speculative {r.spec_tokens}"
        if r.divergence and not failed(r):
            out.text += f"\ntolerated divergence: {r.divergence.describe()}"
    root = ET.Element("testsuites")
    root.append(suite)
    data = ET.tostring(root, encoding="unicode", xml_declaration=True)
    write_text_atomic(path, data + "\n")
