"""The placement estimator checked two ways: against the CPU benches (`predicted_step`,
which the split and async benches call within each repeat) and against a published
figure (`paper.py`: verl's 7B runs)."""

from __future__ import annotations

from bench.harness import Measurement
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.estimate import calibrate, estimate, load_profile

TOY_PROMPT_TOKENS = 5  # `<s> c a f =`


def predicted_step(
    measured_job: JobConfig,
    measured: Measurement,
    target: JobConfig,
    generate_tokens_per_second: float | None = None,
) -> float:
    """The target job's step time, estimated from rates calibrated on a run of another
    job with the same model and workload (one whose phases run one after another). The
    slowdown of work beside another pool's comes from the bundled cpu-2core profile.
    `generate_tokens_per_second`: a generation rate per GPU measured apart (a stream's,
    which waits for no batch's longest response), instead of the run's."""
    like = load_profile("cpu-2core").model_copy(
        update={"prompt_tokens": TOY_PROMPT_TOKENS, "response_tokens": measured["response_tokens"]}
    )
    phases = {k.removeprefix("phase."): v for k, v in measured.items() if k.startswith("phase.")}
    driver = measured["driver_share"] * measured["step_s"]
    profile = calibrate(measured_job, phases, driver, like)
    if generate_tokens_per_second is not None:
        profile = profile.model_copy(
            update={"generate_tokens_per_second": generate_tokens_per_second}
        )
    return estimate(target, profile).step_seconds
