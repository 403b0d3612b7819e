"""Soak: concurrent speculative traffic with random cancellations against a loopback server.

    .venv/bin/python -m lab.soak engine_specs/tiny-llama.yaml --duration 120

Starts its own tritonserver on free 127.0.0.1 ports (never another host) for the spec's built
engines, takes target-only references from the independent `target_only` control, then runs
``--concurrency`` client threads for ``--duration`` seconds (at most 3600). Each request picks a
prompt, a max_tokens and an endpoint (streamed `tensorrt_llm_bls_streaming` or unary
`tensorrt_llm_bls`) at random; ``--cancel`` of the streams are cancelled after a random number
of streamed responses. ``--faults F`` makes a fraction F of the requests hostile, drawn evenly
from: a stream whose client disconnects (closes its channel, no cancel) after a few responses,
a 4 MB prompt, and (where the model's vocabulary makes it possible within max_seq_len) a
return_generation_logits request over serve.max_response_mb; the oversized ones must be
refused with their named error. It reports and checks:

  failed        requests that were not cancelled and did not complete, and hostile ones not
                refused with their named error (must be 0)
  differing     completed outputs that differ from target-only (must be 0; also "mismatched")
  unanswered    requests with no final answer within --answer-timeout seconds (must be 0)
  memory        per process (tritonserver and each Python-backend stub, by model): held
                (Pss_Anon + Pss_Shmem), Pss, RssAnon, RssShmem and the number of /dev/shm
                mappings (lab/server_memory.py), from the end of
                --warmup seconds of the same load (the engines' static KV buffers are touched
                page by page as slots and positions are first used: that is not a leak) to the
                end, twice: idle against idle (at each end the traffic is drained: no new
                request until every one in flight is answered, then SETTLE_S seconds; the pause
                is added to the load's time) and in flight against in flight (sampled just
                before each drain); the growth from before any load and a sample every 10 s
                are reported too, and where each process's private memory changed idle against
                idle: threads, and anonymous KiB by kind (heap, thread stacks, private copies
                of file pages)
  held after    sequences still holding a place and requests still queued, read from the
                trtspec_active_sequences / trtspec_queue_depth gauges on /metrics when the
                server exports them; and a probe: max_batch_size fresh streams per instance
                all complete, identical to target-only

Exit status 0 when failed, mismatched and held-after are 0, both drains emptied, and no
process's held memory grew more than --max-growth percent after the warm-up, idle against idle
(a process that began or ended in that span counts as grown); 1 otherwise. Writes --json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import random
import re
import statistics
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from lab._common import command_line, start_server, write_result

STREAMING, UNARY, CONTROL = "tensorrt_llm_bls_streaming", "tensorrt_llm_bls", "target_only"


HUGE_PROMPT = "tell me a story. " * 250_000  # 4.25 MB: refused before tokenizing
ANSWER_TIMEOUT = 600.0  # seconds without a final answer: unanswered


def held_by_model(per_process: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Held memory's growth after the warm-up per process, named as the documents cite it:
    ``tritonserver`` or the model a stub serves (``tensorrt_llm``, ``tensorrt_llm_draft``, ...),
    each {"mib", "pct"} (a second instance's stub: ``tensorrt_llm_2``, in pid order); a process
    that began or ended in the span has None for both."""
    out: dict[str, dict[str, float | None]] = {}
    for name, key in model_names(per_process).items():
        g = per_process[name]
        if "growth_kib" in g:
            out[key] = {"mib": round(g["growth_kib"]["held"] / 1024, 1), "pct": g["growth_pct"]["held"]}
        else:
            out[key] = {"mib": None, "pct": None}
    return out


def model_names(processes) -> dict[str, str]:
    """Each process label ("tritonserver [PID]", "stub MODEL [PID]") to the name the documents
    cite, in pid order: ``tritonserver`` or the model, a second instance's stub ``MODEL_2``."""
    out: dict[str, str] = {}
    for name in sorted(processes, key=lambda label: int(label.rsplit("[", 1)[1].rstrip("]"))):
        base = key = name.rsplit(" [", 1)[0].removeprefix("stub ")
        n = 1
        while key in out.values():
            n += 1
            key = f"{base}_{n}"
        out[name] = key
    return out


