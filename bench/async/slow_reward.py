"""Benchmark: PPO scored by a slow reward service, its samples scored as they finish
(ScoresAhead) against scored when the step takes them, fully async and synchronous, in
one run.

The jobs are bench-async's at its old size, `run.TRAIN_BOUND`, where this bench's
figures were measured (rollout and train pools of one simulated GPU each; fully
async at stalenessThreshold 1 with a weight sync every 2 steps, and the same job
synchronous, split) with models.reward.url: the toy copy rule served over HTTP by
rlhf_env's reward app in a process of its own, taking SECONDS_PER_SAMPLE (0.06) for
each sample it scores, as a judge model would: a batch of 32, one sample after another,
takes it 1.9 s, more than generating it. Scored at the step, the driver waits for the
service inside each step (synchronous: beside the pools' log-probs and values); scored
ahead, the service works while the engines generate, and the step waits only for what
it is behind.

"at the step" is the same run with `scores_ahead` answering False: the step's samples
spread over 8 requests at once (models.reward.requests.concurrency), as the client
sends them; "one request" is the fully-async loop before that spread, a step's 32
samples in one request (concurrency 1). Against "at the step", the gain of "ahead" is
the overlap alone. Interleaved, 3 repeats by default (median and min-max).
Run: .venv/bin/python -m bench.async.slow_reward [measured steps] [seconds per sample]
[repeats] (about 20 minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from unittest import mock

import httpx

from bench.harness import Measurement, run_bench
from bench.runs import measure_run
from rlhf_env.process import free_port
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.data.tasks import toy_copy

from .run import TRAIN_BOUND, WARMUP_STEPS
from .run import job as async_job

ARGS = sys.argv if __name__ == "__main__" else sys.argv[:1]  # (the service imports this)
MEASURED_STEPS = int(ARGS[1]) if len(ARGS) > 1 else 10
SECONDS_PER_SAMPLE = float(
    ARGS[2] if len(ARGS) > 2 else os.environ.get("SECONDS_PER_SAMPLE", "0.06")
)
REPEATS = int(ARGS[3]) if len(ARGS) > 3 else 3


def slow_copy_reward(prompt: str, response: str, **row: object) -> float:
    time.sleep(SECONDS_PER_SAMPLE)
    return toy_copy(prompt, response)


def job(url: str, concurrency: int, fully_async: bool, checkpoints: Path) -> JobConfig:
    config = async_job(fully_async, checkpoints, TRAIN_BOUND)
    spec = config.model_dump(by_alias=True, exclude_none=True)
    spec["models"]["reward"] = {"url": url, "requests": {"concurrency": concurrency}}
    spec["trainer"]["totalSteps"] = WARMUP_STEPS + MEASURED_STEPS
    return JobConfig.model_validate(spec)


def measure(url: str, ahead: bool, concurrency: int = 8, fully_async: bool = True) -> Measurement:
    """samples/s over the measured steps, and the step's mean seconds."""
    with mock.patch("rlhf_trainer.loop.setup.scores_ahead", return_value=ahead):
        measured, figures = measure_run(partial(job, url, concurrency, fully_async), WARMUP_STEPS)
    return {
        "samples_per_s": TRAIN_BOUND.samples * len(measured) / sum(s.seconds for s in measured),
        "step_s": figures["step_s"],
    }


def compare(run: dict[str, Measurement]) -> Measurement:
    ahead, at_the_step = run["ahead"]["samples_per_s"], run["at_the_step"]["samples_per_s"]
    one_request = run["one_request"]["samples_per_s"]
    sync_ahead = run["sync_ahead"]["samples_per_s"]
    return {
        "speedup": ahead / at_the_step,  # the overlap alone
        "spread_speedup": at_the_step / one_request,
        "speedup_over_one_request": ahead / one_request,
        "sync_speedup": sync_ahead / run["sync_at_the_step"]["samples_per_s"],
    }


@contextmanager
def reward_service() -> Iterator[str]:
    """`python -m rlhf_env serve-reward` of slow_copy_reward, a process of its own as a
    remote service is (in this one it would take the driver's CPU); yields its URL."""
    port = free_port()
    command = [sys.executable, "-m", "rlhf_env", "serve-reward",
               "bench.async.slow_reward:slow_copy_reward", "--port", str(port),
               "--log-level", "warning"]  # fmt: skip
    env = os.environ | {"SECONDS_PER_SAMPLE": str(SECONDS_PER_SAMPLE)}
    server = subprocess.Popen(command, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while not healthy(url):
            if server.poll() is not None:
                raise RuntimeError(f"the reward service exited with {server.returncode}")
            time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait()


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1.0).is_success
    except httpx.TransportError:
        return False


def main() -> None:
    with reward_service() as url:
        run_bench(
            "async_slow_reward",
            {
                "one_request": partial(measure, url, False, 1),
                "at_the_step": partial(measure, url, False),
                "ahead": partial(measure, url, True),
                "sync_at_the_step": partial(measure, url, False, fully_async=False),
                "sync_ahead": partial(measure, url, True, fully_async=False),
            },
            REPEATS,
            compare,
            measured_steps=MEASURED_STEPS,
            seconds_per_sample=SECONDS_PER_SAMPLE,
        )


if __name__ == "__main__":
    main()
