"""What a service the operator runs for a job is given in the spec: its image, command,
port, replicas, resources, env and egress (`JobServiceSpec`), and the rules every such
service keeps (`service_rules`). agents[] (api/agents.py) is made of them; environments[]
(api/environments.py) has the same fields and rules, written there before this module.

An operator-run service becomes a Deployment, a Service and a NetworkPolicy named
`<job><infix><name>` (render/job_services.py); the trainer gets the Service's URL.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints
from pydantic.alias_generators import to_snake

from rlhf_operator.api.environments import EgressRule
from rlhf_operator.api.podspec import MAX_JOB_NAME, EnvVar, PodResources, _list_map, _unique
from rlhf_trainer.api.rules import Rule, SpecModel

DEFAULT_PORT = 8000
DEFAULT_REPLICAS = 1
# One Python process serving a protocol: enough for a toy; a service that runs code or
# holds big state sets its own.
DEFAULT_RESOURCES = PodResources(cpu="500m", memory="1Gi")
# The fields only a service the operator runs has. With url they would be ignored, so
# they are refused (command too, by the first rule). None has a default in the schema:
# the API server would fill it in, and url services would carry it.
RUN_FIELDS = ("image", "port", "replicas", "resources", "env", "egress", "egressTo")

Argument = Annotated[str, StringConstraints(max_length=4096)]


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
        description="The container's command, serving on port with GET /healthz.",
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
            "passed on: it may hold the trainer's secrets."
        ),
    )
    egress: bool | None = Field(
        None,
        description=(
            "Let its pods open connections to the internet: every address but the cluster's "
            "own ranges (the chart's networkPolicy.clusterRanges) and the cloud metadata "
            "addresses, and DNS to the cluster's DNS pods. Unset: false: only what egressTo "
            "allows, besides what the service needs of the job."
        ),
    )
    egress_to: list[EgressRule] | None = Field(
        None,
        min_length=1,
        max_length=32,
        description=(
            "Addresses its pods may connect to (with DNS to the cluster's DNS pods): an "
            "allow-list, in the cluster's ranges too (a sandbox, a database), added to what "
            "egress allows. The cloud metadata addresses are taken out of every rule."
        ),
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
    one: str, runs: tuple[str, ...], infix: str, run_fields: tuple[str, ...] = RUN_FIELDS
) -> tuple[Rule, ...]:
    """The rules of a service that runs at `url` or that the operator runs, as any of
    `runs` asks (serve, command). `one`: "an agent"; `run_fields`: the fields only an
    operator-run one has."""
    limit = max_name(infix)
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
            f"must be at most {limit} characters when the operator runs it: its Service, "
            f"<job>{infix}<name>, must fit in 63 with a job name of up to {MAX_JOB_NAME}",
            f"has(self.url) || size(self.name) <= {limit}",
            lambda s: s.url is not None or len(s.name) <= limit,
            lambda s: f"got {len(s.name)}",
        ),
        _unique("env", "name", "env names"),
    )
