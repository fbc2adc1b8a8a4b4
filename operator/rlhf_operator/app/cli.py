"""`rlhfjob`: check RLHFJob manifests and print the generated CRD.

rlhfjob validate FILE...   print `FILE: ok` or each error with its field path
rlhfjob plan FILE...       print each job's placement plan and memory per GPU
  --estimate [--profile P]   and its step time, pool busy shares and balanced split
rlhfjob render FILE        print the objects the operator would create
rlhfjob train FILE         run the job on this machine (a simulated Ray cluster)
  --cpu [--steps N]          on CPUs even where there is CUDA; N steps, not totalSteps
rlhfjob export CHECKPOINT DIR [--dtype bf16|fp32] [--adapter] [--spec FILE]
                           write a checkpoint's policy as a Hugging Face directory
rlhfjob crd                print the CustomResourceDefinition (what `make crds` writes)
  --reference                the field reference page instead (docs/reference/rlhfjob.md)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError

from rlhf_operator.api.crd import render_crd_yaml
from rlhf_operator.api.job import RLHFJob, Separation
from rlhf_operator.api.reference import render_reference_markdown
from rlhf_operator.api.validation import InvalidJob, load_documents, parse_job, unmounted_paths
from rlhf_operator.render.children import SPEC_FILE, JobRef, render_children
from rlhf_operator.render.network import NetworkAccess
from rlhf_trainer.api.config import JobConfig
from rlhf_trainer.api.estimate import describe_estimate, load_profile
from rlhf_trainer.api.memory_report import describe_memory
from rlhf_trainer.api.plan import describe, plan_placement


def positive_int(text: str) -> int:
    """argparse's type for a count of one or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return int(text)


def read_jobs(path: Path, memory: bool = True) -> tuple[list[RLHFJob], list[str]]:
    """The valid RLHFJobs in a file, and an error line for each problem found (`memory`:
    a pool that cannot fit its roles is one)."""
    try:
        docs = list(load_documents(path.read_text()))
    except OSError as error:
        return [], [f"{path}: cannot read: {error.strerror}"]
    except InvalidJob as invalid:
        return [], [f"{path}: {e}" for e in invalid.errors]
    jobs, problems = [], []
    for index, doc in enumerate(docs):
        where = f"{path}[{index}]" if len(docs) > 1 else str(path)
        try:
            jobs.append(parse_job(doc, memory))
        except InvalidJob as invalid:
            problems += [f"{where}: {e}" for e in invalid.errors]
    return jobs, problems


def validate_files(paths: list[Path]) -> int:
    """`FILE: ok` (with any warnings) or each error; non-zero if any file has one."""
    failed = False
    for path in paths:
        jobs, problems = read_jobs(path)
        failed |= bool(problems)
        print("\n".join(problems) if problems else f"{path}: ok")
        for job in jobs:
            for warning in unmounted_paths(job.spec):
                print(f"{path}: warning: {warning}")
    return 1 if failed else 0


def print_plans(paths: list[Path], profile_name: str | None = None) -> int:
    """Each job's plan, and with a cost profile (a bundled name or a file) its estimate."""
    try:
        profile = load_profile(profile_name) if profile_name is not None else None
    except ValueError as error:
        print(error, file=sys.stderr)
        return 1
    for path in paths:
        jobs, problems = read_jobs(path, memory=False)  # the table shows what cannot fit
        if problems:
            print("\n".join(problems))
            return 1
        for job in jobs:
            config = job.spec.job_config(job.metadata.name)  # as in a cluster
            print(f"{job.metadata.name} ({path})")
            print(describe(plan_placement(config)))
            print(describe_memory(config))
            if profile is not None:
                share_nodes = job.spec.separation is Separation.GPU
                try:
                    print(describe_estimate(config, profile, share_nodes))
                except ValueError as error:  # the profile cannot price this job
                    print(f"{path}: {error}", file=sys.stderr)
                    return 1
    return 0


def print_children(path: Path, namespace: str) -> int:
    jobs, problems = read_jobs(path)
    if problems:
        print("\n".join(problems))
        return 1
    objects = []
    for job in jobs:
        where = job.metadata.namespace or namespace
        ref = JobRef(job.metadata.name, where, uid="<assigned by the API server>")
        # As the operator does: with the chart's NetworkPolicy setting, the job's policy too.
        objects += render_children(ref, job.spec, NetworkAccess.from_env())
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


