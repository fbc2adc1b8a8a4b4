"""What the driver and the rollout ranks share of agent episodes, light enough for the
driver (which must not import the gateway, vLLM): the tally of each closed episode
(rlhf_agent_*), which the ranks hand over, and where a rank's gateway listens, which a
local run sets."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from rlhf_trainer.api.agents import GATEWAY_PORT


@dataclass(frozen=True)
class EpisodeTally:
    """One closed episode: AgentMetrics.count_episode's arguments, and the samples left
    out of training (rollout.agent_episodes: past maxSamplesPerEpisode, or masked)."""

    cut: str | None  # its reason (None: the agent ended it with a reward)
    calls: int
    refusals: dict[str, int]  # the gateway's, by reason
    prompt_tokens: int
    sampled_tokens: int
    samples_left_out: int  # its samples not in the batch


# Where a local run's gateways listen (cluster.local sets them in its workers): several
# simulated nodes share one host, so each engine's gateway takes a free port of loopback.
GATEWAY_HOST_VARIABLE, GATEWAY_PORT_VARIABLE = "RLHF_GATEWAY_HOST", "RLHF_GATEWAY_PORT"


def gateway_address() -> tuple[str, int]:
    """The host agents reach this rank's gateway at, and the port it listens on (0: a
    free one). In a cluster: the pod's IP (its hostname's, as the kubelet writes it in
    /etc/hosts; Ray's node IP in a KubeRay pod) and GATEWAY_PORT, the port the agents'
    NetworkPolicy opens."""
    host = os.environ.get(GATEWAY_HOST_VARIABLE) or socket.gethostbyname(socket.gethostname())
    return host, int(os.environ.get(GATEWAY_PORT_VARIABLE, GATEWAY_PORT))
