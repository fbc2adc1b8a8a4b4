"""`rlhfjob`: check RLHFJob manifests and print the generated CRD.

rlhfjob validate FILE...   print `FILE: ok` or each error with its field path
rlhfjob crd                print the CustomResourceDefinition (what `make crds` writes)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from rlhf_operator.crd import render_crd_yaml, render_peering_yaml
from rlhf_operator.render import JobRef, render_children
from rlhf_operator.validation import InvalidJob, load_documents, parse_job
from rlhf_trainer.plan import describe, plan_placement


def validate_file(path: Path) -> list[str]:
    """Error lines for one file (empty when every document in it is a valid RLHFJob)."""
    try:
        text = path.read_text()
    except OSError as error:
        return [f"{path}: cannot read: {error.strerror}"]
    try:
        docs = list(load_documents(text))
    except InvalidJob as invalid:
        return [f"{path}: {e}" for e in invalid.errors]
    problems = []
    for index, doc in enumerate(docs):
        where = f"{path}[{index}]" if len(docs) > 1 else str(path)
        try:
            parse_job(doc)
        except InvalidJob as invalid:
            problems += [f"{where}: {e}" for e in invalid.errors]
    return problems


def print_plans(paths: list[Path]) -> int:
    for path in paths:
        problems = validate_file(path)
        if problems:
            print("\n".join(problems))
            return 1
        for doc in load_documents(path.read_text()):
            job = parse_job(doc)
            print(f"{job.metadata.name} ({path})")
            print(describe(plan_placement(job.spec.job_config())))
    return 0


def print_children(path: Path, namespace: str) -> int:
    problems = validate_file(path)
    if problems:
        print("\n".join(problems))
        return 1
    objects = []
    for doc in load_documents(path.read_text()):
        job = parse_job(doc)
        ref = JobRef(
            job.metadata.name,
            job.metadata.namespace or namespace,
            uid="<assigned by the API server>",
        )
        objects += render_children(ref, job.spec)
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rlhfjob", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="validate RLHFJob manifests")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    plan = commands.add_parser("plan", help="print the placement plan of RLHFJob manifests")
    plan.add_argument("files", nargs="+", type=Path, metavar="FILE")
    render = commands.add_parser("render", help="print the objects the operator would create")
    render.add_argument("file", type=Path, metavar="FILE")
    render.add_argument("--namespace", default="default")
    crd = commands.add_parser("crd", help="print the generated CRD YAML")
    crd.add_argument("--peering", action="store_true", help="kopf's peering CRDs instead")
    args = parser.parse_args(argv)

    if args.command == "crd":
        sys.stdout.write(render_peering_yaml() if args.peering else render_crd_yaml())
        return 0
    if args.command == "plan":
        return print_plans(args.files)
    if args.command == "render":
        return print_children(args.file, args.namespace)
    failed = False
    for path in args.files:
        problems = validate_file(path)
        failed |= bool(problems)
        print("\n".join(problems) if problems else f"{path}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
