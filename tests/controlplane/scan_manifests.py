"""`make lint`'s manifest scan: kube-score over what the product puts on a cluster.

That is the chart's rendered output (defaults, and every option on) and the children
`rlhfjob render` makes of every example. kube-score knows Pods but not RayJobs, so each
RayJob's pod templates (the head, each pool, the submitter) are scanned as Pods. The
examples are rendered as the operator renders them when the chart enables NetworkPolicies.
Findings that do not apply are listed in kube-score-exceptions.yaml: each names its
check, the objects it covers (kind/name globs) and why.

    python -m tests.controlplane.scan_manifests   # exit 1 on any finding
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from rlhf_operator.render.network import ENV as NETWORK_ENV

from .harness import BIN_DIR, REPO_ROOT

Manifest = dict[str, Any]
CHART = REPO_ROOT / "charts" / "rlhf-operator"
EXCEPTIONS = Path(__file__).with_name("kube-score-exceptions.yaml")
# Release name -> values: one release with the defaults, one with every option on.
CHART_RELEASES = {
    "defaults": [],
    "everything-on": [
        *("--set", "replicas=2", "--set", "networkPolicy.enabled=true"),
        *("--set-json", 'watchNamespaces=["team-a"]'),
        *("--set", "dashboards.enabled=true"),
    ],
}


def chart_network_access() -> dict[str, Any]:
    """What the chart passes the operator with networkPolicy.enabled and its default
    values: where Prometheus and KubeRay run."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]
    return {peer: values[peer] for peer in ("prometheus", "kuberay")}


def helm_template(release: str, *values: str) -> list[Manifest]:
    """The chart rendered as `release` in namespace rlhf-system, with --set-style values."""
    out = run([BIN_DIR / "helm", "template", release, CHART, "-n", "rlhf-system", *values])
    return [doc for doc in yaml.safe_load_all(out) if doc]


def chart_manifests() -> list[Manifest]:
    return [doc for release, values in CHART_RELEASES.items()
            for doc in helm_template(release, *values)]  # fmt: skip


def example_manifests() -> list[Manifest]:
    rlhfjob = Path(sys.executable).with_name("rlhfjob")
    env = os.environ | {NETWORK_ENV: json.dumps(chart_network_access())}
    docs: list[Manifest] = []
    for example in sorted((REPO_ROOT / "examples").glob("*.yaml")):
        out = run([rlhfjob, "render", example, "--namespace", "team-a"], env)
        for doc in yaml.safe_load_all(out):
            docs += rayjob_pods(doc) if doc["kind"] == "RayJob" else [doc]
    return docs


def rayjob_pods(rayjob: Manifest) -> list[Manifest]:
    """The pods KubeRay will create from a RayJob, one per template."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    for group in cluster["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    templates["submitter"] = rayjob["spec"]["submitterPodTemplate"]
    name, namespace = rayjob["metadata"]["name"], rayjob["metadata"]["namespace"]
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                **template.get("metadata", {}),
                "name": f"{name}-{role}",
                "namespace": namespace,
            },
            "spec": template["spec"],
        }
        for role, template in templates.items()
    ]


def run(argv: list[Any], env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"{' '.join(map(str, argv))} failed:\n{result.stderr}")
    return result.stdout


def findings(manifests: list[Manifest]) -> list[tuple[str, str, str]]:
    """(check id, kind/name, what kube-score says) of every check not passed."""
    result = subprocess.run(
        [str(BIN_DIR / "kube-score"), "score", "--output-format", "json", "-"],
        input=yaml.safe_dump_all(manifests),
        capture_output=True,
        text=True,
    )
    if result.returncode not in (0, 1):  # 1: some check failed
        sys.exit(f"kube-score failed:\n{result.stderr}")
    found = []
    for scored in json.loads(result.stdout):
        where = f"{scored['type_meta']['kind']}/{scored['object_meta']['name']}"
        for check in scored["checks"]:
            if check["grade"] < 10 and not check["skipped"]:  # 10: all good
                says = "; ".join(c["summary"] for c in check["comments"] or [])
                found.append((check["check"]["id"], where, says))
    return found


def excepted(check: str, where: str, says: str, exceptions: list[dict[str, Any]]) -> bool:
    return any(
        e["check"] == check
        and any(fnmatch.fnmatchcase(where, pattern) for pattern in e["objects"])
        and e.get("summary", "") in says
        for e in exceptions
    )


def main() -> int:
    exceptions: list[dict[str, Any]] = yaml.safe_load(EXCEPTIONS.read_text())
    manifests = chart_manifests() + example_manifests()
    left = [f for f in findings(manifests) if not excepted(*f, exceptions)]
    for check, where, says in left:
        print(f"{where}: {check}: {says}")
    print(f"kube-score: {len(manifests)} manifests, {len(left)} findings not excepted")
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
