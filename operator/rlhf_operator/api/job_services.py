"""What a service the operator runs for a job is given in the spec, environments[] and
agents[] alike (`JobServiceSpec`): its image, command, port, replicas, resources, env,
egress (`EgressRule`) and placement; and the rules every such service keeps
(`service_rules`).

An operator-run service becomes a Deployment, a Service and a NetworkPolicy named
`<job><infix><name>` (render/job_services.py); the trainer gets the Service's URL.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated

from pydantic import AfterValidator, Field, StringConstraints, WithJsonSchema
from pydantic.alias_generators import to_snake

from rlhf_operator.api.podspec import (
    MAX_JOB_NAME,
    EnvVar,
    NodeSelector,
    ObjectName,
    PodResources,
    Toleration,
    _list_map,
    _unique,
)
from rlhf_trainer.api.rules import Rule, SpecModel

DEFAULT_PORT = 8000
DEFAULT_REPLICAS = 1
# One Python process serving a protocol (sessions, episodes in memory): enough for a
# toy; a service that runs code or holds big state sets its own.
DEFAULT_RESOURCES = PodResources(cpu="500m", memory="1Gi")
# The fields only a service the operator runs has. With url they would be ignored, so
# they are refused (command too, by the first rule). None has a default in the schema:
# the API server would fill it in, and url services would carry it.
RUN_FIELDS = (
    "image",
    "port",
    "replicas",
    "resources",
    "env",
    "egress",
    "egressTo",
    "runtimeClassName",
    "nodeSelector",
    "tolerations",
)
# The clouds' instance metadata addresses, the node's credentials: AWS, GCP, Azure and
# most others; AWS's and GCP's IPv6 ones; Alibaba Cloud's. The chart's default
# networkPolicy.metadataAddresses: render/network.py takes those out of every egress
# rule, so a rule of these alone would be a rule of nothing: refused.
METADATA_ADDRESSES = (
    "169.254.169.254/32",
    "fd00:ec2::254/128",
    "fd20:ce::254/128",
    "100.100.100.200/32",
)

Argument = Annotated[str, StringConstraints(max_length=4096)]


def _check_cidr(value: str) -> str:
    try:
        network = ipaddress.ip_network(value, strict=True)
    except ValueError as error:
        raise ValueError(
            f"must be a CIDR with its host bits zero, such as 203.0.113.0/24 or 2001:db8::/32: "
            f"{error}"
        ) from error
    for address in map(ipaddress.ip_network, METADATA_ADDRESSES):
        if network.version == address.version and network.subnet_of(address):  # type: ignore[arg-type]
            raise ValueError(f"is the cloud metadata address {address}, never reachable")
    return str(network)


Cidr = Annotated[
    str,
    StringConstraints(max_length=43),  # an IPv6 address and its prefix
    AfterValidator(_check_cidr),
    WithJsonSchema({"type": "string", "format": "cidr", "maxLength": 43}),
]
Port = Annotated[int, Field(ge=1, le=65535)]


class EgressRule(SpecModel):
    """Connections a service's pods may open: to the addresses of cidr (the metadata
    addresses taken out), on some TCP ports or all."""

    cidr: Cidr = Field(description="The addresses, e.g. 203.0.113.0/24 or 2001:db8::/32.")
    ports: list[Port] | None = Field(
        None, min_length=1, max_length=16, description="TCP ports. Unset: every port."
    )


def max_name(infix: str) -> int:
    """The longest name whose `<job><infix><name>`, a DNS-1035 label, fits in 63
    characters with a job name of up to MAX_JOB_NAME."""
    return 63 - MAX_JOB_NAME - len(infix)


class JobServiceSpec(SpecModel):
    """A service the operator runs as the job's own Deployment and Service (the fields
    it needs besides its name and how the trainer uses it)."""

    image: str | None = Field(
        None, min_length=1, description="Its image. Unset: the job's spec.image."
    )
    command: list[Argument] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description=(
            "The container's command, serving its protocol on port with GET /healthz. "
            "Unset (with serve): rlhf_env's server of serve."
        ),
    )
    port: int | None = Field(
        None, ge=1, le=65535, description=f"The port it serves on. Unset: {DEFAULT_PORT}."
    )
    replicas: int | None = Field(
        None, ge=1, le=64, description=f"Pods serving it. Unset: {DEFAULT_REPLICAS}."
    )
    resources: PodResources | None = Field(
        None,
        description=(
            f"CPU and memory of each pod (request and limit). Unset (either): "
            f"{DEFAULT_RESOURCES.cpu} CPU, {DEFAULT_RESOURCES.memory}."
        ),
    )
    env: list[EnvVar] | None = Field(
        None,
        max_length=16,  # with 16 services, the CEL cost of its unique names stays bounded
        json_schema_extra=_list_map("name"),
        description=(
            "Its environment variables (secrets by reference). The job's pods.env is not "
            "passed on: it runs the model's tool calls, or an agent's own code."
        ),
    )
    egress: bool | None = Field(
        None,
        description=(
            "Let its pods open connections to the internet: every address but the cluster's "
            "own ranges (the chart's networkPolicy.clusterRanges) and the cloud metadata "
            "addresses, and DNS to the cluster's DNS pods. Unset: false: no egress but what "
            "egressTo allows (an agent's pods reach the rollout pool's gateway and DNS "
            "too). Only the job's Ray pods may connect to its pods, and the job's pods "
            "refuse them."
        ),
    )
    egress_to: list[EgressRule] | None = Field(
        None,
        min_length=1,
        max_length=32,
        description=(
            "Addresses its pods may connect to (with DNS to the cluster's DNS pods): an "
            "allow-list, in the cluster's ranges too (a database, a sandbox), added to what "
            "egress allows. The cloud metadata addresses are taken out of every rule."
        ),
    )
    runtime_class_name: ObjectName | None = Field(
        None,
        description=(
            "The RuntimeClass of its pods, e.g. gVisor's or Kata's, to sandbox the model's "
            "tool calls or the agent's code in their own kernel. Unset: the cluster's "
            "default runtime."
        ),
    )
    node_selector: NodeSelector | None = None
    tolerations: list[Toleration] | None = Field(
        None,
        max_length=32,
        description="Tolerations of its pods (e.g. a sandbox node group's taint).",
    )

    @property
    def serving_port(self) -> int:
        return DEFAULT_PORT if self.port is None else self.port

    @property
    def replica_count(self) -> int:
        return DEFAULT_REPLICAS if self.replicas is None else self.replicas

    def pod_resources(self) -> PodResources:
        return (self.resources or PodResources()).filled(DEFAULT_RESOURCES)


def service_rules(
    kind: str, runs: tuple[str, ...], infix: str, run_fields: tuple[str, ...] = RUN_FIELDS
) -> tuple[Rule, ...]:
    """The rules of a service (`kind`: "agent") that runs at `url` or that the operator
    runs, as any of `runs` asks (serve, command). `run_fields`: the fields only an
    operator-run one has."""
    one, limit = f"an {kind}" if kind[0] in "aeiou" else f"a {kind}", max_name(infix)
    asks = " || ".join(f"has(self.{f})" for f in runs)
    return (
        Rule(
            "",
            f"set exactly one of url ({one} that runs already) or {' or '.join(runs)} (one "
            "the operator runs)",
            f"has(self.url) != ({asks})",
            lambda s: (s.url is not None) != any(getattr(s, f) is not None for f in runs),
        ),
        Rule(
            "url",
            f"with url, leave {', '.join(run_fields)} unset: they are for {one} the operator runs",
            "!has(self.url) || !(" + " || ".join(f"has(self.{f})" for f in run_fields) + ")",
            lambda s: s.url is None or all(getattr(s, to_snake(f)) is None for f in run_fields),
            lambda s: (
                "got " + ", ".join(f for f in run_fields if getattr(s, to_snake(f)) is not None)
            ),
        ),
        Rule(
            "name",
            f"must be at most {limit} characters when the operator runs the {kind}: its "
            f"Service, <job>{infix}<name>, must fit in 63 with a job name of up to "
            f"{MAX_JOB_NAME}",
            f"has(self.url) || size(self.name) <= {limit}",
            lambda s: s.url is not None or len(s.name) <= limit,
            lambda s: f"got {len(s.name)}",
        ),
        _unique("env", "name", "env names"),
    )
