"""`python -m rlhf_trainer --spec spec.json`: the driver the operator starts on the Ray head.

The spec is the JobConfig JSON the operator writes into the job's ConfigMap. With
`--local` the job runs on this machine, on a simulated Ray cluster shaped like its
pools (logical GPUs; on a CPU-only machine vLLM and torch run on the CPU), and a
`file:` reward is read from the spec's directory unless --reward-files names another.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.names import REWARD_FILES_ENV, REWARD_FILES_MOUNT
from rlhf_trainer.api.plan import describe, plan_placement
from rlhf_trainer.api.rules import field_errors
from rlhf_trainer.api.sections import OutputConfig

if TYPE_CHECKING:
    from rlhf_trainer.telemetry.metrics import TrainerMetrics
    from rlhf_trainer.telemetry.run_folder import RunFolder

JOB_NAME_ENV = "RLHF_JOB_NAME"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_trainer", description=__doc__)
    parser.add_argument("--spec", type=Path, required=True, help="JobConfig JSON file")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate the spec, print the plan and exit"
    )
    parser.add_argument(
        "--local", action="store_true", help="run on a simulated Ray cluster on this machine"
    )
    parser.add_argument(
        "--trace", type=Path, help="write a Chrome trace of the pools here (local: run folder)"
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="local runs: the folder for metrics, trace, charts and (unless the spec names a "
        "path) checkpoints; default runs/<job>",
    )
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free)"
    )
    parser.add_argument(
        "--reward-files",
        type=Path,
        help="the directory a 'file:NAME.py:FUNCTION' reward is read from; default: "
        f"${REWARD_FILES_ENV}, else {REWARD_FILES_MOUNT} (the operator's mount of "
        "models.reward.configMap), or with --local the spec's directory",
    )
    args = parser.parse_args(argv)
    try:
        config = JobConfig.model_validate_json(args.spec.read_text())
    except OSError as error:
        print(f"{args.spec}: cannot read: {error.strerror}", file=sys.stderr)
        return 2
    except ValidationError as error:
        for problem in field_errors(error, prefix=("spec",)):
            print(f"{args.spec}: {problem}", file=sys.stderr)
        return 2
    print(describe(plan_placement(config)))
    if args.dry_run:
        return 0
    job = os.environ.get(JOB_NAME_ENV) or args.spec.stem
    if args.run_dir is not None and not args.local:
        print("--run-dir is for local runs (--local)", file=sys.stderr)
        return 2
    return train(
        config,
        job,
        local=args.local,
        trace=args.trace,
        metrics_port=args.metrics_port,
        run_dir=args.run_dir,
        reward_files=reward_files_for(args.spec, args.reward_files, args.local),
    )


def reward_files_for(spec: Path, given: Path | None, local: bool) -> Path | None:
    """The directory of a `file:` reward: the one given; for a local run, which has no
    ConfigMap, the spec's own directory (the current one for a bare file name); None in a
    cluster: the operator's mount (data.tasks.reward_files)."""
    if given is not None:
        return given.resolve()
    return spec.parent.resolve() if local else None


def train(
    config: JobConfig,
    job: str,
    *,
    local: bool,
    trace: Path | None = None,
    metrics_port: int | None = None,
    run_dir: Path | None = None,
    reward_files: Path | None = None,
) -> int:
    """Run the job to its last step (resuming from a checkpoint); the exit status.
    Bad local settings (the run folder, the metrics port) fail before Ray starts.
    `reward_files`: the directory of a `file:` reward (run_job's default when None)."""
    from rlhf_trainer.telemetry.metrics import TrainerMetrics, serve_metrics
    from rlhf_trainer.telemetry.run_folder import RunFolder, RunFolderError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    folder = RunFolder(run_dir) if run_dir is not None else RunFolder.default(job)
    if local:
        try:
            folder.create()
        except RunFolderError as error:
            print(error, file=sys.stderr)
            return 2
    metrics = TrainerMetrics(pools=[p.name for p in config.pools])
    if metrics_port is not None:
        try:
            server = serve_metrics(metrics.registry, metrics_port)
        except OSError as error:
            print(port_problem(metrics_port, error), file=sys.stderr)
            return 2
        logging.info("metrics on port %d", server.server_port)
    if local:
        local_config = in_run_folder(config, folder)
        return train_locally(local_config, job, folder, metrics, trace, reward_files)
    if not os.environ.get("RAY_ADDRESS"):
        print(
            "no Ray cluster to join: RAY_ADDRESS is not set (a RayJob sets it for its "
            "driver); run with --local to train on a simulated cluster on this machine",
            file=sys.stderr,
        )
        return 2
    return train_on_cluster(config, job, metrics, trace, reward_files)


