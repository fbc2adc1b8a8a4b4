"""`rlhfjob`: check RLHFJob manifests and print the generated CRD.

    rlhfjob validate FILE...   print `FILE: ok` or each error with its field path
    rlhfjob crd                print the CustomResourceDefinition (what `make crds` writes)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf_operator.crd import render_crd_yaml
from rlhf_operator.validation import InvalidJob, load_documents, parse_job


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhfjob", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="validate RLHFJob manifests")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    commands.add_parser("crd", help="print the generated CRD YAML")
    args = parser.parse_args(argv)

    if args.command == "crd":
        sys.stdout.write(render_crd_yaml())
        return 0
    failed = False
    for path in args.files:
        problems = validate_file(path)
        failed |= bool(problems)
        print("\n".join(problems) if problems else f"{path}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
