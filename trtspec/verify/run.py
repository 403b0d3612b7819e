"""`trtspec verify` as one library call: check the options, open the backend (in process or a
served repository), compare both paths on every prompt, apply the acceptance gate and the
sampling test when asked, and return the outcome; the CLI only parses and prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trtspec.errors import RequestError
from trtspec.spec import LoadedSpec
from trtspec.speculative.llmapi import TENSORRT_LLM
from trtspec.speculative.sampling import SamplingParams
from trtspec.triton.client import parse_url
from trtspec.verify import html_report
from trtspec.verify.acceptance import GateResult, check_same, identity, load_baseline, parse_fraction
from trtspec.verify.acceptance import check as check_acceptance
from trtspec.verify.backends import open_backend
from trtspec.verify.identity import VerifyReport, run_verify
from trtspec.verify.reports import render_table, write_junit
from trtspec.verify.sampling import SamplingCheck, check_deployment, check_sample_count, check_url

# progress(phase, done, total): "verifying prompts" over prompts, then "sampling" over samples.
Progress = Callable[[str, int, int], None]


class VerifyOptions(BaseModel):
    """What `trtspec verify` is asked: each value's type, default and bounds (the command's
    flags, trtspec/cli/verify.py, are validated into it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: list[str] | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    num_draft_tokens: Annotated[int | None, Field(ge=0)] = None  # None: the spec's default_draft_tokens
    url: str | None = None
    stream: bool = False
    fail_on: Literal["any", "algorithmic"] = "any"
    baseline: Path | None = None
    max_acceptance_drop: float | None = None
    min_acceptance_length: Annotated[float | None, Field(ge=1.0)] = None
    samples: Annotated[int | None, Field(ge=1)] = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    tie_epsilon: Annotated[float | None, Field(ge=0.0)] = None  # None: per target dtype (verify/verdicts.py)
    html_file: Path | None = None  # the page is written after the run; a folder is refused before it
    llmapi_impl: str = TENSORRT_LLM  # trtllm.runtime llmapi in process: the library or DOUBLE

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return parse_url(v)

    @field_validator("max_acceptance_drop", mode="before")
    @classmethod
    def _drop(cls, v):
        return parse_fraction(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _sampling_flags(self) -> VerifyOptions:
        if self.samples is None:
            given = [
                f"--{n.replace('_', '-')}" for n in ("temperature", "top_k", "top_p", "seed") if getattr(self, n) is not None
            ]
            if given:
                raise RequestError(f"{', '.join(given)} only apply to sampling; add --sampling N (samples per prompt)")
        return self

    @property
    def sampling(self) -> SamplingParams | None:
        """The sampling test's parameters (None without --sampling)."""
        if self.samples is None:
            return None
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed or 0,
        )


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
    prompt_set = _prompt_set_name(loaded, opts.prompts)
    # A baseline that cannot compare is refused before minutes of generation, not after (its k
    # too when -k names it; else once the deployment has said what it decides, still before the run).
    base = None
    if opts.baseline is not None:
        base = load_baseline(opts.baseline, identity(loaded.spec.name, prompts, prompt_set, opts.num_draft_tokens, n_tokens))
    # The backends get num_draft_tokens as asked (None: the deployment's default, decided by the request
    # rules in process, by the served endpoint over --url; the LLM API takes none) and say what was decided.
    backend, mode = open_backend(
        loaded, engines_dir, opts.url, opts.stream, opts.num_draft_tokens, opts.tie_epsilon, opts.llmapi_impl
    )
    if base is not None:  # the baseline's k against the one the deployment decides
        check_same(opts.baseline, base, identity(loaded.spec.name, prompts, prompt_set, backend.decided_draft_tokens(), n_tokens))
    tick("verifying prompts", 0, len(prompts))
    report = run_verify(
        backend,
        prompts,
        n_tokens,
        loaded.spec.name,
        mode=mode,
        progress=lambda i, n: tick("verifying prompts", i, n),
        prompt_set=prompt_set,
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