def train_on_cluster(
    config: JobConfig,
    job: str,
    metrics: TrainerMetrics,
    trace: Path | None,
    reward_files: Path | None,
) -> int:
    """The RayJob's driver: train on the cluster KubeRay started it in, reporting into
    the job's status, and saying there why the attempt failed, if it does."""
    from rlhf_trainer.cluster.local import connect_to_cluster
    from rlhf_trainer.loop.resize import ResizeWatch
    from rlhf_trainer.loop.run import Interrupted, run_job
    from rlhf_trainer.telemetry.report import StatusReporter, failure_line, reporter_from_env

    connect_to_cluster()
    reporter = reporter_from_env()
    watch = ResizeWatch(config, reporter.resizing) if isinstance(reporter, StatusReporter) else None
    try:
        stop = watch or (lambda: False)
        run_job(config, job, reporter, metrics, trace, stop=stop, reward_files=reward_files)
    except Interrupted as stopped:  # only a resize stops a run on the cluster
        logging.info("%s, for a resize; the operator starts the next attempt", stopped)
    except Exception as error:
        if isinstance(reporter, StatusReporter):
            reporter.report_failure(failure_line(error))
        raise
    return 0


def port_problem(port: int, error: OSError) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"metrics port {port} is in use (choose another, or 0 for any free port)"
    return f"metrics port {port}: cannot serve on it: {error.strerror or error}"


def in_run_folder(config: JobConfig, folder: RunFolder) -> JobConfig:
    """The checkpoints and the trained policy go into the run folder unless the spec
    names their paths. Validated again, as the spec was: every rule holds for the
    config that runs."""
    spec = config.model_dump(by_alias=True)
    if spec["trainer"]["checkpoint"]["path"] is None:
        spec["trainer"]["checkpoint"]["path"] = str(folder.checkpoints)
    if spec["output"] is None:
        spec["output"] = OutputConfig(path=str(folder.model.resolve())).model_dump(by_alias=True)
    return JobConfig.model_validate(spec)


def train_locally(
    config: JobConfig,
    job: str,
    folder: RunFolder,
    metrics: TrainerMetrics,
    trace: Path | None,
    reward_files: Path | None = None,
) -> int:
    """Train on a simulated cluster on this machine, with a live bar, the run folder and
    a summary at the end. Ctrl-C checkpoints and stops: exit status 130."""
    from rich.console import Console

    from rlhf_trainer.cluster.local import local_environments, local_ray_cluster
    from rlhf_trainer.loop.interrupt import stop_on_interrupt
    from rlhf_trainer.loop.run import Interrupted, run_job
    from rlhf_trainer.telemetry.local_run import LocalRunWatch
    from rlhf_trainer.telemetry.progress import LiveProgress, SilentReporter, Summary
    from rlhf_trainer.telemetry.report import reporter_from_env

    started = time.time()
    console = Console()
    console.print(f"run folder: {folder.path.resolve()}", soft_wrap=True)
    total = config.trainer.total_steps
    progress = LiveProgress(console, total)
    reporter = SilentReporter() if progress.live else reporter_from_env()
    every = config.trainer.checkpoint.every_steps
    watch = LocalRunWatch(folder, metrics, progress, config.samples_per_step, every)
    interrupted: Interrupted | None = None
    with (
        stop_on_interrupt() as stop,
        progress,
        local_environments(config) as config,
        local_ray_cluster(config),
    ):
        try:
            trace = trace or folder.trace
            final = run_job(config, job, reporter, metrics, trace, watch, stop, reward_files)
            last_checkpoint, output = final.last_checkpoint, final.output
        except Interrupted as stopped:
            interrupted, last_checkpoint, output = stopped, stopped.checkpoint, None
    records = watch.finish()
    wall = time.time() - started
    summary = Summary(records, total, wall, folder.path.resolve(), last_checkpoint,
                      folder.evaluations(), output)  # fmt: skip
    console.print(summary.table())
    console.print(f"run folder: {folder.path.resolve()}", soft_wrap=True)
    if interrupted is not None:
        message = f"{interrupted}; run the same command again to resume"
        console.print(message, soft_wrap=True)  # whole, even in an 80-column log
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
