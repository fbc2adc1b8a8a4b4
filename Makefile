# rlhf-operator. `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install test unit demo crds lint constraints clean bench-operator

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

install: $(STAMP)  ## create .venv with everything the tests need (from the registries)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[operator,dev]"
	touch $@

test: install  ## run every test
	$(PY) -m pytest

unit: install  ## run the unit tests only
	$(PY) -m pytest tests/unit

demo: install  ## validate the local example and show its placement (training lands with the trainer)
	$(VENV)/bin/rlhfjob validate examples/*.yaml
	$(VENV)/bin/rlhfjob plan examples/local-cpu.yaml
	@echo "Local training (python -m rlhf_trainer) is not built yet: see issue 'The trainer'."

crds: install  ## regenerate crds/ from the API models
	$(VENV)/bin/rlhfjob crd > crds/rlhfjobs.yaml
	$(VENV)/bin/rlhfjob crd --peering > crds/kopf-peering.yaml

lint: install  ## ruff and mypy
	$(VENV)/bin/ruff check operator trainer_image tests
	$(VENV)/bin/ruff format --check operator trainer_image tests
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint trainer_image/Dockerfile

constraints: install  ## re-pin constraints.txt to what .venv holds
	( echo '# Exact versions `make install` uses (regenerate: make constraints). pyproject.toml holds the ranges.'; \
	  $(PY) -m pip freeze --exclude-editable ) > constraints.txt

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

bench-operator: install  ## benchmark: create->RayJob latency vs KubeRay's create->RayCluster, and RSS
	$(PY) -m bench.operator.run
