"""The rollout worker's side of the gateway: serve it on the worker's engine, open an
agent episode under a key, close it for its records. Mixed into
rollout.worker.EngineWorker, whose engine and job spec it uses; the trainer calls these
methods on the rollout rank that runs the episode (its engine's base_url goes to the
agent: session affinity, and the prefix cache of the episode's earlier calls)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlhf_trainer.api.agents import GATEWAY_PORT
from rlhf_trainer.gateway.records import CallLimits, EpisodeRecords
from rlhf_trainer.gateway.server import Gateway

if TYPE_CHECKING:
    from rlhf_trainer.api.config import JobConfig
    from rlhf_trainer.rollout.engine import RolloutEngine


class GatewayHost:
    """Provided by the class it is mixed into: `engine` and `config`."""

    engine: RolloutEngine
    config: JobConfig
    gateway: Gateway | None = None

    def start_gateway(self, port: int = GATEWAY_PORT, host: str = "0.0.0.0") -> int:
        """Serve the gateway of generation.agent on this engine, at host:port (0: a free
        port); returns the port. In the rank's Ray pod: agents reach it there."""
        from rlhf_trainer.models import TINY_CHAT_TEMPLATE
        from rlhf_trainer.rollout import toy_tool_parser  # noqa: F401  registers "rlhf_toy"

        agent = self.config.generation.agent
        if agent is None:
            raise RuntimeError("the gateway serves generation.agent's episodes: it is unset")
        # A tiny model's tokenizer has no template of its own (models.chat_tokenizer).
        template = TINY_CHAT_TEMPLATE if self.config.models.actor.tiny is not None else None
        engine = self.engine

        async def serve() -> tuple[Gateway, int]:
            gateway = Gateway(
                engine.llm,
                chat_template=template,
                tool_parser=agent.tool_parser,
                lora=lambda: engine.lora_request,
            )
            return gateway, await gateway.serve(host, port)

        self.gateway, served = engine.call(serve())
        return served

    def open_agent_episode(self, key: str, limits: CallLimits) -> None:
        """Admit calls under `key` (an Authorization: Bearer key), within `limits`."""
        gateway = self._gateway()

        async def opened() -> None:
            gateway.open_episode(key, limits)

        self.engine.call(opened())

    def close_agent_episode(self, key: str) -> EpisodeRecords:
        """Refuse `key` from now on; its calls' records (calls in flight are aborted)."""
        return self.engine.call(self._gateway().close_episode(key))

    def _gateway(self) -> Gateway:
        if self.gateway is None:
            raise RuntimeError("no gateway on this engine: call start_gateway first")
        return self.gateway
