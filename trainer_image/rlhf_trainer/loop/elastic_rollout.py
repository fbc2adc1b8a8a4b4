"""Fully async's record of which rollout engine holds which prompt, so that when an
engine is lost (its pod or node gone) the prompts it still owed go to the others.

A prompt's samples are admitted to one engine each (`assign`) and leave the ledger as
the trainer takes them (`taken`). What a lost engine held is either delivered (queued,
or trained already) or still owed: the queue tells which (`SampleQueue.not_received`),
and the owed ones are admitted again, whole, to the engines that go on. The queue drops
a second answer to the same uid, so one delivered by the lost engine at its last moment
is not trained twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rlhf_trainer.rollout.queue import Admitted


class EngineLedger:
    def __init__(self) -> None:
        self._held: dict[int, tuple[int, Admitted]] = {}  # uid -> (engine rank, admitted)

    def assign(self, ranks: Sequence[int], shards: Sequence[Sequence[Admitted]]) -> None:
        """Engine ranks[i] was given shards[i]."""
        for rank, shard in zip(ranks, shards, strict=True):
            for admitted in shard:
                self._held[admitted[0]] = (rank, admitted)

    def taken(self, uids: Iterable[int]) -> None:
        for uid in uids:
            self._held.pop(uid, None)

    def held_by(self, ranks: Iterable[int]) -> list[int]:
        """The uids given to the engines of `ranks` and not taken yet, in order."""
        lost = set(ranks)
        return sorted(uid for uid, (rank, _) in self._held.items() if rank in lost)

    def admitted(self, uids: Iterable[int]) -> list[Admitted]:
        """What admitted `uids`, to give them to other engines."""
        return [self._held[uid][1] for uid in uids]

    def __len__(self) -> int:
        return len(self._held)
