"""spec.environments[] as the operator sees it: an environment that already runs (`url`),
or one the operator runs as the job's own service (`serve` or `command`).

An operator-run environment becomes a Deployment, a Service and a NetworkPolicy, all
named `<job>-env-<name>` (render/environments.py); the trainer gets the Service's URL
in place of `serve` (RLHFJobSpec.job_config). Its image, port, resources, env, egress
and placement are every operator-run service's (api/job_services.py), as an agent's.
"""

from __future__ import annotations

from pydantic import Field

from rlhf_operator.api.job_services import (
    DEFAULT_REPLICAS,
    RUN_FIELDS,
    Argument,
    JobServiceSpec,
    max_name,
    service_rules,
)
from rlhf_operator.api.job_services import METADATA_ADDRESSES as METADATA_ADDRESSES
from rlhf_operator.api.job_services import EgressRule as EgressRule  # re-exported
from rlhf_trainer.api.agentic import CLASS_PATH, EnvironmentConfig, MultiTurnConfig
from rlhf_trainer.api.rules import Rule

SERVICE_INFIX = "-env-"
# The Service `<job>-env-<name>` is a DNS-1035 label: 63 characters at most.
MAX_ENVIRONMENT_NAME = max_name(SERVICE_INFIX)
# The settings of `python -m rlhf_env serve`: with a command of one's own, they are the
# command's to pass, so they are refused there.
_SERVER_FIELDS = ("maxSessions", "callTimeoutSeconds", "sessionIdleSeconds")
# The fields only an operator-run environment has: with url, refused.
_RUN_FIELDS = (*RUN_FIELDS, *_SERVER_FIELDS)


class EnvironmentSpec(JobServiceSpec, EnvironmentConfig):
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
        *service_rules("environment", ("serve", "command"), SERVICE_INFIX, _RUN_FIELDS),
        Rule(
            "command",
            f"with command, leave {', '.join(_SERVER_FIELDS)} unset: they are settings of "
            "python -m rlhf_env serve, for the command to pass itself",
            "!has(self.command) || !("
            + " || ".join(f"has(self.{f})" for f in _SERVER_FIELDS)
            + ")",
            lambda e: e.command is None or all(v is None for v in e._server_settings()),
        ),
    )

    @property
    def operator_run(self) -> bool:
        """Whether the operator runs it (no url)."""
        return self.url is None

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


def _number(value: float) -> str:
    """A command-line number: 30 for 30.0, 0.5 as is."""
    return str(int(value)) if float(value).is_integer() else str(value)


def service_name(job_name: str, environment: str) -> str:
    """The Deployment, Service and NetworkPolicy of an operator-run environment."""
    return f"{job_name}{SERVICE_INFIX}{environment}"
