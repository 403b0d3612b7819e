"""Per-process memory (lab/server_memory.py, what the soak and memory benches report): each process of a tree on its own, shared memory apart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lab import server_memory as memory
from trtspec.testing.process_memory import tree_memory
from trtspec.triton.server.procgroup import descendants

# A child that, once told, grows its heap by 64 MiB and maps and touches 16 MiB of /dev/shm.
CHILD = """
import mmap, os, sys, time
from pathlib import Path
go, done = Path(sys.argv[1]), Path(sys.argv[2])
deadline = time.monotonic() + 60  # never outlive a test that failed before "go"
while not go.exists():
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.02)
heap = bytearray(64 << 20)
for i in range(0, len(heap), 4096):
    heap[i] = 1
fd = os.open(f"/dev/shm/trtspec-soak-test-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 16 << 20)
shm = mmap.mmap(fd, 16 << 20)
os.unlink(f"/dev/shm/trtspec-soak-test-{os.getpid()}")
for i in range(0, 16 << 20, 4096):
    shm[i] = 1
done.touch()
time.sleep(60)
"""
PARENT = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], *sys.argv[2:]])"


def test_memory_growth_is_measured_per_process_and_names_the_one_that_grew(tmp_path):
    go, done = tmp_path / "go", tmp_path / "done"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(go), str(done)])
    try:
        deadline = time.monotonic() + 30
        while len(tree_memory(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        start = tree_memory(parent.pid)
        assert len(start) == 2 and all(m["pss"] > 0 and m["rss_anon"] > 0 for m in start.values())
        go.touch()
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        end = tree_memory(parent.pid)
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
    per_process = memory.growth(start, end)
    worst, pct = memory.worst_growth(per_process)
    child = per_process[worst]["growth_kib"]
    assert child["rss_anon"] >= 63 << 10  # the heap, in this process only
    assert child["rss_shmem"] >= 15 << 10 and child["shm_maps"] == 1  # the shared pages, apart
    assert child["held"] >= 78 << 10 and child["pss"] >= 78 << 10 and pct > 100
    (other,) = set(per_process) - {worst}
    assert per_process[other]["growth_kib"]["rss_anon"] < 4 << 10  # the parent did not grow
    assert memory.total(end) - memory.total(start) >= 78 << 10


def test_a_process_that_began_or_ended_in_the_span_counts_as_unbounded_growth():
    mem = {"held": 60, "pss": 100, "rss_anon": 50, "rss_shmem": 10, "shm_maps": 1}
    grown = {"held": 60, "pss": 130, "rss_anon": 50, "rss_shmem": 10, "shm_maps": 1}  # file pages came back
    assert memory.worst_growth(memory.growth({"a [1]": mem}, {"a [1]": grown})) == ("a [1]", 0.0)
    assert memory.worst_growth(memory.growth({"a [1]": mem}, {"a [2]": mem}))[1] == float("inf")


def test_the_soak_names_each_process_growth_by_the_model_it_serves():
    from lab.soak import held_by_model

    def mem(held: int) -> dict:
        return {"held": held, "pss": held, "rss_anon": held, "rss_shmem": 0, "shm_maps": 0}

    start = {
        "tritonserver [10]": mem(30 << 10),
        "stub tensorrt_llm [12]": mem(2000 << 10),
        "stub tensorrt_llm [11]": mem(100 << 10),
    }
    end = {"tritonserver [10]": mem(31 << 10), "stub tensorrt_llm [12]": mem(2020 << 10), "stub tensorrt_llm [13]": mem(5 << 10)}
    assert held_by_model(memory.growth(start, end)) == {
        "tritonserver": {"mib": 1.0, "pct": 3.33},
        "tensorrt_llm": {"mib": None, "pct": None},  # pid 11 ended in the span
        "tensorrt_llm_2": {"mib": 20.0, "pct": 1.0},
        "tensorrt_llm_3": {"mib": None, "pct": None},  # pid 13 began in it
    }


# A process that, once told, starts 4 threads that wait and grows its heap by 32 MiB.
THREADS = """
import sys, threading, time
from pathlib import Path
go, done = Path(sys.argv[1]), Path(sys.argv[2])
deadline = time.monotonic() + 60
while not go.exists():
    if time.monotonic() > deadline:
        sys.exit(1)
    time.sleep(0.02)
stop = threading.Event()
threads = [threading.Thread(target=stop.wait, args=(60,)) for _ in range(4)]
for t in threads:
    t.start()
heap = bytearray(32 << 20)
for i in range(0, len(heap), 4096):
    heap[i] = 1
done.touch()
time.sleep(60)
"""


def test_the_layout_names_what_grew_heap_pages_apart_from_new_threads_stacks(tmp_path):
    go, done = tmp_path / "go", tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", THREADS, str(go), str(done)])
    try:
        deadline = time.monotonic() + 30
        while not memory.tree_layout(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        start = memory.tree_layout(proc.pid)
        go.touch()
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        end = memory.tree_layout(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    (changed,) = memory.layout_growth(start, end).values()
    a, b = changed["threads"]
    assert b - a == 4
    stacks = changed["mappings"]["thread stacks"]
    assert stacks[1] - stacks[0] == 4  # one guarded stack per thread, none taken for the heap
    heap_kib = changed["kib"]["heap"]
    assert heap_kib[1] - heap_kib[0] >= 31 << 10
    stack_kib = changed["kib"]["thread stacks"]
    assert 0 < stack_kib[1] - stack_kib[0] < 4 << 10  # each new stack touched a few pages only
    assert memory.layout_growth(end, end) == {}
