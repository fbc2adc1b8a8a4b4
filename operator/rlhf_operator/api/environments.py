"""spec.environments[] as the operator sees it: an environment that already runs (`url`),
or one the operator runs as the job's own service (`serve` or `command`).

An operator-run environment becomes a Deployment, a Service and a NetworkPolicy, all
named `<job>-env-<name>` (render/environments.py); the trainer gets the Service's URL
in place of `serve` (RLHFJobSpec.job_config).
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
from rlhf_trainer.api.agentic import CLASS_PATH, EnvironmentConfig, MultiTurnConfig
from rlhf_trainer.api.rules import Rule, SpecModel

SERVICE_INFIX = "-env-"
# The Service `<job>-env-<name>` is a DNS-1035 label: 63 characters at most.
MAX_ENVIRONMENT_NAME = 63 - MAX_JOB_NAME - len(SERVICE_INFIX)
DEFAULT_PORT = 8000
DEFAULT_REPLICAS = 1
# The protocol's server is small (one Python process, sessions in memory): enough for a
# toy; an environment that runs code or holds big state sets its own.
DEFAULT_RESOURCES = PodResources(cpu="500m", memory="1Gi")

# The fields only an operator-run environment has. With url they would be ignored, so
# they are refused (command too, by the first rule). None of them has a default in the
# schema: the API server would fill it in, and url environments would carry it.
_RUN_FIELDS = (
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
    "maxSessions",
    "callTimeoutSeconds",
    "sessionIdleSeconds",
)
# The settings of `python -m rlhf_env serve`: with a command of one's own, they are the
# command's to pass, so they are refused there.
_SERVER_FIELDS = ("maxSessions", "callTimeoutSeconds", "sessionIdleSeconds")

Argument = Annotated[str, StringConstraints(max_length=4096)]
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
    """Connections an environment's pods may open: to the addresses of cidr (the
    metadata addresses taken out), on some TCP ports or all."""

    cidr: Cidr = Field(description="The addresses, e.g. 203.0.113.0/24 or 2001:db8::/32.")
    ports: list[Port] | None = Field(
        None, min_length=1, max_length=16, description="TCP ports. Unset: every port."
    )


class EnvironmentSpec(EnvironmentConfig):
    """An environment server: one that runs at `url`, or one the operator runs for the
    job (`serve`, or an image and `command`) as a Deployment and a Service that only the
    job's Ray pods may reach."""

    serve: str | None = Field(  # the trainer's field, described for a cluster
        None,
        pattern=CLASS_PATH,
        description=(
            "An environment class in the image, as module:Class (rlhf_env.toys:LetterLookup): "
            "the operator runs `python -m rlhf_env serve` on it (a local run serves it on "
            "this machine)."
        ),
    )
    image: str | None = Field(
        None, min_length=1, description="The environment's image. Unset: the job's spec.image."
    )
    command: list[Argument] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description=(
            "The container's command, serving the environment protocol on port with "
            "GET /healthz. Unset (with serve): python -m rlhf_env serve <serve> --host "
            "0.0.0.0 --port <port>."
        ),
    )
    port: int | None = Field(
        None, ge=1, le=65535, description=f"The port it serves on. Unset: {DEFAULT_PORT}."
    )
    replicas: int | None = Field(
        None,
        ge=1,
        le=64,
        description=(
            f"Pods serving it (unset: {DEFAULT_REPLICAS}); it may change while the job "
            "runs. The trainer keeps each session on the replica that started it, spreads "
            "new sessions over the ready replicas, and starts a session again elsewhere "
            "when its replica dies."
        ),
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
        max_length=16,  # with 16 environments, the CEL cost of its unique names stays bounded
        json_schema_extra=_list_map("name"),
        description=(
            "Its environment variables (secrets by reference). The job's pods.env is not "
            "passed on: an environment runs the model's tool calls."
        ),
    )
    egress: bool | None = Field(
        None,
        description=(
            "Let its pods open connections to the internet: every address but the cluster's "
            "own ranges (the chart's networkPolicy.clusterRanges) and the cloud metadata "
            "addresses, and DNS to the cluster's DNS pods. Unset: false: no egress at all, "
            "DNS included, but what egressTo allows. Only the job's Ray pods may connect to "
            "an environment's pods, and the job's pods refuse them."
        ),
    )
    egress_to: list[EgressRule] | None = Field(
        None,
        min_length=1,
        max_length=32,
        description=(
            "Addresses its pods may connect to (with DNS to the cluster's DNS pods): an "
            "allow-list, in the cluster's ranges too (a database), added to what egress "
            "allows. The cloud metadata addresses are taken out of every rule."
        ),
    )
    runtime_class_name: ObjectName | None = Field(
        None,
        description=(
            "The RuntimeClass of its pods, e.g. gVisor's or Kata's, to sandbox the model's "
            "tool calls in their own kernel. Unset: the cluster's default runtime."
        ),
    )
    node_selector: NodeSelector | None = None
    tolerations: list[Toleration] | None = Field(
        None,
        max_length=32,
        description="Tolerations of its pods (e.g. a sandbox node group's taint).",
    )

    max_sessions: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description=(
            "Sessions each replica holds at once (unset: no limit). Past it a replica answers "
            "503, and the trainer starts the session on another replica, or waits for room "
            "while every replica is full."
        ),
    )
    call_timeout_seconds: float | None = Field(
        None,
        gt=0,
        le=3600,
        description=(
            "The server's deadline for each call into the class (its constructor, reset, "
            "step, score, close): past it the session ends (504) and its lock is let go; a "
            "call still running in a thread is counted, and the pod's liveness fails once "
            "such calls hold every thread. Unset: generation.multiTurn."
            "toolCallTimeoutSeconds (the trainer's own wait)."
        ),
    )
    session_idle_seconds: float | None = Field(
        None,
        gt=0,
        le=604800,
        description=(
            "A session no call has used for this long ends, and its close runs (a trainer "
            "that died never closes its sessions). Unset: generation.multiTurn."
            "episodeTimeoutSeconds (no live episode is idle longer)."
        ),
    )

    rules = (  # replaces EnvironmentConfig's url-or-serve
        Rule(
            "",
            "set exactly one of url (an environment that runs already) or serve or command "
            "(one the operator runs)",
            "has(self.url) != (has(self.serve) || has(self.command))",
            lambda e: (e.url is None) != (e.serve is None and e.command is None),
        ),
        Rule(
            "url",
            f"with url, leave {', '.join(_RUN_FIELDS)} unset: they are for an environment "
            "the operator runs",
            "!has(self.url) || !(" + " || ".join(f"has(self.{f})" for f in _RUN_FIELDS) + ")",
            lambda e: e.url is None or all(getattr(e, to_snake(f)) is None for f in _RUN_FIELDS),
            lambda e: (
                "got " + ", ".join(f for f in _RUN_FIELDS if getattr(e, to_snake(f)) is not None)
            ),
        ),
        Rule(
            "command",
            f"with command, leave {', '.join(_SERVER_FIELDS)} unset: they are settings of "
            "python -m rlhf_env serve, for the command to pass itself",
            "!has(self.command) || !("
            + " || ".join(f"has(self.{f})" for f in _SERVER_FIELDS)
            + ")",
            lambda e: e.command is None or all(v is None for v in e._server_settings()),
        ),
        Rule(
            "name",
            f"must be at most {MAX_ENVIRONMENT_NAME} characters when the operator runs the "
            f"environment: its Service, <job>{SERVICE_INFIX}<name>, must fit in 63 with a "
            f"job name of up to {MAX_JOB_NAME}",
            f"has(self.url) || size(self.name) <= {MAX_ENVIRONMENT_NAME}",
            lambda e: e.url is not None or len(e.name) <= MAX_ENVIRONMENT_NAME,
            lambda e: f"got {len(e.name)}",
        ),
        _unique("env", "name", "env names"),
    )

    @property
    def operator_run(self) -> bool:
        """Whether the operator runs it (no url)."""
        return self.url is None

    @property
    def serving_port(self) -> int:
        return DEFAULT_PORT if self.port is None else self.port

    @property
    def replica_count(self) -> int:
        return DEFAULT_REPLICAS if self.replicas is None else self.replicas

    @property
    def opens_connections(self) -> bool:
        """Whether its pods may connect anywhere: the job's pods then refuse them
        (render/children.py)."""
        return self.operator_run and (bool(self.egress) or bool(self.egress_to))

    def container_command(self, multi_turn: MultiTurnConfig | None = None) -> list[str]:
        """What the container runs: the spec's command, else rlhf_env serving `serve`,
        its deadlines the job's episodes' (`multi_turn`) where the spec sets none."""
        if self.command is not None:
            return list(self.command)
        assert self.serve is not None  # the first rule: serve or command without url
        listen = ["--host", "0.0.0.0", "--port", str(self.serving_port)]  # from other pods
        settings = zip(
            ("--max-sessions", "--call-seconds", "--idle-seconds"),
            self._server_settings(multi_turn),
            strict=True,
        )
        given = [part for flag, v in settings if v is not None for part in (flag, _number(v))]
        return ["python", "-m", "rlhf_env", "serve", self.serve, *listen, *given]

    def _server_settings(
        self, multi_turn: MultiTurnConfig | None = None
    ) -> tuple[int | None, float | None, float | None]:
        """maxSessions, callTimeoutSeconds, sessionIdleSeconds: the spec's, else the
        episodes' (`multi_turn`) for the deadlines, else None (the server's default)."""
        call, idle = self.call_timeout_seconds, self.session_idle_seconds
        if multi_turn is not None:
            call = multi_turn.tool_call_timeout_seconds if call is None else call
            idle = multi_turn.episode_timeout_seconds if idle is None else idle
        return self.max_sessions, call, idle

    def for_trainer(self, job_name: str | None) -> dict[str, str]:
        """This environment as the trainer's spec gives it (exactly one of url, serve).

        `job_name`: in a cluster, the job's; the Ray pods share its namespace, so the
        Service's short name resolves. None: a local run, which serves `serve` itself.
        """
        if self.url is not None:
            return {"name": self.name, "url": self.url}
        if job_name is not None:
            service = service_name(job_name, self.name)
            return {"name": self.name, "url": f"http://{service}:{self.serving_port}"}
        if self.serve is None:
            raise ValueError(
                f"environments: {self.name} gives only a command, which runs in a cluster; "
                "a local run serves an environment by its serve (module:Class) or uses its url"
            )
        return {"name": self.name, "serve": self.serve}

    def pod_resources(self) -> PodResources:
        return (self.resources or PodResources()).filled(DEFAULT_RESOURCES)


def _number(value: float) -> str:
    """A command-line number: 30 for 30.0, 0.5 as is."""
    return str(int(value)) if float(value).is_integer() else str(value)


def service_name(job_name: str, environment: str) -> str:
    """The Deployment, Service and NetworkPolicy of an operator-run environment."""
    return f"{job_name}{SERVICE_INFIX}{environment}"