def train_locally(
    path: Path, trace: Path | None, run_dir: Path | None, cpu: bool = False,
    steps: int | None = None,
) -> int:  # fmt: skip
    """Run a one-job file on this machine; needs the trainer stack (make install).

    The trainer runs as its own process, `python -m rlhf_trainer --local`, on the spec the
    operator would hand over: the operator package imports only the trainer's API. A
    `file:` reward is read from the manifest's directory (there is no ConfigMap).
    `cpu`: every pool computes on CPUs even where the machine has CUDA (the trainer is
    shown no device). `steps`: train this many steps instead of trainer.totalSteps.
    """
    jobs, problems = read_jobs(path)
    if problems or len(jobs) != 1:
        print("\n".join(problems) or f"{path}: expected one RLHFJob, found {len(jobs)}")
        return 1
    job = jobs[0]
    with tempfile.TemporaryDirectory(prefix="rlhfjob-") as directory:
        spec = Path(directory) / f"{job.metadata.name}.json"  # the driver names the job by it
        try:
            config = job.spec.job_config()  # serve environments: the trainer serves them here
        except ValueError as error:
            print(f"{path}: {error}")
            return 1
        if steps is not None:
            trainer = config.trainer.model_copy(update={"total_steps": steps})
            config = config.model_copy(update={"trainer": trainer})
        spec.write_text(config.model_dump_json(by_alias=True, exclude_none=True))
        command = [sys.executable, "-m", "rlhf_trainer", "--spec", str(spec), "--local"]
        # No ConfigMap here: a file: reward is read from beside the manifest.
        command += ["--reward-files", str(path.parent.resolve())]
        if trace is not None:
            command += ["--trace", str(trace)]
        if run_dir is not None:
            command += ["--run-dir", str(run_dir)]
        # An empty CUDA_VISIBLE_DEVICES hides every device from torch, vLLM and the
        # simulated cluster's workers (cluster.local.MachineGpus).
        hidden = {"CUDA_VISIBLE_DEVICES": ""} if cpu else {}
        return run_in_foreground(command, os.environ | hidden)


def export_checkpoint(
    checkpoint: Path, directory: Path, dtype: str | None, spec: Path | None, adapter: bool = False
) -> int:
    """Write a committed checkpoint's policy as a Hugging Face directory; needs the
    trainer stack, not Ray. Its own process, as `train`: the operator imports only the
    trainer's API. `spec`: the job's spec, for a checkpoint that does not keep it (any
    form `spec_for_export` reads). `adapter`: a LoRA'd actor's adapter alone, not merged
    into its base. `dtype` None: the export's default (fp32 for a LoRA merged into its
    base, else bf16)."""
    command = [sys.executable, "-m", "rlhf_trainer.export", str(checkpoint), str(directory)]
    command += (["--dtype", dtype] if dtype else []) + (["--adapter"] if adapter else [])
    if spec is None:
        return run_in_foreground(command)
    config, problems = spec_for_export(spec)
    if config is None:
        print("\n".join(problems))
        return 1
    with tempfile.TemporaryDirectory(prefix="rlhfjob-") as temp:
        handed = Path(temp) / SPEC_FILE
        handed.write_text(config.model_dump_json(by_alias=True, exclude_none=True))
        return run_in_foreground([*command, "--spec", str(handed)])


SPEC_FORMS = (
    "an RLHFJob manifest, the job's spec ConfigMap (kubectl get configmap JOB-spec -o yaml) "
    f"or its {SPEC_FILE} key"
)


def spec_for_export(spec: Path) -> tuple[JobConfig | None, list[str]]:
    """The job's trainer-facing config from `spec`: an RLHFJob manifest (as `train`
    reads it), the job's spec ConfigMap as kubectl prints it (`<job>-spec`, which the
    operator renders), or that ConfigMap's spec.json itself; else the errors."""
    try:
        docs = list(load_documents(spec.read_text()))
    except OSError as error:
        return None, [f"{spec}: cannot read: {error.strerror}"]
    except InvalidJob as invalid:
        return None, [f"{spec}: {e}" for e in invalid.errors]
    doc = docs[0] if len(docs) == 1 and isinstance(docs[0], dict) else {}
    if doc and (doc.get("kind") == "ConfigMap" or "kind" not in doc):
        text = (doc.get("data") or {}).get(SPEC_FILE) if "kind" in doc else json.dumps(doc)
        if not isinstance(text, str):
            return None, [f"{spec}: a ConfigMap with no {SPEC_FILE} key; expected {SPEC_FORMS}"]
        try:
            return JobConfig.model_validate_json(text), []
        except ValidationError as error:
            return None, [f"{spec}: not the job's config ({SPEC_FORMS}): {error}"]
    jobs, problems = read_jobs(spec)
    if problems or len(jobs) != 1:
        return None, problems or [f"{spec}: expected one RLHFJob, found {len(jobs)}"]
    return jobs[0].spec.job_config(jobs[0].metadata.name), []


