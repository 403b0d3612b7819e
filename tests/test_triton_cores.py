"""The logic behind the Triton models, without a server: engine contract and orchestrator.

The orchestrator's engine calls go to EngineCore objects in this process (the same code the
engine models run), so these tests pin down that serving runs the SAME loop as in-process
generation: same tokens, same acceptance counts.
"""

from __future__ import annotations

import numpy as np
import pytest

from trtspec.errors import RequestError
from trtspec.speculative.loop import accepted_prefix
from trtspec.speculative.metrics import metrics_from_json
from trtspec.speculative.requests import Limits
from trtspec.speculative.verifier import LogitsVerifier
from trtspec.triton.backend.bls import BlsVerifier
from trtspec.triton.backend.engine_core import EngineCore, EngineJob, run_jobs
from trtspec.triton.backend.orchestrator_core import Orchestrator, OrchestratorSettings

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Triton serves models over HTTP and gRPC."]


def _cores(dep):
    t, d = dep.target, dep.draft
    lim = dep.spec.limits("target")
    return {
        "tensorrt_llm": EngineCore(
            t.run, Limits(t.vocab_size, t.max_seq_len, dep.spec.speculative.max_draft_len, max_batch_size=lim.max_batch_size)
        ),
        "tensorrt_llm_draft": EngineCore(
            d.run, Limits(d.vocab_size, d.max_seq_len, 0, max_batch_size=lim.max_batch_size), min(t.vocab_size, d.vocab_size)
        ),
    }


def _call(cores, log=None):
    def call(model, inputs, names):
        if log is not None:
            log.append((model, {k: np.asarray(v).shape for k, v in inputs.items()}))
        (answer,) = cores[model].infer([inputs])
        if isinstance(answer, Exception):
            raise answer
        return {n: answer[n] for n in names}

    return call


def settings_for(dep, mode="speculative", **extra) -> OrchestratorSettings:
    """The orchestrator settings of ``dep``'s spec over the two engine models; ``extra``: the
    transport's and the target's abilities (decoupled, sampling_supported, ...)."""
    s = dep.spec.speculative
    return OrchestratorSettings(
        mode=mode,
        target_model="tensorrt_llm",
        draft_model="tensorrt_llm_draft",
        method=s.method,
        max_ngram=s.max_ngram,
        min_ngram=s.min_ngram,
        limits=dep.limits,
        draft_vocab_limit=dep.target.vocab_size,
        **extra,
    )


def _orchestrator(dep, mode="speculative", decoupled=False, log=None, sampling=True, cores=None, kv_blocks=False):
    settings = settings_for(dep, mode, decoupled=decoupled, sampling_supported=sampling, kv_blocks_supported=kv_blocks)
    return Orchestrator(settings, _call(cores or _cores(dep), log), dep.tokenizer, dep.end_ids)


def _request(prompt, max_tokens=24, **extra):
    inputs = {
        "text_input": np.array([[prompt.encode()]], dtype=np.object_),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
        "apply_chat_template": np.array([[True]]),
        "exclude_input_in_output": np.array([[True]]),
        "return_perf_metrics": np.array([[True]]),
    }
    for k, v in extra.items():
        inputs[k] = np.array([[v]], dtype=np.object_ if isinstance(v, bytes) else None)
    return inputs


def test_engine_verify_returns_accepted_prefix_plus_next_token(built):
    dep = built()
    ctx = dep.encode(PROMPTS[0])
    (full,) = LogitsVerifier(dep.target.run).verify([ctx], [[0, 0, 0]])
    greedy = full.target_ids  # the target's token after ctx + draft[:i], i = 0..3
    for draft in ([], greedy[:3], greedy[:1] + [(greedy[1] + 1) % 300, 5], [(greedy[0] + 1) % 300]):
        (res,) = run_jobs(dep.target.run, [EngineJob(ctx, len(draft) + 1, draft)])
        (ref,) = LogitsVerifier(dep.target.run).verify([ctx], [draft])
        n = accepted_prefix(draft, ref)
        assert res.ids == ref.target_ids[: n + 1]