def in_flight_trend(samples: list[dict]) -> dict[str, dict[str, float]]:
    """Per process, the median held MiB of the span's in-flight samples (every 10 s) in its
    first and its second half, and the change in %: a trend under load, which the two single
    in-flight samples at the span's ends, taken at whatever was in flight then, cannot show.
    Processes absent from any sample are left out; fewer than 4 samples give nothing."""
    if len(samples) < 4:
        return {}
    labels = set.intersection(*(set(s) - {"t"} for s in samples))
    half = len(samples) // 2
    out = {}
    for label, key in model_names(labels).items():
        first = statistics.median(s[label][0] for s in samples[:half])
        second = statistics.median(s[label][0] for s in samples[half:])
        out[key] = {
            "first_half_mib": round(first, 1),
            "second_half_mib": round(second, 1),
            "pct": round(100 * (second - first) / first, 2) if first else 0.0,
        }
    return out


# After a drain, before the idle sample: cancellations reach the scheduler within a step, and
# jemalloc's background thread returns freed pages within its dirty_decay_ms (1 s; install.py).
SETTLE_S = 3.0


class Traffic:
    """The load's clock and its pauses: workers take each request through ``request()``, which
    waits while the traffic is drained; ``drain()`` stops new requests and waits until every
    request in flight is answered. The time paused is added to the deadline, so a drain takes
    nothing from the load's duration."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.clock = clock
        self.deadline = clock() + seconds
        self._cond = threading.Condition()
        self._open, self._busy, self._paused_at = True, 0, 0.0

    def running(self) -> bool:
        return self.clock() < self.deadline

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._open)
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Stop new requests; True once none is in flight (False: ``timeout`` passed first)."""
        with self._cond:
            self._open, self._paused_at = False, self.clock()
            return self._cond.wait_for(lambda: self._busy == 0, timeout)

    def resume(self) -> None:
        with self._cond:
            self.deadline += self.clock() - self._paused_at
            self._open = True
            self._cond.notify_all()


def memory_report(spans: dict[str, tuple[dict, dict]], gate: str) -> dict:
    """Per-process growth over each named span (start, end tree_memory samples), each process's
    held growth by model, the worst one per span, and which span the goal is judged on
    (``gate``)."""
    from lab.server_memory import growth, worst_growth

    out: dict = {"judged_on": gate, "spans": {}}
    for name, (start, end) in spans.items():
        per_process = growth(start, end)
        worst, pct = worst_growth(per_process)
        out["spans"][name] = {
            "memory_growth": per_process,
            "held_growth": held_by_model(per_process),
            "worst_process": worst,
            "worst_held_growth_pct": round(pct, 2),
        }
    return out


class Unanswered(Exception):
    """No final answer came within the answer timeout."""


def _inputs(prompt: str, max_tokens: int, chat: bool, stream: bool, logits: bool = False):
    from trtspec.triton.request import infer_inputs

    values = {"text_input": prompt, "max_tokens": max_tokens, "apply_chat_template": chat, "exclude_input_in_output": True}
    return infer_inputs(values | {"stream": stream} | ({"return_generation_logits": True} if logits else {}))


def unary(url, model, prompt, max_tokens, chat, logits: bool = False) -> list[int]:
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    inputs = _inputs(prompt, max_tokens, chat, False, logits)
    try:
        r = grpcclient.InferenceServerClient(url).infer(model, inputs, client_timeout=ANSWER_TIMEOUT)
    except InferenceServerException as err:
        if "Deadline Exceeded" in str(err):
            raise Unanswered(str(err)) from None
        raise
    return r.as_numpy("output_ids")[0, : r.as_numpy("sequence_length")[0, 0]].tolist()


def refused(call, needle: str) -> str | None:
    """None when ``call`` is refused with an error naming ``needle``; else what went wrong."""
    try:
        call()
    except Unanswered:
        raise
    except Exception as err:
        return None if needle in str(err) else f"refused with another error: {err}"
    return "answered instead of refused"


