"""The agent protocol: how the trainer hands an episode to an agent that owns its loop.

    POST /episodes   EpisodeRequest   -> EpisodeResult
    GET  /healthz    (no body)        -> Health

An agent (the OpenAI Agents SDK, LangGraph, a CLI agent, a plain loop written with the
`openai` package) runs as the job's own service. For each episode the trainer sends it a
task (a data row) and an OpenAI-compatible endpoint: `base_url` is the gateway of one
rollout engine, `api_key` binds every call the agent makes to this episode. The agent
runs its own loop against it and answers when it is done, with a reward of its own or
none (the job's reward then judges the calls' final transcript).

The trainer never sees the agent's text as training data: the gateway records the token
ids it rendered and sampled for each call (rlhf_trainer.gateway). So an agent may edit,
summarise or drop its history between calls; such calls become separate samples.

Errors are `{"detail": "..."}` with a status, as in protocol.py: 422 a body that breaks
these models, 500 the agent's own code failed, 503 no room for another episode (the
agent's concurrency limit), 504 the agent ran past the episode's deadline.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlhf_env.protocol import ProtocolModel

EPISODES_PATH = "/episodes"


class EpisodeRequest(ProtocolModel):
    """One episode for the agent to run."""

    episode_id: str = Field(min_length=1, max_length=128)
    task: dict[str, Any]  # the data row, as the environment protocol's start gets it
    base_url: str  # http://<engine>:<port>/v1: an OpenAI client's base_url
    api_key: str = Field(min_length=1)  # binds the calls to this episode; never logged
    model: str  # the name the gateway serves the policy under (/v1/models)
    deadline_seconds: float = Field(gt=0)  # the gateway refuses calls after it


class EpisodeResult(ProtocolModel):
    """How the episode ended, in the agent's own words."""

    # None: the job's reward judges the episode (its function, service or environment).
    reward: float | None = None
    # Numbers the agent reports (tests passed, steps taken): counted on the dashboard.
    info: dict[str, float] = Field(default_factory=dict)
