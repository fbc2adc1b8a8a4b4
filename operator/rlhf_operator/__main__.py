"""`python -m rlhf_operator`: run the operator.

With --peering NAME several replicas may run; the one with the highest --priority is
active and the others wait (kopf peering; needs the KopfPeering CRDs from the chart).
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

import rlhf_operator.app.handlers  # noqa: F401  (registers the handlers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", help="watch only these namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--peering", metavar="NAME", help="coordinate replicas through this peering"
    )
    peering.add_argument("--standalone", action="store_true", help="run alone, no peering")
    parser.add_argument(
        "--priority", type=int, default=0, help="peering priority (highest is active)"
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    asyncio.run(
        kopf.operator(
            clusterwide=args.all_namespaces or not args.namespace,
            namespaces=args.namespace or (),
            peering_name=args.peering,
            standalone=args.standalone or not args.peering,
            priority=args.priority,
        )
    )


if __name__ == "__main__":
    main()