def run_in_foreground(command: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run the command and return its exit status, as a shell would (128 + the signal).

    Ctrl-C reaches the terminal's whole process group, the child too: the child handles
    it (the trainer checkpoints, then exits), so this process ignores it and waits.
    A Python handler, not SIG_IGN, because exec resets handlers but inherits SIG_IGN.
    """
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        status = subprocess.run(command, check=False, env=env).returncode
    finally:
        signal.signal(signal.SIGINT, previous)
    return 128 - status if status < 0 else status


def crd_text(reference: bool) -> str:
    """What `rlhfjob crd` prints: the CRD or its field reference."""
    return render_reference_markdown() if reference else render_crd_yaml()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlhfjob", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="validate RLHFJob manifests")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    plan = commands.add_parser("plan", help="print the placement plan of RLHFJob manifests")
    plan.add_argument("files", nargs="+", type=Path, metavar="FILE")
    plan.add_argument(
        "--estimate",
        action="store_true",
        help="estimate step time, pool busy shares and samples/s; suggest a balanced split",
    )
    plan.add_argument(
        "--profile",
        default="cpu-2core",
        help="the cost profile: a bundled name (cpu-2core, h20-qwen2.5-math-7b) or a YAML file",
    )
    render = commands.add_parser("render", help="print the objects the operator would create")
    render.add_argument("file", type=Path, metavar="FILE")
    render.add_argument("--namespace", default="default")
    train = commands.add_parser("train", help="run an RLHFJob on this machine (Ray simulated)")
    train.add_argument("file", type=Path, metavar="FILE")
    train.add_argument(
        "--trace", type=Path, help="write a Chrome trace of the pools here (default: run folder)"
    )
    train.add_argument(
        "--run-dir",
        type=Path,
        help="the run folder: metrics, trace, charts, checkpoints (default: runs/<job name>)",
    )
    train.add_argument(
        "--cpu",
        action="store_true",
        help="compute on CPUs even where this machine has CUDA (its GPUs stay unused; "
        "the pools' GPUs are simulated)",
    )
    train.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help="train N steps instead of the spec's trainer.totalSteps",
    )
    export = commands.add_parser(
        "export", help="write a checkpoint's policy as a Hugging Face directory (no Ray)"
    )
    export.add_argument(
        "checkpoint", type=Path, metavar="CHECKPOINT", help="a committed step-NNNNNNNN directory"
    )
    export.add_argument("directory", type=Path, metavar="DIR", help="replaced whole when done")
    export.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        help="default: fp32 for a LoRA merged into its base (bf16 would round its update "
        "away), else bf16",
    )
    export.add_argument(
        "--adapter", action="store_true", help="a LoRA'd actor's adapter alone (peft), not merged"
    )
    export.add_argument(
        "--spec",
        type=Path,
        metavar="FILE",
        help=f"the job's spec ({SPEC_FORMS}), for a checkpoint written before checkpoints kept it",
    )
    crd = commands.add_parser("crd", help="print the generated CRD YAML")
    crd.add_argument(
        "--reference", action="store_true", help="the CRD's field reference, as Markdown"
    )
    args = parser.parse_args(argv)

    if args.command == "crd":
        sys.stdout.write(crd_text(args.reference))
        return 0
    if args.command == "plan":
        return print_plans(args.files, args.profile if args.estimate else None)
    if args.command == "render":
        return print_children(args.file, args.namespace)
    if args.command == "train":
        return train_locally(args.file, args.trace, args.run_dir, args.cpu, args.steps)
    if args.command == "export":
        return export_checkpoint(
            args.checkpoint, args.directory, args.dtype, args.spec, args.adapter
        )
    return validate_files(args.files)


if __name__ == "__main__":
    sys.exit(main())