def test_engine_decode_batches_ragged_jobs_and_stops_after_end_id(built):
    dep = built()
    a, b = dep.encode(PROMPTS[0]), dep.encode(PROMPTS[1])
    solo = [run_jobs(dep.target.run, [EngineJob(x, 6)])[0].ids for x in (a, b)]
    both = run_jobs(dep.target.run, [EngineJob(a, 6), EngineJob(b, 3)])
    assert [r.ids for r in both] == [solo[0], solo[1][:3]]
    (cut,) = run_jobs(dep.target.run, [EngineJob(a, 6, end_id=solo[0][2])])
    assert cut.ids == solo[0][: solo[0].index(solo[0][2]) + 1]


def test_engine_core_answers_each_request_or_its_own_error(built):
    dep = built()
    core = _cores(dep)["tensorrt_llm"]
    good = {
        "input_ids": np.array([[5, 6, 7]], dtype=np.int32),
        "input_lengths": np.array([[3]], dtype=np.int32),
        "request_output_len": np.array([[2]], dtype=np.int32),
    }
    bad = good | {"input_ids": np.array([[5, 6, 9999]], dtype=np.int32)}
    answers = core.infer([good, bad, good | {"exclude_input_in_output": np.array([[True]])}])
    assert answers[0]["output_ids"].shape == (1, 1, 5) and answers[0]["sequence_length"].tolist() == [[5]]
    assert isinstance(answers[1], RequestError) and "token id 9999 is outside the vocabulary" in str(answers[1])
    assert answers[2]["output_ids"][0, 0].tolist() == answers[0]["output_ids"][0, 0, 3:].tolist()


@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_orchestrator_runs_the_same_loop_as_in_process(built, k):
    dep = built()
    orch = _orchestrator(dep)
    for prompt in PROMPTS:
        (out,) = orch.run([_request(prompt, num_draft_tokens=k)])
        (ref,) = dep.generate([dep.request(dep.encode(prompt), 24, k)], speculative=True)
        assert out["output_ids"][0, : out["sequence_length"][0, 0]].tolist() == ref.output_ids
        metrics = metrics_from_json(out["perf_metrics_json"][0, 0].decode())
        assert metrics == ref.metrics
        assert out["total_draft_tokens"][0, 0] == ref.metrics.drafted
        assert out["total_accepted_draft_tokens"][0, 0] == ref.metrics.accepted


def test_target_only_and_batched_requests_match_in_process(built):
    dep = built()
    control = _orchestrator(dep, mode="target_only")
    spec = _orchestrator(dep)
    refs = [dep.generate([dep.request(dep.encode(p), 24)], speculative=False)[0].output_ids for p in PROMPTS]
    answers = control.run([_request(p) for p in PROMPTS])
    assert [a["output_ids"][0, : a["sequence_length"][0, 0]].tolist() for a in answers] == refs
    assert all(a["total_draft_tokens"][0, 0] == 0 for a in answers)
    batched = spec.run([_request(p) for p in PROMPTS])  # one loop, one engine request per step
    assert [a["output_ids"][0, : a["sequence_length"][0, 0]].tolist() for a in batched] == refs


def test_verifier_groups_rows_by_draft_length(built):
    dep = built()
    log = []
    verifier = BlsVerifier(_call(_cores(dep), log), "tensorrt_llm")
    ctx = [dep.encode(p) for p in PROMPTS]
    verifier.verify(ctx, [[1, 2], [], [3, 4]])
    assert sorted(shape["input_ids"][0] for _, shape in log) == [1, 2]


