"""`python -m rlhf_operator`: run the operator.

With --peering NAME several replicas may run; the one with the highest --priority is
active and the others wait (kopf peering; needs the KopfPeering CRDs from the chart).
A replica that stops cleanly leaves the peering at once; one that dies (SIGKILL, a lost
node) is replaced once its record expires, --peering-lifetime seconds after its last
keep-alive.
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
    parser.add_argument(
        "--peering-lifetime",
        type=int,
        default=60,
        metavar="SECONDS",
        help="how long a replica's peering record lasts unrenewed: about the longest a "
        "standby waits for an active replica that died (default 60, kopf's)",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.peering_lifetime < 1:
        parser.error("--peering-lifetime must be at least 1 second")

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if not args.verbose:  # kopf says "Handler ... succeeded" at every watch event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = args.peering_lifetime
    asyncio.run(
        kopf.operator(
            clusterwide=args.all_namespaces or not args.namespace,
            namespaces=args.namespace or (),
            peering_name=args.peering,
            standalone=args.standalone or not args.peering,
            priority=args.priority,
            settings=settings,
        )
    )


if __name__ == "__main__":
    main()
