"""The soak's memory arithmetic and its drains (lab/soak.py): idle against idle, in flight
against in flight, and a drain that waits for every request in flight."""

from __future__ import annotations

import threading
import time

from lab.soak import Traffic, in_flight_trend, memory_report


def _mem(held_mib: float) -> dict[str, int]:
    kib = int(held_mib * 1024)
    return {"held": kib, "pss": kib, "rss_anon": kib, "rss_shmem": 0, "shm_maps": 0}


def test_memory_is_judged_idle_against_idle_and_the_in_flight_growth_is_reported_beside_it():
    # tritonserver holds 2 MiB more while requests are in flight; the target engine grows for good
    idle_start = {"tritonserver [10]": _mem(30), "stub tensorrt_llm [11]": _mem(1000)}
    busy_start = {"tritonserver [10]": _mem(31), "stub tensorrt_llm [11]": _mem(1000)}
    busy_end = {"tritonserver [10]": _mem(33), "stub tensorrt_llm [11]": _mem(1005)}
    idle_end = {"tritonserver [10]": _mem(30), "stub tensorrt_llm [11]": _mem(1005)}
    report = memory_report({"idle": (idle_start, idle_end), "in_flight": (busy_start, busy_end)}, gate="idle")
    idle, busy = report["spans"]["idle"], report["spans"]["in_flight"]
    assert report["judged_on"] == "idle"
    assert idle["held_growth"] == {"tritonserver": {"mib": 0.0, "pct": 0.0}, "tensorrt_llm": {"mib": 5.0, "pct": 0.5}}
    assert (idle["worst_process"], idle["worst_held_growth_pct"]) == ("stub tensorrt_llm [11]", 0.5)
    assert busy["held_growth"]["tritonserver"] == {"mib": 2.0, "pct": 6.45}
    assert (busy["worst_process"], busy["worst_held_growth_pct"]) == ("tritonserver [10]", 6.45)


def test_a_process_that_began_after_the_idle_start_counts_as_unbounded_growth():
    idle_start = {"tritonserver [10]": _mem(30)}
    idle_end = {"tritonserver [10]": _mem(30), "stub tensorrt_llm [12]": _mem(900)}
    report = memory_report({"idle": (idle_start, idle_end)}, gate="idle")
    idle = report["spans"]["idle"]
    assert idle["worst_process"] == "stub tensorrt_llm [12]"
    assert idle["worst_held_growth_pct"] == float("inf")
    assert idle["held_growth"]["tensorrt_llm"] == {"mib": None, "pct": None}


def test_the_in_flight_trend_compares_medians_of_the_two_halves_so_a_spike_does_not_count_and_a_climb_does():
    # tritonserver swings with what is in flight (one 24 MiB spike at the end); the draft climbs
    # 1 MiB a sample; a second instance's stub is named apart; a process seen only once is left out
    samples = []
    for i in range(8):
        triton = 24.0 if i == 7 else 15.5
        samples.append(
            {
                "t": 10.0 * i,
                "tritonserver [10]": [triton, 0, 0, 0, 8],
                "stub tensorrt_llm_draft [12]": [700.0 + i, 0, 0, 0, 1],
                "stub tensorrt_llm_draft [14]": [700.0, 0, 0, 0, 1],
            }
            | ({"stub tensorrt_llm [16]": [900.0, 0, 0, 0, 1]} if i == 3 else {})
        )
    trend = in_flight_trend(samples)
    assert trend["tritonserver"] == {"first_half_mib": 15.5, "second_half_mib": 15.5, "pct": 0.0}
    assert trend["tensorrt_llm_draft"] == {"first_half_mib": 701.5, "second_half_mib": 705.5, "pct": 0.57}
    assert trend["tensorrt_llm_draft_2"]["pct"] == 0.0
    assert "tensorrt_llm" not in trend
    assert in_flight_trend(samples[:3]) == {}


def test_a_drain_waits_for_the_request_in_flight_and_holds_new_ones_until_resumed():
    traffic = Traffic(60.0)
    inside, release, events = threading.Event(), threading.Event(), []

    def in_flight():
        with traffic.request():
            inside.set()
            release.wait(10)
            events.append("first answered")

    first = threading.Thread(target=in_flight)
    first.start()
    assert inside.wait(10)
    assert traffic.drain(0.05) is False  # the first request is still in flight

    def later():
        with traffic.request():
            events.append("second started")

    second = threading.Thread(target=later)
    second.start()
    release.set()
    first.join(10)
    assert traffic.drain(10) is True
    time.sleep(0.05)
    assert events == ["first answered"]  # held while drained
    traffic.resume()
    second.join(10)
    assert events == ["first answered", "second started"]


def test_the_time_drained_is_added_to_the_deadline():
    now = [100.0]
    traffic = Traffic(60.0, clock=lambda: now[0])
    now[0] = 130.0
    assert traffic.drain(1.0) is True
    now[0] = 145.0  # 15 s drained
    traffic.resume()
    assert traffic.deadline == 175.0
    now[0] = 174.9
    assert traffic.running()
    now[0] = 175.0
    assert not traffic.running()