def disconnect(url, prompt, max_tokens, chat, after: int) -> None:
    """A stream whose client goes away after ``after`` responses (a crashed or killed client)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(STREAMING, _inputs(prompt, max_tokens, chat, True), enable_empty_final_response=True)
    for _ in range(after):
        try:
            result, error = got.get(timeout=ANSWER_TIMEOUT)
        except queue.Empty:
            raise Unanswered("no response within the answer timeout") from None
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
            break
    # Drop the connection under the open stream, as a killed client would: no cancel is sent
    # (stop_stream would cancel or wait for the end), the server sees the transport go away.
    client._channel.close()
    client.stop_stream(cancel_requests=True)  # only reaps the client's own reader thread


def stream(url, prompt, max_tokens, chat, cancel_after: int | None) -> list[int] | None:
    """The streamed tokens, or None when this call cancelled the stream."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    tokens: list[int] = []
    responses = 0
    try:
        client.async_stream_infer(STREAMING, _inputs(prompt, max_tokens, chat, True), enable_empty_final_response=True)
        while True:
            try:
                result, error = got.get(timeout=ANSWER_TIMEOUT)
            except queue.Empty:
                raise Unanswered("no final response within the answer timeout") from None
            if error is not None:
                raise RuntimeError(str(error))
            ids = result.as_numpy("output_ids")
            if ids is not None and ids.size:
                tokens += ids[0].tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tokens
            responses += 1
            if cancel_after is not None and responses >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return None
    finally:
        client.stop_stream()


