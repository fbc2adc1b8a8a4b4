"""The agent episodes open on one rollout engine's gateway, and what their calls sampled.

The trainer opens an episode under an API key with its limits, hands the key to the agent,
and closes the episode when the agent answers: it gets every call's record back. A call
is bound to its episode by the key alone (`Authorization: Bearer <key>`), so the agent
needs nothing but an OpenAI client.

A record holds the tokens as the engine saw them: the prompt ids vLLM rendered from the
agent's messages with the model's template, and each choice's sampled ids with their
log-probs and weight versions. The agent's text is never tokenised again.

Limits (spec.generation.agent): calls per episode, max_tokens per call, and the episode's
deadline. A call past one is refused and the episode is cut, its reason kept; every
later call is refused with the same reason. Everything here runs on the engine's event
loop (one thread), so nothing is locked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhf_trainer.api.agents import AgentEpisodes

# The reasons a call is refused (and its episode cut), as counted in rlhf_agent_refusals.
MAX_CALLS, MAX_CALL_TOKENS, EPISODE_TIMEOUT = "max_calls", "max_call_tokens", "episode_timeout"
CLOSED = "episode_closed"  # the trainer closed it (the agent answered, or was given up on)


@dataclass(frozen=True)
class CallLimits:
    """What the gateway allows one episode."""

    max_calls: int
    max_call_tokens: int  # max_tokens of a call, at most (unset: this)
    episode_seconds: float

    @classmethod
    def of(cls, agent: AgentEpisodes) -> CallLimits:
        return cls(agent.max_calls, agent.max_call_tokens, agent.episode_timeout_seconds)


@dataclass(frozen=True)
class SampledChoice:
    """One choice of a call, as the engine sampled it."""

    index: int  # the choice's index in the call (n > 1: several)
    ids: list[int]  # (n,) sampled token ids, exactly as sampled
    log_probs: list[float]  # (n,) log π_rollout of each, from the engine
    # ((version, first token index), ...): the weights that sampled each span; a call that
    # spanned a weight sync has several, the oldest first.
    version_spans: tuple[tuple[int, int], ...]
    finish_reason: str | None  # vLLM's: "stop", "length", "abort"

    def __post_init__(self) -> None:
        if len(self.log_probs) != len(self.ids):
            raise ValueError(
                f"choice {self.index}: {len(self.ids)} ids, {len(self.log_probs)} log-probs"
            )

    @property
    def version(self) -> int:  # the oldest weights that sampled it
        return min(version for version, _ in self.version_spans)


@dataclass(frozen=True)
class CallRecord:
    """One chat completion of an episode."""

    index: int  # 0, 1, ... in the order the calls arrived
    prompt_ids: list[int]  # (P,) rendered server-side by the model's template
    choices: tuple[SampledChoice, ...]


@dataclass(frozen=True)
class EpisodeRecords:
    """What an episode's calls left, handed to the trainer when it closes the episode."""

    calls: tuple[CallRecord, ...]  # in arrival order
    cut: str | None  # why the gateway cut it (a limit), None if it never did
    refusals: dict[str, int]  # calls refused, by reason

    @property
    def prompt_tokens(self) -> int:
        return sum(len(call.prompt_ids) for call in self.calls)

    @property
    def sampled_tokens(self) -> int:
        return sum(len(choice.ids) for call in self.calls for choice in call.choices)


