"""An agent episode's calls as training samples (pure: no vLLM, no I/O).

Calls come in the order they arrived. A choice whose call's prompt ids extend a sample's
ids so far (its prompt, then everything appended) continues that sample: the extension
(the template's glue after the last turn, the tool and user messages, the next generation
prompt) is observed (loss mask 0), the sampled ids are trained on (mask 1) with their
log-probs and version. A choice that extends no sample starts one of its own: the agent
edited or summarised its history, changed its system prompt, or its template re-rendered
an earlier turn's text as other tokens. When several samples are extended, the longest
wins (the most context reused). Both cases are token-exact: every id is the engine's.

All samples of an episode share its reward, discounted per sample as AReaL does: with
samples ordered by their last call, the k-th from the last gets reward * discount**k
(its share, discount**k: `sample_shares`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlhf_trainer.algo.experience import Episode, Rollout
from rlhf_trainer.gateway.records import CallRecord
from rlhf_trainer.rollout.trajectory import Trajectory


@dataclass
class AgentSample:
    """One token-exact trajectory of an episode, and where it came from."""

    trajectory: Trajectory
    # ((version, first response token index), ...): each sampled span's weights, in order
    spans: list[tuple[int, int]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # the calls it holds, by index
    finish_reason: str | None = None  # its last choice's

    @property
    def token_ids(self) -> list[int]:
        return self.trajectory.token_ids


def merge_calls(calls: Sequence[CallRecord]) -> list[AgentSample]:
    """The samples of an episode's calls, in the order each was started."""
    samples: list[AgentSample] = []
    for call in sorted(calls, key=lambda c: c.index):
        for choice in call.choices:
            if not choice.ids:  # nothing sampled: nothing to train on
                continue
            sample = _extended(samples, call.prompt_ids)
            if sample is None:
                sample = AgentSample(Trajectory(prompt_ids=list(call.prompt_ids)))
                samples.append(sample)
            else:
                extension = call.prompt_ids[len(sample.token_ids) :]
                if extension:
                    sample.trajectory.add_observed(extension)
            trajectory = sample.trajectory
            offset = len(trajectory.token_ids) - len(trajectory.prompt_ids)
            sample.spans += [(version, offset + start) for version, start in choice.version_spans]
            trajectory.add_sampled(choice.ids, choice.log_probs, choice.version)
            sample.calls.append(call.index)
            sample.finish_reason = choice.finish_reason
    return samples


def _extended(samples: list[AgentSample], prompt: Sequence[int]) -> AgentSample | None:
    """The longest sample whose ids are a prefix of `prompt` (the latest of equals)."""
    best: AgentSample | None = None
    for sample in samples:
        ids = sample.token_ids
        extends = len(ids) <= len(prompt) and list(prompt[: len(ids)]) == ids
        if extends and (best is None or len(ids) >= len(best.token_ids)):
            best = sample
    return best


def latest_first(samples: Sequence[AgentSample]) -> list[int]:
    """The samples' indices from the one whose last call came last (k = 0) back."""
    return sorted(range(len(samples)), key=lambda i: (samples[i].calls[-1], i), reverse=True)


def sample_shares(samples: Sequence[AgentSample], discount: float) -> list[float]:
    """Each sample's share of the episode's reward: discount**k, k counted from the
    sample whose last call came last (k = 0)."""
    shares = [0.0] * len(samples)
    for k, i in enumerate(latest_first(samples)):
        shares[i] = discount**k
    return shares


def sample_rewards(samples: Sequence[AgentSample], reward: float, discount: float) -> list[float]:
    """Each sample's reward: the episode's times its share."""
    return [reward * share for share in sample_shares(samples, discount)]


def episode_rollouts(
    calls: Sequence[CallRecord],
    reward: float,
    discount: float,
    cut: str | None = None,
    trains_cut: bool = False,
) -> list[Rollout]:
    """The trainer's samples of one agent episode (algo.experience.Rollout, as multi-turn
    episodes give them). A `cut` episode (a limit, an agent that failed or hung) is not
    trained on: each sample's loss mask is all 0, its score 0; unless `trains_cut` (its
    cut's policy trains it, and `reward` is the policy's score)."""
    samples = merge_calls(calls)
    rewards = sample_rewards(samples, reward, discount)
    return [
        _rollout(sample, score, cut, trains_cut)
        for sample, score in zip(samples, rewards, strict=True)
    ]


def _rollout(sample: AgentSample, score: float, cut: str | None, trains_cut: bool) -> Rollout:
    trajectory = sample.trajectory
    if cut is not None:
        trajectory.cut_short(cut)
    trained = cut is None or trains_cut
    mask = trajectory.sampled_mask if trained else trajectory.loss_mask
    prompt = len(trajectory.prompt_ids)
    versions = [version for version, _ in sample.spans]
    return Rollout(
        prompt_token_ids=trajectory.prompt_ids,
        response_token_ids=trajectory.token_ids[prompt:],
        response_log_probs=trajectory.log_probs[prompt:],
        finished=cut is None and sample.finish_reason == "stop",
        policy_version=min(versions),
        version_spans=tuple(_joined(sample.spans)),
        loss_mask=tuple(mask[prompt:]),
        episode=Episode(
            score=score if trained else 0.0,
            turns=trajectory.turns,
            tool_calls=0,  # the gateway does not count the calls' tool calls yet
            version_span=max(versions) - min(versions),
            cut=cut,
        ),
    )


def _joined(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Spans with a repeated version joined to the one before."""
    joined: list[tuple[int, int]] = []
    for version, start in spans:
        if not joined or joined[-1][0] != version:
            joined.append((version, start))
    return joined
