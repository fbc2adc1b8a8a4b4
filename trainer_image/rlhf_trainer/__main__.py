"""`python -m rlhf_trainer --spec spec.json`: the driver the operator starts on the Ray head.

The spec is the JobConfig JSON the operator writes into the job's ConfigMap. With
`--local` the job runs on this machine, on a simulated Ray cluster shaped like its
pools (logical GPUs; on a CPU-only machine vLLM and torch run on the CPU).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.plan import describe, plan_placement
from rlhf_trainer.api.rules import field_errors

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
    parser.add_argument("--trace", type=Path, help="write a Chrome trace of the pools here")
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free)"
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
    return train(config, job, local=args.local, trace=args.trace, metrics_port=args.metrics_port)


def train(
    config: JobConfig,
    job: str,
    *,
    local: bool,
    trace: Path | None = None,
    metrics_port: int | None = None,
) -> int:
    """Run the job to its last step (resuming from a checkpoint); the exit status."""
    from rlhf_trainer.cluster.local import connect_to_cluster, local_ray_cluster
    from rlhf_trainer.loop.run import run_job
    from rlhf_trainer.telemetry.metrics import TrainerMetrics, serve_metrics
    from rlhf_trainer.telemetry.report import reporter_from_env

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    metrics = TrainerMetrics(pools=[p.name for p in config.pools])
    if metrics_port is not None:
        server = serve_metrics(metrics.registry, metrics_port)
        logging.info("metrics on port %d", server.server_port)
    if local:
        with local_ray_cluster(config):
            run_job(config, job, reporter_from_env(), metrics, trace)
    elif not os.environ.get("RAY_ADDRESS"):
        print(
            "no Ray cluster to join: RAY_ADDRESS is not set (a RayJob sets it for its "
            "driver); run with --local to train on a simulated cluster on this machine",
            file=sys.stderr,
        )
        return 2
    else:
        connect_to_cluster()  # the cluster KubeRay started this driver in
        run_job(config, job, reporter_from_env(), metrics, trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
