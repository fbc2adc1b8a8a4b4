"""From generated rollouts to a scored, advantaged training batch: pure tensor code.

A batch holds (B, T) tensors over whole sequences, prompt and response side by side, so
every role reads the same layout:

    input_ids       <pad> <pad> <s> c a f = | c a f </s> <pad>
    attention_mask    0     0    1  1 1 1 1 | 1 1 1  1     0
    response_mask     0     0    0  0 0 0 0 | 1 1 1  1     0

Prompts are padded on the left, responses on the right. Position t of every per-token
tensor (log-probs, values, advantages) is about the token at t: log π(x_t | x_<t), and
V(s_t), the value of the state just before x_t was chosen. `response_mask` picks the
tokens the policy chose, the only ones PPO counts: in a multi-turn response, the tool
results and template glue between turns are attended to (attention_mask 1) but not
counted (response_mask 0), and GAE's recursion steps over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal, Self

import torch
from torch import Tensor

from rlhf_trainer.algo.ppo import masked_mean
from rlhf_trainer.api.cuts import CUT_REASONS as CUT_REASONS  # why episodes are cut, by kind


@dataclass(frozen=True)
class Sequences:
    """A batch of generated sequences, as every role scores them (layout: module doc).

    Every field is a tensor with the batch along dim 0 (or None where a subclass allows
    it), which is what `select`, `trimmed`, `split` and `concat` rely on.
    """

    input_ids: Tensor  # (B, T) long: prompt left-padded, then response right-padded
    attention_mask: Tensor  # (B, T) long: 1 on the prompt's and the response's tokens
    response_mask: Tensor  # (B, T) float: 1 on the response's sampled tokens, the ones PPO counts
    rollout_log_probs: Tensor  # (B, T) log π_rollout(x_t) of the response tokens, 0 elsewhere
    policy_version: Tensor  # (B,) long: the weights that started generating each row

    def __post_init__(self) -> None:
        sizes = {name: t.shape[0] for name, t in self.tensors().items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch tensors disagree on the batch dimension: {sizes}")

    def __len__(self) -> int:
        return len(self.input_ids)

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}

    def to(self, device: torch.device) -> Self:
        """The batch on `device`: a role's GPU (Ray hands batches over on the CPU)."""
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    def select(self, rows: Tensor | slice) -> Self:
        """The batch of the given rows."""
        return replace(self, **{name: t[rows] for name, t in self.tensors().items()})

    def trimmed(self) -> tuple[Self, slice]:
        """The batch without the columns that are padding in every row, and the columns
        kept. The layout survives: prompts still end at one column and responses start at
        the next; position ids come from the attention mask, so no row's outputs change."""
        filled = self.attention_mask.any(dim=0).nonzero()
        columns = slice(int(filled[0]), int(filled[-1]) + 1) if len(filled) else slice(0, 0)
        per_token = {name: t[:, columns] for name, t in self.tensors().items() if t.dim() == 2}
        return replace(self, **per_token), columns

    def split(self, parts: int) -> list[Self]:
        """`parts` batches of consecutive rows, in order; sizes differ by at most one row,
        the first larger (with fewer rows than parts the last are empty)."""
        pieces = {name: torch.tensor_split(t, parts) for name, t in self.tensors().items()}
        return [replace(self, **{n: p[i] for n, p in pieces.items()}) for i in range(parts)]

    @classmethod
    def concat(cls, shards: Sequence[Self]) -> Self:
        """The inverse of `split`: the shards' rows, in order."""
        names = shards[0].tensors()
        return replace(shards[0], **{n: torch.cat([s.tensors()[n] for s in shards]) for n in names})


@dataclass(frozen=True)
class Experience(Sequences):
    """Scored sequences with their advantages: what the actor and the critic train on."""

    old_log_probs: Tensor  # (B, T) log π_old(x_t): the actor's, when the batch was scored
    advantages: Tensor  # (B, T) for the policy loss
    values: Tensor | None = None  # (B, T) V(s_t): the critic's when scored; None without one
    returns: Tensor | None = None  # (B, T) the critic's regression targets; None without one
    ref_log_probs: Tensor | None = None  # (B, T) log π_ref(x_t); None without a ref role

    @classmethod
    def of(
        cls,
        sequences: Sequences,
        *,
        old_log_probs: Tensor,
        advantages: Tensor,
        values: Tensor | None = None,
        returns: Tensor | None = None,
        ref_log_probs: Tensor | None = None,
    ) -> Experience:
        base = {f.name: getattr(sequences, f.name) for f in fields(Sequences)}
        return cls(
            **base,
            old_log_probs=old_log_probs,
            values=values,
            advantages=advantages,
            returns=returns,
            ref_log_probs=ref_log_probs,
        )


