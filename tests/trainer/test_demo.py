"""The README's first command, `make demo`, run as a person runs it: the Makefile's own
recipe and environment, cut to a few steps by DEMO_STEPS (nothing else differs). Then
the run folder it leaves: the metrics of every step, the charts, the trace, the held-out
evaluations and the trained policy as a Hugging Face model.

The recipe starts afresh, so this replaces the repository's runs/local-cpu/ (as every
`make demo` does)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow  # a local run: Ray, vLLM and the roles start (about 30 s)

ROOT = Path(__file__).resolve().parents[2]
RUN_FOLDER = ROOT / "runs" / "local-cpu"
STEPS = 6
TIMEOUT_S = 300  # about 30 s alone; the machine's two cores are shared with other tests
# What a parent `make test` passes down to a sub-make: a person typing `make demo` has none.
PARENT_MAKE = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES"}


def test_make_demo_trains_and_leaves_its_run_folder() -> None:
    environment = {k: v for k, v in os.environ.items() if k not in PARENT_MAKE}
    demo = subprocess.run(
        ["make", "demo", f"DEMO_STEPS={STEPS}"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output[-4000:]
    assert "Run summary" in output and f"{STEPS}/{STEPS}" in output, output[-4000:]

    records = json_lines(RUN_FOLDER / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(0 <= r["reward_mean"] <= 1 for r in records)
    evaluations = json_lines(RUN_FOLDER / "eval.jsonl")
    assert [e["step"] for e in evaluations] == [0, STEPS]  # before training, and at its end

    for chart in ("reward_kl.png", "pool_busy.png"):
        with Image.open(RUN_FOLDER / chart) as image:
            assert image.format == "PNG" and min(image.size) > 100

    events = json.loads((RUN_FOLDER / "trace.json").read_text())["traceEvents"]
    spans = {e["name"] for e in events if e["ph"] == "X"}
    assert {"generate", "update_actor", "update_critic", "sync_weights"} <= spans, sorted(spans)

    model = AutoModelForCausalLM.from_pretrained(RUN_FOLDER / "model")
    assert model.config.hidden_size == 128  # the example's tiny qwen2
    assert next(model.parameters()).dtype == torch.bfloat16


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