def gauges(metrics_url: str) -> dict[str, float] | None:
    """Sum of each trtspec load gauge over models and instances; None when not exported."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for name in ("trtspec_active_sequences", "trtspec_queue_depth"):
        values = [float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)]
        if values:
            out[name] = sum(values)
    return out or None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="engine_specs/tiny-llama.yaml")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load (at most 3600)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cancel", type=float, default=0.2, help="fraction of streams cancelled (default 0.2)")
    ap.add_argument("--faults", type=float, default=0.0, help="fraction of requests that are hostile (default 0)")
    ap.add_argument("--answer-timeout", type=float, default=600.0, help="seconds to a final answer (default 600)")
    ap.add_argument("--max-tokens", default="16,48", help="max_tokens values drawn from (default 16,48)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds of load before the memory baseline (default 30)")
    ap.add_argument(
        "--max-growth",
        "--max-rss-growth",
        type=float,
        default=5.0,
        help="most any one process's held memory may grow after the warm-up, percent (default 5)",
    )
    ap.add_argument("--allocator", default="auto", choices=["auto", "glibc", "jemalloc", "tcmalloc"])
    ap.add_argument("--server-arg", action="append", default=[], help="extra tritonserver option (repeatable)")
    ap.add_argument("--server-env", action="append", default=[], help="KEY=VALUE for the server and its stubs (repeatable)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not 0 < args.duration <= 3600:
        raise SystemExit("--duration must be in (0, 3600] seconds")
    if not 0 <= args.cancel <= 1 or not 0 <= args.faults <= 1 or args.concurrency < 1:
        raise SystemExit("--cancel and --faults must be in [0, 1] and --concurrency at least 1")
    global ANSWER_TIMEOUT
    ANSWER_TIMEOUT = args.answer_timeout

    from lab.server_memory import compact, growth, layout_growth, total, tree_layout
    from trtspec.spec import load_spec
    from trtspec.testing.process_memory import tree_memory

    loaded = load_spec(args.spec)
    prompts = loaded.verify_prompts()
    chat = loaded.spec.verify.chat_template
    lengths = [int(x) for x in args.max_tokens.split(",")]
    faults = ["disconnect", "huge_prompt"]
    # generation_logits over the cap: max_tokens x vocab x 4 bytes > serve.max_response_mb,
    # possible only where that many tokens fit in max_seq_len
    vocab = json.loads((loaded.output_dir() / "target" / "config.json").read_text()).get("vocab_size", 0)
    logits_tokens = loaded.spec.serve.max_response_mb * 2**20 // max(1, 4 * vocab) + 1
    if vocab and logits_tokens < loaded.spec.limits("target").max_seq_len - 128:
        faults.append("oversized_logits")
    env = dict(kv.split("=", 1) for kv in args.server_env)
    server = start_server(loaded, env, allocator=args.allocator, extra_args=args.server_arg)
    url = server.grpc_endpoint
    counts: Counter = Counter()
    problems: list[str] = []
    lock = threading.Lock()
    try:
        expected = {(p, n): unary(url, CONTROL, p, n, chat) for p in prompts for n in lengths}
        for p in prompts:  # warm-up of both speculative endpoints, checked too
            assert stream(url, p, lengths[0], chat, None) == expected[(p, lengths[0])], p
            assert unary(url, UNARY, p, lengths[0], chat) == expected[(p, lengths[0])], p
        mem_cold = tree_memory(server.pid)
        traffic = Traffic(args.warmup + args.duration)
        samples: list[dict] = []

        def fault(kind: str, p: str, n: int, rng: random.Random) -> None:
            """One hostile request; a wrong or missing refusal counts failed."""
            try:
                if kind == "disconnect":
                    disconnect(url, p, max(n, 8), chat, rng.randint(1, 3))
                    wrong = None
                elif kind == "huge_prompt":
                    wrong = refused(lambda: unary(url, rng.choice([UNARY, CONTROL]), HUGE_PROMPT, n, chat), "text_input is")
                else:
                    wrong = refused(lambda: unary(url, UNARY, p, logits_tokens, chat, True), "serve.max_response_mb")
            except Unanswered as err:
                with lock:
                    counts["unanswered"] += 1
                    problems.append(f"fault {kind}: {err}")
                return
            except Exception as err:
                wrong = f"{type(err).__name__}: {err}"
            with lock:
                counts[f"fault_{kind}"] += 1
                if wrong is not None:
                    counts["failed"] += 1
                    problems.append(f"fault {kind}: {wrong}")

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while traffic.running():
                with traffic.request():
                    p, n = rng.choice(prompts), rng.choice(lengths)
                    if rng.random() < args.faults:
                        fault(rng.choice(faults), p, n, rng)
                        continue
                    kind = rng.choice(["stream", "unary"])
                    cancel_after = rng.randint(1, 3) if kind == "stream" and rng.random() < args.cancel else None
                    try:
                        if kind == "stream":
                            got = stream(url, p, n, chat, cancel_after)
                        else:
                            got = unary(url, UNARY, p, n, chat)
                    except Unanswered as err:
                        with lock:
                            counts["unanswered"] += 1
                            problems.append(f"{kind} {p!r} max_tokens {n}: {err}")
                        continue
                    except Exception as err:
                        with lock:
                            counts["failed"] += 1
                            problems.append(f"{kind} {p!r} max_tokens {n}: {err}")
                        continue
                    with lock:
                        if got is None:
                            counts["cancelled"] += 1
                        elif got != expected[(p, n)]:
                            counts["mismatched"] += 1
                            problems.append(f"{kind} {p!r} max_tokens {n}: differs from target-only")
                        else:
                            counts["completed"] += 1
                            counts["tokens"] += len(got)

        threads = [threading.Thread(target=worker, args=(args.seed + i,)) for i in range(args.concurrency)]
        begin = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(args.warmup)  # requests of the warm-up count like the rest
        # Each end of the span sampled twice: with requests in flight, and idle (traffic
        # drained, every request answered): a process's memory swings with what is in flight.
        busy_start = tree_memory(server.pid)
        drained = [traffic.drain(ANSWER_TIMEOUT)]
        time.sleep(SETTLE_S)
        idle_start, layout_start = tree_memory(server.pid), tree_layout(server.pid)
        traffic.resume()
        while traffic.running():
            samples.append({"t": round(time.monotonic() - begin, 1)} | compact(tree_memory(server.pid)))
            time.sleep(max(0.0, min(10.0, traffic.deadline - time.monotonic())))
        busy_end = tree_memory(server.pid)  # new requests stop; those in flight are still running
        drained.append(traffic.drain(ANSWER_TIMEOUT))
        for t in threads:
            t.join()
        seconds = time.monotonic() - begin
        time.sleep(SETTLE_S)
        idle_end, layout_end = tree_memory(server.pid), tree_layout(server.pid)
        held = gauges(server.metrics_url)
        # Every place must be free again: as many fresh streams as one endpoint instance has
        # places, at once, all complete and identical to target-only.
        probe_n = loaded.spec.limits("target").max_batch_size * loaded.spec.serve.instance_count
        probe: list = [None] * probe_n
        p0, n0 = prompts[0], lengths[0]

        def probe_one(i: int) -> None:
            probe[i] = stream(url, p0, n0, chat, None)

        probes = [threading.Thread(target=probe_one, args=(i,)) for i in range(probe_n)]
        for t in probes:
            t.start()
        for t in probes:
            t.join(600)
        probe_ok = all(got == expected[(p0, n0)] for got in probe)
    finally:
        server.stop()

    memory = memory_report({"idle": (idle_start, idle_end), "in_flight": (busy_start, busy_end)}, gate="idle")
    judged, in_flight = memory["spans"]["idle"], memory["spans"]["in_flight"]
    held_after = None if held is None else int(held.get("trtspec_active_sequences", 0) + held.get("trtspec_queue_depth", 0))
    report = {
        "spec": loaded.spec.name,
        "allocator": server.env.get("LD_PRELOAD") or "glibc",
        "server_args": args.server_arg,
        "server_env": args.server_env,
        "load_s": round(seconds, 1),  # warm-up and drains included: every count covers it
        "concurrency": args.concurrency,
        "cancel_fraction": args.cancel,
        "completed": counts["completed"],
        "cancelled": counts["cancelled"],
        "failed": counts["failed"],
        "differing": counts["mismatched"],
        "mismatched": counts["mismatched"],
        "unanswered": counts["unanswered"],
        "fault_fraction": args.faults,
        "faults": {k.removeprefix("fault_"): v for k, v in sorted(counts.items()) if k.startswith("fault_")},
        "hostile": sum(v for k, v in counts.items() if k.startswith("fault_")),
        "output_tokens": counts["tokens"],
        "warmup_s": args.warmup,
        # Per process from the end of the warm-up to the end (the goal: worst growth of held
        # memory, Pss_Anon + Pss_Shmem; lab/server_memory.py), idle against idle: sampled
        # with the traffic drained, every request answered.
        "memory_growth": judged["memory_growth"],
        "held_growth": judged["held_growth"],
        "worst_held_growth_pct": judged["worst_held_growth_pct"],
        "worst_process": judged["worst_process"],
        # The same span with requests in flight at both ends (never hidden: a growth that
        # only shows under load shows here).
        "in_flight_memory_growth": in_flight["memory_growth"],
        "in_flight_held_growth": in_flight["held_growth"],
        "worst_in_flight_held_growth_pct": in_flight["worst_held_growth_pct"],
        "worst_in_flight_process": in_flight["worst_process"],
        # The 10-s samples in flight: median of the span's second half against its first.
        "in_flight_trend": in_flight_trend(samples),
        "drained": drained,  # each drain ended with no request in flight
        # Where each process's private memory changed over the judged span, idle against idle:
        # threads, and anonymous KiB and mappings by kind ([start, end]; lab/server_memory.py).
        "anon_layout_growth": layout_growth(layout_start, layout_end),
        # What the tree holds (shared pages counted once) before load and at each sample of
        # the span's ends; the growth from before load includes the warm-up's.
        "held_total_mib": {
            k: round(total(m) / 1024, 1)
            for k, m in (
                ("before_load", mem_cold),
                ("start_in_flight", busy_start),
                ("start_idle", idle_start),
                ("end_in_flight", busy_end),
                ("end_idle", idle_end),
            )
        },
        "from_before_load": growth(mem_cold, idle_end),
        # Every 10 s, per process: [held, Pss, RssAnon, RssShmem] MiB and the /dev/shm mappings.
        "memory_samples": samples,
        "held_after": held_after,  # None: the server exports no trtspec load gauges
        "probe_after_ok": probe_ok,
        "problems": problems[:20],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        write_result(args.json, command_line("soak.py"), report)
    ok = not counts["failed"] and not counts["mismatched"] and not counts["unanswered"]
    ok = ok and probe_ok and all(drained) and judged["worst_held_growth_pct"] <= args.max_growth
    return 0 if ok and held_after in (0, None) else 1


if __name__ == "__main__":
    raise SystemExit(main())
