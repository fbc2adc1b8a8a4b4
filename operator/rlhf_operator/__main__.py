"""`python -m rlhf_operator`: run the operator.

With --lease NAME several replicas may run (what the chart does): the one holding the
coordination.k8s.io Lease NAME reconciles, the others wait to take it
(controller/leader.py). A leader that stops cleanly gives the Lease up at once; one that
dies (SIGKILL, a lost node) is replaced once the Lease expires, --lease-duration seconds
after its last renewal. Each replica names itself by $POD_NAME (the chart sets it).

Without --lease (or with --standalone) it runs alone: run one replica only.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import uuid

import kopf

import rlhf_operator.app.handlers  # noqa: F401  (registers the handlers)
from rlhf_operator.controller.kube import Kube, load_config
from rlhf_operator.controller.leader import LeaderElector, LeaseLock, LeaseTiming


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlhf_operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", help="watch only these namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    replicas = parser.add_mutually_exclusive_group()
    replicas.add_argument(
        "--standalone", action="store_true", help="run alone, no Lease (the default)"
    )
    replicas.add_argument("--lease", metavar="NAME", help="elect a leader through this Lease")
    parser.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="the Lease's namespace (default: $POD_NAMESPACE, else default)",
    )
    parser.add_argument(
        "--lease-duration",
        type=float,
        default=15,
        metavar="SECONDS",
        help="how long a standby waits for a Lease its holder stopped renewing: about the "
        "longest a leader that died is waited for (default 15, controller-runtime's)",
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.lease_duration < 2:
        parser.error("--lease-duration must be at least 2 seconds")

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    if not args.verbose:  # kopf says "Handler ... succeeded" at every watch event
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(
        kopf.operator(
            clusterwide=args.all_namespaces or not args.namespace,
            namespaces=args.namespace or (),
            standalone=True,  # never kopf's peering: the Lease, if any, picks the leader
            memo=kopf.Memo(elector=elector(args.lease, args.lease_namespace, args.lease_duration)),
        )
    )


def elector(lease: str | None, namespace: str, duration: float) -> LeaderElector | None:
    if lease is None:
        return None
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    kube = Kube(load_config(connections=2))
    return LeaderElector(LeaseLock(kube, namespace, lease, identity, LeaseTiming.scaled(duration)))


if __name__ == "__main__":
    main()