def pack_rollouts(rollouts: Sequence[Rollout], pad_id: int) -> Sequences:
    """The (B, T) tensors of a batch of rollouts (see the module doc for the layout).

    `rollout_log_probs` are the engine's log-probs of the response tokens, the
    reference for off-policy correction; `policy_version` (B,) says which weights
    generated each row. A multi-turn response's tool results are attended to but not
    counted: `response_mask` is its `loss_mask`.
    """
    prompt_len = max(len(r.prompt_token_ids) for r in rollouts)
    response_len = max(max(len(r.response_token_ids) for r in rollouts), 1)
    size = (len(rollouts), prompt_len + response_len)
    input_ids = torch.full(size, pad_id, dtype=torch.long)
    attention_mask = torch.zeros(size, dtype=torch.long)
    response_mask = torch.zeros(size, dtype=torch.float32)
    rollout_log_probs = torch.zeros(size, dtype=torch.float32)
    for row, r in enumerate(rollouts):
        prompt, response = r.prompt_token_ids, r.response_token_ids
        start, end = prompt_len - len(prompt), prompt_len + len(response)
        input_ids[row, start:prompt_len] = torch.tensor(prompt)
        input_ids[row, prompt_len:end] = torch.tensor(response, dtype=torch.long)
        attention_mask[row, start:end] = 1
        response_mask[row, prompt_len:end] = torch.tensor(r.sampled_mask, dtype=torch.float32)
        rollout_log_probs[row, prompt_len:end] = torch.tensor(r.response_log_probs)
    return Sequences(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        rollout_log_probs=rollout_log_probs,
        policy_version=torch.tensor([r.policy_version for r in rollouts]),
    )


def mean_kl(kl: Tensor, mask: Tensor) -> float:
    """KL per response (tokens summed), averaged over the batch: the usual KL to report."""
    return float(masked_mean((kl * mask).sum(dim=1), (mask.sum(dim=1) > 0).float()))


def state_values(token_values: Tensor) -> Tensor:
    """Shift a value model's per-position outputs onto the layout's V(s_t).

    The model's output at position t is the value after reading x_t; the state in which
    x_t was chosen is the one after reading x_{t-1}, one position earlier.
    """
    return torch.nn.functional.pad(token_values[:, :-1], (1, 0))


def minibatches(rows: int, size: int, generator: torch.Generator) -> list[Tensor]:
    """A random partition of range(rows) into index sets of `size` (the last may be
    smaller), so every row is trained on once per epoch."""
    order = torch.randperm(rows, generator=generator)
    return list(torch.split(order, size))


def micro_batch_rows(batch: Sequences, size: int | None) -> list[Tensor]:
    """The rows of each micro-batch: `size` at a time (all of them when None), the
    longest sequences together, so that `trimmed` leaves little padding in each.

    Response lengths are long-tailed, and a micro-batch is as wide as its longest row:
    in the order they came, most micro-batches would hold one long row and pay its
    width for every row.
    """
    lengths = batch.attention_mask.sum(dim=1)
    order = torch.argsort(lengths, descending=True, stable=True)
    return list(torch.split(order, size or max(len(order), 1)))


PhaseKind = Literal["start", "turn", "step", "score"]


@dataclass(frozen=True)
class EpisodePhase:
    """A part of an episode, timed in wall-clock seconds (time.time, so that phases timed
    on a rollout node line up with the driver's timeline): the environment's `start`,
    a `turn` the policy generated, the environment's `step` (the turn's tool calls,
    answered) or its `score`."""

    kind: PhaseKind
    turn: int  # the assistant turn it belongs to, from 1 (0: the session's start)
    start: float
    end: float
    tool_calls: int = 0  # a step's: the calls parsed from its turn

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class TurnReward:
    """A reward the environment gave for one turn (its step's `reward`)."""

    turn: int  # the assistant turn, from 0
    token: int  # the index in the response of the turn's last sampled token
    reward: float