def test_streaming_sends_each_step_then_one_final_with_metrics(built):
    dep = built()
    orch = _orchestrator(dep, decoupled=True)
    sent = []
    errors = orch.run([_request(PROMPTS[1], stream=True)], lambda i, t, final: sent.append((i, t, final)))
    assert errors == [None]
    assert [final for *_, final in sent] == [False] * (len(sent) - 1) + [True]
    streamed = [tok for _, t, _ in sent for tok in t["output_ids"][0].tolist()]
    (ref,) = dep.generate([dep.request(dep.encode(PROMPTS[1]), 24)], speculative=True)
    assert streamed == ref.output_ids
    assert "".join(t["text_output"][0].decode() for _, t, _ in sent) == dep.decode(ref.output_ids)
    # perf outputs asked (_request sets return_perf_metrics): on every response, the counts so far
    drafted = [metrics_from_json(t["perf_metrics_json"][0, 0].decode()).drafted for _, t, _ in sent]
    assert drafted == sorted(drafted) and drafted[-1] == ref.metrics.drafted
    plain = _request(PROMPTS[1], stream=True)
    del plain["return_perf_metrics"]
    sent.clear()
    assert orch.run([plain], lambda i, t, final: sent.append((i, t, final))) == [None]
    assert "finish_reason" in sent[-1][1] and all("perf_metrics_json" not in t for _, t, _ in sent)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"num_draft_tokens": 99}, "num_draft_tokens must be in 0..8"),
        ({"text_input": b"   "}, "text_input is empty"),
        ({"text_input": b"\xff\xfe"}, "not valid UTF-8"),
        ({"text_input": "caf\udce9"}, "not valid UTF-8"),  # a lone surrogate in a str tensor
        ({"stream": True}, "stream=true needs the decoupled model"),
        ({"end_id": 100000}, "end_id 100000 is outside the vocabulary"),
    ],
)
def test_bad_requests_get_their_own_error(built, extra, message):
    dep = built()
    orch = _orchestrator(dep)
    bad = _request(PROMPTS[0])
    for k, v in extra.items():
        bad[k] = np.array([[v]], dtype=np.object_ if isinstance(v, (bytes, str)) else None)
    answers = orch.run([bad, _request(PROMPTS[0])])
    assert isinstance(answers[0], RequestError) and message in str(answers[0])
    assert isinstance(answers[1], dict)


def test_a_tokenizer_failure_fails_only_its_own_request(built, monkeypatch):
    from trtspec.triton.backend import orchestrator_core

    dep = built()
    orch = _orchestrator(dep)
    real = orchestrator_core.encode_prompt

    def fragile(tokenizer, prompt, chat):
        if prompt == "boom":
            raise ValueError("chat template failed")
        return real(tokenizer, prompt, chat)

    monkeypatch.setattr(orchestrator_core, "encode_prompt", fragile)
    answers = orch.run([_request("boom"), _request(PROMPTS[0])])
    assert isinstance(answers[0], Exception) and "chat template failed" in str(answers[0])
    assert isinstance(answers[1], dict)


class _RewritingTokenizer:
    """Decodes ids as letters; once the text is longer than 4 characters its first letter is
    capitalised, so a longer decode no longer starts with what an earlier one returned."""

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(chr(ord("a") + i) for i in ids)
        return text[:1].upper() + text[1:] if len(text) > 4 else text


def test_streamed_text_is_never_sent_twice_when_decoding_rewrites_earlier_text():
    stream = orchestrator_core_stream(_RewritingTokenizer())
    steps = [[0, 1], [2], [3, 4], [5]]
    deltas = [stream.step(ids, done=i == len(steps) - 1)["text_output"].reshape(-1)[0].decode() for i, ids in enumerate(steps)]
    assert "".join(deltas) == "abcdef"  # each letter once, in order (the old code re-sent "Abcde")


def orchestrator_core_stream(tokenizer):
    from trtspec.triton.backend.responses import TextStream

    return TextStream(tokenizer)


