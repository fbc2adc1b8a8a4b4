"""The trainer's status reporter against the real API server, as the job's reporter
service account (no operator needed: the test creates what the operator would)."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import yaml

from rlhf_operator.api.job import Phase, RLHFJobStatus
from rlhf_operator.render.children import JobRef, render_reporter_rbac
from rlhf_trainer.api.progress import EvalProgress, PoolResize, TrainingProgress
from rlhf_trainer.telemetry.report import ApiServer, StatusReporter

from .harness import REPO_ROOT, ControlPlane
from .util import get_json


def create_job(cp: ControlPlane, namespace: str, name: str) -> JobRef:
    manifest: dict[str, Any] = yaml.safe_load((REPO_ROOT / "examples/colocated.yaml").read_text())
    manifest["metadata"]["name"] = name
    cp.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))
    uid = get_json(cp, "rlhfjob", name, "-n", namespace)["metadata"]["uid"]
    return JobRef(name, namespace, uid)


def test_the_reporter_patches_its_own_jobs_training_status_and_no_other(
    controlplane: ControlPlane, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    cp = controlplane
    job = create_job(cp, namespace, "colocated")
    other = create_job(cp, namespace, "other")
    rbac = render_reporter_rbac(job)
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))
    token = cp.kubectl("create", "token", job.reporter, "-n", namespace).stdout.strip()
    server = ApiServer(cp.server, lambda: token, cp.ca_file)

    held_out = EvalProgress(
        step=5,
        policy_version=5,
        prompts=64,
        samples_per_prompt=4,
        reward_mean=0.375,
        pass_at_1=0.25,
        pass_at_k=0.5,
        response_length_mean=4.5,
    )
    progress = TrainingProgress(
        step=7,
        total_steps=500,
        samples_per_second=12.5,
        policy_version=7,
        reward_mean=0.25,
        eval=held_out,
    )
    assert StatusReporter(job.name, namespace, server).report(progress, final=True)
    status = get_json(cp, "rlhfjob", job.name, "-n", namespace).get("status", {})
    assert status["training"] == progress.to_dict()

    # A later report replaces the fields it sets and keeps the rest (a merge patch).
    later = progress.model_copy(update={"step": 8, "last_checkpoint": "/ckpt/step-8"})
    assert StatusReporter(job.name, namespace, server).report(later, final=True)
    status = get_json(cp, "rlhfjob", job.name, "-n", namespace)["status"]
    assert status["training"] == later.to_dict()

    with caplog.at_level(logging.WARNING):
        assert not StatusReporter(other.name, namespace, server).report(progress, final=True)
    assert "HTTP 403" in caplog.text and "forbidden" in caplog.text
    assert token not in caplog.text
    other_status = get_json(cp, "rlhfjob", other.name, "-n", namespace).get("status") or {}
    assert "training" not in other_status, json.dumps(other_status)


def test_the_reporter_reads_the_pools_the_operator_resizes(
    controlplane: ControlPlane, namespace: str
) -> None:
    """What the driver reads between steps (loop.resize), as the reporter account: the
    operator's status.resizing, in the operator's own wire format."""
    cp = controlplane
    job = create_job(cp, namespace, "resized")
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(render_reporter_rbac(job)))
    token = cp.kubectl("create", "token", job.reporter, "-n", namespace).stdout.strip()
    reporter = StatusReporter(job.name, namespace, ApiServer(cp.server, lambda: token, cp.ca_file))
    assert reporter.resizing() == []
    resizing = RLHFJobStatus(
        phase=Phase.RESIZING,
        resizing=[PoolResize(pool="policy", from_replicas=1, to_replicas=2)],
    )
    cp.kubectl("patch", "rlhfjob", job.name, "-n", namespace, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": resizing.to_dict()}))  # fmt: skip
    assert reporter.resizing() == resizing.resizing