@dataclass(frozen=True)
class Episode:
    """How a multi-turn rollout went, against its environment."""

    score: float  # the environment's final score (0 for a cut episode: see `cut`)
    turns: int  # sampled assistant turns
    tool_calls: int  # parsed from those turns
    version_span: int  # policy versions between its oldest and newest turn
    # Why it ended early ("max_turns", "environment_timeout: ...": CUT_REASONS), None if
    # the environment ended it. Its reason's policy (multiTurn.cuts) says whether it is
    # trained on: masked (loss mask all 0, a score of 0 in its group's baseline), or
    # trained on with the policy's score.
    cut: str | None = None
    phases: tuple[EpisodePhase, ...] = ()  # in order; those of its last session only
    restarts: int = 0  # times its replica died and it started again on another
    turn_rewards: tuple[TurnReward, ...] = ()  # the environment's per turn, in order
    environment: str = ""  # the environments[] entry it ran in (multiTurn or its row's)

    @property
    def step_seconds(self) -> tuple[float, ...]:  # each step call to the environment
        return tuple(p.seconds for p in self.phases if p.kind == "step")


@dataclass(frozen=True)
class Rollout:
    """One generated response, as the trainer needs it. A multi-turn response is every
    turn and every tool result after the prompt, in order; `loss_mask` says which of its
    tokens the policy sampled."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]  # ends with EOS when the model stopped by itself
    # log π_rollout(a_t | s_t), one per response token (0 where loss_mask is 0)
    response_log_probs: list[float]
    finished: bool  # stopped on EOS (False: cut at max_tokens)
    policy_version: int  # the weights that started it (the oldest, when it spans several)
    # ((version, index of the first response token it generated), ...), in order: with
    # partial rollouts (fully-async mode) weights change while a response is generated,
    # e.g. ((3, 0), (4, 5)): tokens 0-4 by version 3, tokens 5.. by version 4.
    version_spans: tuple[tuple[int, int], ...] = ()
    # (len(response_token_ids),) 1 on the tokens the policy sampled, 0 on those the
    # chat template and the environment added between turns; () = all sampled.
    loss_mask: tuple[int, ...] = ()
    episode: Episode | None = None  # multi-turn rollouts only
    # An agent episode's other samples (generation.agent: calls that extended nothing),
    # trained beside this one, the sample holding its last call; earliest first.
    others: tuple[EpisodeSample, ...] = ()

    def __post_init__(self) -> None:
        if self.loss_mask and len(self.loss_mask) != len(self.response_token_ids):
            raise ValueError(
                f"a loss mask of {len(self.loss_mask)} for {len(self.response_token_ids)} tokens"
            )

    @property
    def sampled_mask(self) -> list[int]:  # (len(response_token_ids),) the loss mask, in full
        return list(self.loss_mask) or [1] * len(self.response_token_ids)


# A masked row's one token: any id of the vocabulary (it is never trained on).
PLACEHOLDER_ID = 0


def masked_placeholder(version: int, episode: Episode | None = None) -> Rollout:
    """A row that packs and trains nothing: one prompt token, no response (an agent
    episode without a call; the padding of a batch of agent samples)."""
    return Rollout([PLACEHOLDER_ID], [], [], False, version, episode=episode)


@dataclass(frozen=True)
class EpisodeSample:
    """A sample of an agent episode other than the one holding its last call: it shares
    the episode's reward, discounted (gateway.merge.sample_shares)."""

    rollout: Rollout
    share: float  # of the episode's reward: callDiscount**k, the k-th sample from the last


def tokens_per_version(spans: Sequence[tuple[int, int]], num_tokens: int) -> dict[int, int]:
    """How many of a response's `num_tokens` tokens each policy version generated.

    `spans` is a Rollout's `version_spans`: (version, first token index), the first at
    0, each span non-empty (no spans for an empty response).
    """
    if not spans and num_tokens == 0:
        return {}
    starts = [start for _, start in spans]
    ends = [*starts[1:], num_tokens]
    if not starts or starts[0] != 0 or any(s >= e for s, e in zip(starts, ends, strict=True)):
        raise ValueError(f"version spans {tuple(spans)} do not fit {num_tokens} tokens")
    counts: dict[int, int] = {}
    for (version, start), end in zip(spans, ends, strict=True):
        counts[version] = counts.get(version, 0) + end - start
    return counts
