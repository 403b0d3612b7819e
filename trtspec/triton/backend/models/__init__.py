"""Triton Python-backend models. They run inside tritonserver's stub process, where
``triton_python_backend_utils`` exists; the logic they wrap lives in plain modules
(engine_core, orchestrator_core, bls) that tests exercise without a server."""

import os

# Each model runs in its own stub process, and the draft and target engines take turns on the
# same cores. After each parallel region OpenMP (libgomp in torch's wheels) keeps its threads
# spinning; an engine that just answered then starves the one that must answer next
# (measured with tiny engines on 2 cores: 10x slower speculative steps). A short spin keeps
# the threads hot between the ops of one forward and lets them sleep between requests;
# OMP_WAIT_POLICY=PASSIVE would fix the starvation too but made SmolLM2 forwards ~45% slower.
# Set before torch is imported; the user's own settings win.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