class Refused(Exception):
    """A call the gateway refuses, as OpenAI's error shape describes it."""

    def __init__(
        self, status: int, kind: str, code: str | None, message: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param

    def body(self) -> dict[str, dict[str, str | None]]:
        """`{"error": {"message", "type", "param", "code"}}`, as OpenAI answers."""
        error = {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}


@dataclass
class _Episode:
    limits: CallLimits
    deadline: float  # on the book's clock
    calls: list[CallRecord] = field(default_factory=list)
    admitted: int = 0
    cut: str | None = None
    refusals: dict[str, int] = field(default_factory=dict)
    in_flight: set[str] = field(default_factory=set)  # vLLM request ids of its calls


class EpisodeBook:
    """The episodes open on one gateway, by key. `clock` is monotonic seconds (a test's
    own clock makes the deadline an event)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._episodes: dict[str, _Episode] = {}

    def open(self, key: str, limits: CallLimits) -> None:
        if not key:
            raise ValueError("an episode's key must not be empty")
        if key in self._episodes:
            raise ValueError("an episode with this key is open already")
        self._episodes[key] = _Episode(limits, self._clock() + limits.episode_seconds)

    def admit(self, key: str | None, max_tokens: int | None) -> tuple[int, int]:
        """Admit a call of `key`'s episode asking `max_tokens` (None: unset): its index in
        the episode and the max_tokens it gets. Raises Refused (and cuts the episode when
        a limit is passed)."""
        episode = self._episode(key)
        limits = episode.limits
        if episode.cut is None and self._clock() >= episode.deadline:
            episode.cut = EPISODE_TIMEOUT
        if episode.cut is None and episode.admitted >= limits.max_calls:
            episode.cut = MAX_CALLS
        if episode.cut is None and max_tokens is not None and max_tokens > limits.max_call_tokens:
            episode.cut = MAX_CALL_TOKENS
        if episode.cut is not None:
            episode.refusals[episode.cut] = episode.refusals.get(episode.cut, 0) + 1
            raise Refused(
                403, "episode_limit", episode.cut, self._why(episode), _param(episode.cut)
            )
        episode.admitted += 1
        return episode.admitted - 1, limits.max_call_tokens if max_tokens is None else max_tokens

    def _episode(self, key: str | None) -> _Episode:
        """The open episode of `key`; else Refused, 401 as OpenAI answers a wrong key."""
        episode = self._episodes.get(key or "")
        if episode is None:
            raise Refused(
                401, "invalid_request_error", "invalid_api_key",
                "unknown API key: no open episode has it (Authorization: Bearer <key>)",
            )  # fmt: skip
        return episode

    def check(self, key: str | None) -> None:
        """Refuse a key that no open episode has (before its call's body is read)."""
        self._episode(key)

    def started(self, key: str, request_id: str) -> None:
        """The call's vLLM request is in flight (closing the episode aborts it)."""
        if key in self._episodes:
            self._episodes[key].in_flight.add(request_id)

    def record(self, key: str, request_id: str, call: CallRecord | None) -> None:
        """A call ended; its record (None: it sampled nothing). A closed episode's late
        calls are dropped: the trainer has its records already."""
        episode = self._episodes.get(key)
        if episode is None:
            return
        episode.in_flight.discard(request_id)
        if call is not None:
            episode.calls.append(call)

    def cut(self, key: str, reason: str) -> list[str]:
        """Cut an open episode (the first reason stands); the requests still in flight."""
        episode = self._episodes.get(key)
        if episode is None:
            return []
        episode.cut = episode.cut or reason
        return sorted(episode.in_flight)

    def close(self, key: str) -> tuple[EpisodeRecords, list[str]]:
        """Close `key`'s episode: its records, and its requests still in flight (for the
        caller to abort). Unknown key: KeyError."""
        episode = self._episodes.pop(key)
        calls = tuple(sorted(episode.calls, key=lambda call: call.index))
        return EpisodeRecords(calls, episode.cut, dict(episode.refusals)), sorted(episode.in_flight)

    @staticmethod
    def _why(episode: _Episode) -> str:
        limits = episode.limits
        return {
            MAX_CALLS: f"the episode has made its {limits.max_calls} calls (maxCalls)",
            MAX_CALL_TOKENS: (
                f"max_tokens is at most {limits.max_call_tokens} per call (maxCallTokens)"
            ),
            EPISODE_TIMEOUT: (
                f"the episode ran past its {limits.episode_seconds:g} s (episodeTimeoutSeconds)"
            ),
        }.get(episode.cut or "", f"the episode was cut: {episode.cut}")


def _param(reason: str) -> str | None:
    return "max_tokens" if reason == MAX_CALL_TOKENS else None
