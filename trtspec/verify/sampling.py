"""`verify --sampling N`: does speculative sampling draw from the target's distribution?

Per prompt, N sampled generations on the speculative path (seeds seed, seed+1, ...). Every
sampled token x_t (an ending EOS included) is scored against the target's exact conditional
distribution p_t given the prompt and the tokens sampled before it, computed by the target
alone in one forward over the sequence with the same warping: its randomized probability
integral transform, with tokens ranked by descending p_t (ties by id),

    u_t = p_t(tokens ranked before x_t) + V * p_t(x_t),   V ~ U(0, 1)

is uniform on (0, 1) and independent of every other u when the sampler is exact (the
Rosenblatt transform of a sequential process), whatever the model. A chi-square test of all
u over BINS equal bins rejects at level ALPHA: with an exact sampler it fails with probability
ALPHA (the false-alarm rate, up to the chi-square approximation, which needs >= 5 expected
values per bin: hence N x prompts >= MIN_VALUES). A sampler that skips the rejection step
emits draft-distributed tokens, which rank differently under p_t and skew the histogram.

Every (prompt, sample) has its own seed (seed + prompt x N + sample) and the V draws their
own generator: the values are independent across prompts too, which the test needs.

Tokens the two paths draw are compared in distribution, never one by one: the paths consume
random numbers differently, so the same seed gives different, equally valid, samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trtspec.engines.torch.engine import ForwardItem
from trtspec.errors import RequestError
from trtspec.speculative.metrics import SpecMetrics
from trtspec.speculative.sampling import SamplingParams, warp

ALPHA = 0.01
BINS = 10
MIN_VALUES = 5 * BINS


@dataclass
class SamplingCheck:
    params: SamplingParams
    samples: int  # generations per prompt
    prompts: int
    counts: list[int]  # u values per bin
    chi2: float
    p_value: float
    alpha: float = ALPHA
    metrics: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def values(self) -> int:
        return sum(self.counts)

    @property
    def passed(self) -> bool:
        return self.p_value >= self.alpha

    def describe(self) -> str:
        verdict = "consistent with the target's distribution" if self.passed else "NOT the target's distribution"
        return (
            f"sampling (temperature {self.params.temperature:g}, top_k {self.params.top_k}, top_p "
            f"{self.params.top_p:g}): {self.samples} samples x {self.prompts} prompts, {self.values} tokens: "
            f"chi-square {self.chi2:.2f} on {BINS - 1} dof, p = {self.p_value:.4g} -> {verdict} "
            f"(false-alarm rate {self.alpha:g}); acceptance rate {self.metrics.acceptance_rate:.3f}"
        )

    def to_dict(self) -> dict:
        return {
            "temperature": self.params.temperature,
            "top_k": self.params.top_k,
            "top_p": self.params.top_p,
            "seed": self.params.seed,
            "samples_per_prompt": self.samples,
            "prompts": self.prompts,
            "tokens": self.values,
            "bins": self.counts,
            "chi2": self.chi2,
            "dof": BINS - 1,
            "p_value": self.p_value,
            "false_alarm_rate": self.alpha,
            "passed": self.passed,
            "metrics": self.metrics.to_dict(),
        }


def check_sample_count(samples: int, prompts: int) -> None:
    """RequestError (exit 2) when the chi-square test would not be valid."""
    if samples * prompts < MIN_VALUES:
        need = math.ceil(MIN_VALUES / prompts)
        raise RequestError(
            f"--sampling {samples} with {prompts} prompt(s) gives too few tokens for the chi-square "
            f"test ({BINS} bins need >= {MIN_VALUES} values); use --sampling {need} or more"
        )


def sample_seed(seed: int, samples: int, prompt: int, sample: int) -> int:
    """The seed of one sampled generation: distinct for every (prompt, sample). Prompts must
    not share seeds: the same random stream drawing from two similar distributions (prompts
    that end alike, a chat template's opening) gives dependent tokens, and the chi-square
    test assumes independent values, so shared seeds would raise its false-alarm rate above
    ALPHA."""
    return seed + prompt * samples + sample


def pit_values(run, prompt_ids: list[int], tokens: list[int], params: SamplingParams, gen) -> list[float]:
    """Randomized PIT of each sampled token under the target's exact conditionals."""
    if not tokens:
        return []
    seq = list(prompt_ids) + list(tokens)
    (logits,) = run([ForwardItem(seq[:-1], len(tokens))])  # [len(tokens), vocab]
    p = warp(logits, params)  # [t, vocab]
    out = []
    for t, x in enumerate(tokens):
        px = p[t, x]
        # Mass ranked strictly before x: larger p, or equal p with a smaller id.
        before = p[t][(p[t] > px)].sum() + p[t, :x][p[t, :x] == px].sum()
        v = float(torch.rand((), generator=gen, dtype=torch.float64))
        out.append(float(before + v * px))
    return out


def chi_square_uniform(values: list[float], bins: int = BINS) -> tuple[list[int], float, float]:
    """(counts per bin, statistic, p-value) of a chi-square test of uniformity on (0, 1)."""
    counts = [0] * bins
    for u in values:
        counts[min(int(u * bins), bins - 1)] += 1
    expected = len(values) / bins
    chi2 = sum((c - expected) ** 2 / expected for c in counts)
    # P(chi2_{bins-1} >= chi2) = Q((bins-1)/2, chi2/2), the regularized upper gamma.
    p = float(
        torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64))
    )
    return counts, chi2, p


