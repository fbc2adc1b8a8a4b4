"""`python -m rlhf_trainer --spec spec.json`: the driver the operator starts on the Ray head.

The spec is the JobConfig JSON the operator writes into the job's ConfigMap.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from rlhf_trainer.config import JobConfig
from rlhf_trainer.plan import describe, plan_placement
from rlhf_trainer.rules import field_errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf_trainer", description=__doc__)
    parser.add_argument("--spec", type=Path, required=True, help="JobConfig JSON file")
    parser.add_argument(
        "--dry-run", action="store_true", help="validate the spec, print the plan and exit"
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
    print("the PPO loop is not built yet; only --dry-run works in this version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
