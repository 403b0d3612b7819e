"""`trtspec verify` as one library call: check the options, open the backend (in process or a
served repository), compare both paths on every prompt, apply the acceptance gate and the
sampling test when asked, and return the outcome; the CLI only parses and prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import RequestError
from trtspec.spec import LoadedSpec
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.speculative.requests import draft_tokens
from trtspec.speculative.sampling import SamplingParams
from trtspec.verify import html_report
from trtspec.verify.acceptance import GateResult, identity, load_baseline
from trtspec.verify.acceptance import check as check_acceptance
from trtspec.verify.backends import open_backend
from trtspec.verify.identity import VerifyReport, run_verify
from trtspec.verify.reports import render_table, write_junit
from trtspec.verify.sampling import SamplingCheck, check_deployment, check_sample_count, check_url

# progress(phase, done, total): "verifying prompts" over prompts, then "sampling" over samples.
Progress = Callable[[str, int, int], None]


@dataclass
class VerifyOptions:
    prompts: list[str] | None = None  # None: the spec's verify prompts
    max_tokens: int | None = None  # None: the spec's verify.max_tokens
    num_draft_tokens: int | None = None  # None: the spec's k (speculative.requests.draft_tokens)
    url: str | None = None  # HOST:PORT of a served repository; None: in process
    stream: bool = False  # with url: the speculative path from the streaming endpoint
    fail_on: str = "any"  # "any" or "algorithmic" (numerical divergences tolerated)
    baseline: Path | None = None  # a previous `verify --json` report to gate acceptance against ...
    max_acceptance_drop: float | None = None  # ... with this relative drop allowed
    min_acceptance_length: float | None = None
    samples: int | None = None  # --sampling N: N samples per prompt, tested against the target
    sampling: SamplingParams | None = None  # with samples; None: temperature 1, no cuts, seed 0
    tie_epsilon: float | None = None  # None: per target dtype (verify/verdicts.py)
    llmapi_impl: str = TENSORRT_LLM  # trtllm.runtime llmapi in process: the library or DOUBLE
    html_file: Path | None = None  # the page is written after the run; a folder is refused before it


@dataclass
class VerifyOutcome:
    """The identity report plus the acceptance gate and the sampling test, when run."""

    report: VerifyReport
    gate: GateResult | None
    sampled: SamplingCheck | None
    fail_on: str
    token_text: Callable[[int], str]  # the backend's tokenizer (the HTML page shows token texts)

    @property
    def passed(self) -> bool:
        return (
            self.report.passes(self.fail_on)
            and (self.gate is None or self.gate.passed)
            and (self.sampled is None or self.sampled.passed)
        )

    def to_dict(self) -> dict:
        data = self.report.to_dict()
        if self.gate is not None:
            data["acceptance_gate"] = self.gate.to_dict()
        if self.sampled is not None:
            data["sampling"] = self.sampled.to_dict()
        return data

    def render(self, out) -> None:
        render_table(self.report, out)
        for line in self.gate.lines if self.gate else []:
            out.print(line, markup=False)
        if self.sampled is not None:
            out.print(self.sampled.describe(), markup=False)

    def write_junit(self, path: Path) -> None:
        write_junit(self.report, path, self.fail_on)

    def write_html(self, path: Path, machine: str) -> None:
        html_report.write(path, self.to_dict(), self.token_text, machine=machine, fail_on=self.fail_on, passed=self.passed)


def run(loaded: LoadedSpec, engines_dir: Path, opts: VerifyOptions, progress: Progress | None = None) -> VerifyOutcome:
    """Verify ``loaded``'s deployment; every option mistake is refused before the engines load."""
    tick = progress or (lambda phase, done, total: None)
    prompts = list(opts.prompts) if opts.prompts else loaded.verify_prompts()
    drop = opts.max_acceptance_drop
    if (drop is None) != (opts.baseline is None):
        raise RequestError(
            "--baseline and --max-acceptance-drop go together: pass both (e.g. --baseline previous.json --max-acceptance-drop 5%)"
        )
    if not prompts:
        raise RequestError("no prompts to verify: add verify.prompts to the spec or pass --prompt")
    n_tokens = opts.max_tokens if opts.max_tokens is not None else loaded.spec.verify.max_tokens
    html = opts.html_file
    if html is not None and html.is_dir():
        raise RequestError(f"--html {html} is a folder; give a file path (e.g. {html / 'report.html'})")
    if opts.samples is not None:
        check_sample_count(opts.samples, len(prompts))
    k = draft_tokens(opts.num_draft_tokens, loaded.spec.speculative.default_draft_tokens)
    prompt_set = _prompt_set_name(loaded, opts.prompts)
    # A baseline that cannot compare is refused before minutes of generation, not after.
    base = None
    if opts.baseline is not None:
        base = load_baseline(opts.baseline, identity(loaded.spec.name, prompts, prompt_set, k, n_tokens))
    # The backends get the k as asked (None: the deployment's default, filled in by the request
    # rules in process, by the orchestrator over --url; the LLM API takes none).
    backend, mode = open_backend(
        loaded, engines_dir, opts.url, opts.stream, opts.num_draft_tokens, opts.tie_epsilon, opts.llmapi_impl
    )
    tick("verifying prompts", 0, len(prompts))
    report = run_verify(
        backend,
        prompts,
        n_tokens,
        loaded.spec.name,
        mode=mode,
        progress=lambda i, n: tick("verifying prompts", i, n),
        prompt_set=prompt_set,
        num_draft_tokens=k,
    )
    gate = None
    if opts.baseline is not None or opts.min_acceptance_length is not None:
        gate = check_acceptance(report.to_dict(), base, drop, opts.min_acceptance_length)
    sampled = None
    if opts.samples is not None:
        params = opts.sampling or SamplingParams()
        tick("sampling", 0, opts.samples * len(prompts))
        on_sample = lambda i, n: tick("sampling", i, n)  # noqa: E731
        if opts.url is None:
            sampled = check_deployment(backend.dep, prompts, opts.samples, n_tokens, params, opts.num_draft_tokens, on_sample)
        else:
            sampled = check_url(loaded, engines_dir, backend, prompts, opts.samples, n_tokens, params, on_sample)
    return VerifyOutcome(report, gate, sampled, opts.fail_on, backend.token_text)


def _prompt_set_name(loaded: LoadedSpec, prompt: list[str] | None) -> str:
    if prompt:
        return "--prompt"
    where = [f"{loaded.path.name} verify.prompts"] if loaded.spec.verify.prompts else []
    if loaded.spec.verify.prompts_file:
        where.append(loaded.spec.verify.prompts_file)
    return " + ".join(where)