# draw(prompt_index, prompt_text, prompt_ids, sampling params per sample) -> per sample the
# sampled tokens (an ending EOS included) and that generation's SpecMetrics.
Draw = Callable[[int, str, list[int], list[SamplingParams]], list[tuple[list[int], SpecMetrics]]]


def deployment_draw(dep, max_tokens: int, num_draft_tokens: int | None) -> Draw:
    """Samples from the speculative path in this process, batched over the engine's slots."""

    def draw(j, prompt, ids, params):
        out = []
        batch = dep.target.max_batch_size
        for first in range(0, len(params), batch):
            reqs = [dep.request(ids, max_tokens, num_draft_tokens, sampling=p) for p in params[first : first + batch]]
            for res in dep.generate(reqs, speculative=True):
                out.append((res.output_ids + ([res.end_id] if res.end_id is not None else []), res.metrics))
        return out

    return draw


def run_sampling_check(
    draw: Draw,
    target_run,
    encode: Callable[[str], list[int]],
    prompts: list[str],
    samples: int,
    params: SamplingParams,
    progress=None,
) -> SamplingCheck:
    """Sample ``samples`` speculative generations per prompt (``draw``: in this process or
    from a server) and test them against the target's exact distributions computed by
    ``target_run`` here (module doc)."""
    check_sample_count(samples, len(prompts))
    values: list[float] = []
    metrics = SpecMetrics()
    pit_gen = torch.Generator().manual_seed(params.seed + 1_000_003)
    done = 0
    for j, prompt in enumerate(prompts):
        ids = encode(prompt)
        per_sample = [
            SamplingParams(params.temperature, params.top_k, params.top_p, sample_seed(params.seed, samples, j, s))
            for s in range(samples)
        ]
        for first in range(0, samples, 8):
            chunk = per_sample[first : first + 8]
            for tokens, m in draw(j, prompt, ids, chunk):
                values += pit_values(target_run, ids, tokens, params, pit_gen)
                metrics = metrics.merge(m)
            done += len(chunk)
            if progress:
                progress(done, samples * len(prompts))
    counts, chi2, p = chi_square_uniform(values)
    return SamplingCheck(params, samples, len(prompts), counts, chi2, p, ALPHA, metrics)


def check_deployment(
    dep, prompts: list[str], samples: int, max_tokens: int, params: SamplingParams, num_draft_tokens=None, progress=None
) -> SamplingCheck:
    """The check on a Deployment in this process (its speculative path, its target)."""
    return run_sampling_check(
        deployment_draw(dep, max_tokens, num_draft_tokens), dep.target.run, dep.encode, prompts, samples, params, progress
    )


def check_served(
    url_backend,
    target,
    encode,
    end_id: int,
    prompts: list[str],
    samples: int,
    max_tokens: int,
    params: SamplingParams,
    progress=None,
) -> SamplingCheck:
    """The check on a served speculative endpoint: samples come over gRPC (temperature, top_k,
    top_p and seed as upstream names them, one end_id so the EOS that ended a sample is
    known), scored by the target engine built here."""

    def draw(j, prompt, ids, per_sample):
        out = []
        for p in per_sample:
            tokens, reason, metrics = url_backend.sample(prompt, max_tokens, p, end_id)
            out.append((tokens + ([end_id] if reason == "eos" else []), metrics))
        return out

    return run_sampling_check(draw, target.run, encode, prompts, samples, params, progress)


def check_url(
    loaded, engines_dir, backend, prompts, samples: int, max_tokens: int, params: SamplingParams, progress=None
) -> SamplingCheck:
    """--sampling with --url: the served speculative endpoint samples; the target engine
    built here gives the exact distributions its samples are tested against."""
    from transformers import AutoTokenizer

    from trtspec.engines.manifest import check_manifest
    from trtspec.engines.torch.engine import TorchEngine
    from trtspec.errors import EngineError
    from trtspec.layout import engine_folder
    from trtspec.speculative.requests import encode_prompt

    if loaded.spec.backend != "torch":
        raise RequestError("--sampling with --url: only torch deployments sample when served; drop --sampling")
    folder = engine_folder(engines_dir, "target")
    try:
        check_manifest(folder, "target", loaded.spec.build_hash("target"))
    except EngineError as err:
        raise RequestError(
            f"--sampling with --url scores the served samples with the target engine built here ({err}); "
            "run `trtspec build SPEC` on this machine first"
        ) from None
    target = TorchEngine.load(folder, slots=1, device=loaded.spec.device)  # the spec's or --device's
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=loaded.spec.target.trust_remote_code)
    if tok.eos_token_id is None:
        raise RequestError("--sampling with --url needs the tokenizer's eos_token_id to end samples; this tokenizer has none")
    chat = backend.chat_template
    return check_served(
        backend,
        target,
        lambda p: encode_prompt(tok, p, chat),
        int(tok.eos_token_id),
        prompts,
        samples,
        max_tokens,
        params,
        progress,
    )
