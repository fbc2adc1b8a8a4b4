"""spec.agents[] as the operator sees it: an agent that already runs (`url`), or one the
operator runs as the job's own service (`serve`, or an image and `command`).

An operator-run agent becomes a Deployment, a Service and a NetworkPolicy, all named
`<job>-agent-<name>` (render/agents.py); the trainer gets the Service's URL in place of
`serve` (RLHFJobSpec.job_config). Its pods may reach the rollout pool's gateway
(rlhf_trainer.api.agents.GATEWAY_PORT) and what `egress` allows, nothing else of the job.
"""

from __future__ import annotations

from pydantic import Field

from rlhf_operator.api.job_services import JobServiceSpec, service_rules
from rlhf_trainer.api.agents import FUNCTION_PATH, AgentConfig

SERVICE_INFIX = "-agent-"


class AgentSpec(JobServiceSpec, AgentConfig):
    """An agent service: one that runs at `url`, or one the operator runs for the job
    (`serve`, or an image and `command`) as a Deployment and a Service that only the
    job's Ray pods may reach."""

    serve: str | None = Field(  # the trainer's field, described for a cluster
        None,
        pattern=FUNCTION_PATH,
        description=(
            "An agent function in the image, as module:function (async def run(task, "
            "client) -> float | None, client an openai.AsyncOpenAI): the operator runs "
            "`python -m rlhf_env agent` on it (a local run serves it on this machine)."
        ),
    )

    rules = service_rules("agent", ("serve", "command"), SERVICE_INFIX)

    @property
    def operator_run(self) -> bool:
        """Whether the operator runs it (no url)."""
        return self.url is None

    @property
    def opens_connections(self) -> bool:
        """Whether its pods may connect beyond the gateway: the job's pods then refuse
        them (render/children.py), as an environment's."""
        return self.operator_run and (bool(self.egress) or bool(self.egress_to))

    def container_command(self) -> list[str]:
        """What the container runs: the spec's command, else rlhf_env serving `serve`,
        each replica its share of maxConcurrentEpisodes (past it a 503: the trainer
        starts the episode on another replica, or waits)."""
        if self.command is not None:
            return list(self.command)
        assert self.serve is not None  # the first rule: serve or command without url
        listen = ["--host", "0.0.0.0", "--port", str(self.serving_port)]  # from other pods
        share = -(-self.max_concurrent_episodes // self.replica_count)  # rounded up
        limit = ["--max-episodes", str(share)]
        return ["python", "-m", "rlhf_env", "agent", self.serve, *listen, *limit]

    def for_trainer(self, job_name: str | None) -> dict[str, str | int]:
        """This agent as the trainer's spec gives it (exactly one of url, serve).

        `job_name`: in a cluster, the job's; the Ray pods share its namespace, so the
        Service's short name resolves. None: a local run, which serves `serve` itself.
        """
        given: dict[str, str | int] = {
            "name": self.name,
            "maxConcurrentEpisodes": self.max_concurrent_episodes,
        }
        if self.url is not None:
            return given | {"url": self.url}
        if job_name is not None:
            service = service_name(job_name, self.name)
            return given | {"url": f"http://{service}:{self.serving_port}"}
        if self.serve is None:
            raise ValueError(
                f"agents: {self.name} gives only a command, which runs in a cluster; a local "
                "run serves an agent by its serve (module:function) or uses its url"
            )
        return given | {"serve": self.serve}


def service_name(job_name: str, agent: str) -> str:
    """The Deployment, Service and NetworkPolicy of an operator-run agent."""
    return f"{job_name}{SERVICE_INFIX}{agent}"