def test_sampled_requests_ask_the_engine_for_logits_and_repeat_by_seed(built):
    """A sampled row: the loop's verify requests carry return_generation_logits and get the
    target's logits at every scored position; the same seed repeats the sample, on both
    endpoints; an endpoint whose engines give no logits refuses sampling by name."""
    dep = built()
    log = []
    sampled = {"top_p": np.float32(0.95), "temperature": np.float32(1.0), "seed": np.uint64(9)}
    for mode in ("speculative", "target_only"):
        orch = _orchestrator(dep, mode, log=log)
        (a,) = orch.run([_request(PROMPTS[0], 12, **sampled)])
        (b,) = orch.run([_request(PROMPTS[0], 12, **sampled)])
        assert not isinstance(a, Exception), a
        assert a["output_ids"].tolist() == b["output_ids"].tolist()
    asked = [shapes for model, shapes in log if "return_generation_logits" in shapes]
    assert asked and all(model == "tensorrt_llm" for model, shapes in log if "return_generation_logits" in shapes)
    (refused,) = _orchestrator(dep, sampling=False).run([_request(PROMPTS[0], 12, **sampled)])
    assert isinstance(refused, RequestError) and "sampling (top_k/top_p with temperature > 0) is not supported" in str(refused)


# ----------------------------------------------------------------------------- KV-cache blocks


def test_kv_blocks_count_as_tensorrt_llm_does():
    from trtspec.triton.backend.engine_core import kv_blocks

    assert kv_blocks(70, reused=0, held=0) == (3, 0, 3)  # cold: ceil(70 / 32) new blocks
    assert kv_blocks(70, reused=0, held=40) == (1, 0, 3)  # blocks 0, 1 overwrite cached content
    assert kv_blocks(75, reused=70, held=70) == (0, 2, 1)  # two full blocks reused, block 2 rewritten
    assert kv_blocks(64, reused=64, held=64) == (0, 1, 1)  # the last token is never matched: (64 - 1) // 32


def test_engine_model_reports_its_real_cache_use(built):
    """The target engine model's kv_cache_* outputs follow the engine's own prefix reuse:
    a cold prompt allocates, the same sequence continued reuses its full blocks."""
    from trtspec.triton.backend.engine_core import EngineCore

    dep = built("draft")
    t = dep.target
    t.forget_prefixes()
    core = EngineCore(t.run, Limits(t.vocab_size, t.max_seq_len, 4, max_batch_size=4), cache_use=lambda: t.last_use)
    ids = (dep.encode(PROMPTS[2], chat_template=False) * 8)[:70]

    def ask(tokens):
        inputs = {
            "input_ids": np.array([tokens], dtype=np.int32),
            "input_lengths": np.array([[len(tokens)]], dtype=np.int32),
            "request_output_len": np.array([[1]], dtype=np.int32),
            "return_perf_metrics": np.array([[True]]),
        }
        (out,) = core.infer([inputs])
        names = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
        return tuple(int(out[n][0][0]) for n in names)

    assert ask(ids) == (3, 0, 3)
    assert ask(ids + [5, 6, 7, 8, 9]) == (0, 2, 1)


def test_orchestrator_answers_the_context_phase_blocks(built):
    dep = built("draft")
    cores = _cores(dep)
    cores["tensorrt_llm"].cache_use = lambda: dep.target.last_use
    log = []
    orch = _orchestrator(dep, cores=cores, kv_blocks=True, log=log)
    (out,) = orch.run([_request(PROMPTS[2])])
    # Only the sequence's first target request (its context phase) asks for the counts.
    asked = [("return_perf_metrics" in shapes) for model, shapes in log if model == "tensorrt_llm"]
    assert len(asked) > 2 and asked[0] and not any(asked[1:])
    n_prompt = len(dep.encode(PROMPTS[2], chat_template=True))
    new, reused, total = (
        int(out[n][0][0]) for n in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
    )
    assert reused + total == -(-n_prompt // 32)
    assert 0 <= new <= total


def test_num_return_sequences_must_fit_the_batch(built):
    dep = built()
    orch = _orchestrator(dep, decoupled=True)
    with pytest.raises(RequestError, match="sequences .prompts x num_return_sequences. exceeds max_batch_size"):
        orch.parse(_request(PROMPTS[0], num_return_sequences=np.int32(99)))
