"""Start the test control plane for a person: `python -m tests.controlplane`.

Prints the KUBECONFIG to use and runs until Ctrl-C. With --measure it prints how
long the start took (per phase, as JSON) and stops again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time

from . import demo
from .harness import BIN_DIR, ControlPlane, build_binaries, missing_binaries
from .kuberay_in_cluster import NAMESPACE as KUBERAY_NAMESPACE
from .kuberay_in_cluster import kuberay_in_cluster
from .network_policies import NAMESPACE as ENFORCER_NAMESPACE
from .network_policies import network_policies_enforced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.controlplane",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--measure", action="store_true", help="start, print start-up timings, stop"
    )
    parser.add_argument(
        "--no-build", action="store_true", help="do not run `make controlplane` first"
    )
    args = parser.parse_args(argv)

    if not args.no_build:
        print(
            f"building control-plane binaries into {BIN_DIR} (first time: many minutes) ...",
            flush=True,
        )
        build_binaries()
    elif missing_binaries():
        print(f"missing binaries: {missing_binaries()}", file=sys.stderr)
        return 1

    # Ctrl-C and `kill` both end in a clean stop (SIGTERM would otherwise skip `finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C must work even when started from a script that ignores SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cp = ControlPlane()
    try:
        cp.start()
        timings = {
            "startup_seconds": round(cp.startup_seconds, 2),
            "phases": cp.phase_seconds,
            "real_node": cp.real_node.name if cp.real_node else cp.real_node_absent,
        }
        if args.measure:
            print(json.dumps(timings))
            return 0
        print(f"control plane up in {cp.startup_seconds:.1f}s; logs in {cp.logs_dir}")
        with contextlib.ExitStack() as stack:
            if cp.real_node:
                print("loading the images into the real node (first time: a few minutes) ...")
                claim = demo.prepare(cp)
                stack.enter_context(network_policies_enforced(cp))
                stack.enter_context(kuberay_in_cluster(cp))
                print(f"real node {cp.real_node.name} at {cp.real_node.node_ip}: the pods of "
                      f"namespaces {demo.OPERATOR_NAMESPACE} and {demo.JOBS_NAMESPACE} run "
                      f"there, KubeRay's in {KUBERAY_NAMESPACE} and the NetworkPolicy "
                      f"enforcer's in {ENFORCER_NAMESPACE} (tests/controlplane/demo.py, "
                      "kuberay_in_cluster.py, network_policies.py)")  # fmt: skip
                print(f"the claim {demo.JOBS_NAMESPACE}/checkpoints is {claim} on this machine")
            else:
                print(f"no real node: {cp.real_node_absent}")
            print(f"\n    export KUBECONFIG={cp.kubeconfig}")
            print(f"    export PATH={BIN_DIR}:$PATH   # kubectl, helm\n")
            print("Ctrl-C stops it.", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping ...", flush=True)
        cp.stop()


if __name__ == "__main__":
    sys.exit(main())
