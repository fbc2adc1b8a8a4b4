"""How new policy weights reach the rollout engines, in both modes: the actor's rank 0
broadcasts them in buckets over a sync group of its own (`rollout.weight_sync`), and
every engine loads them as they arrive.

    actor rank 0 ──broadcast, bucket by bucket──▶ engine 1 … engine N

The group is opened once, at the start of a run. The actor's other ranks take part
only in gathering the full weights on rank 0 (an FSDP collective).

No silent hangs: the driver waits `timeout_s` for the group to form and for each
transfer, then fails naming the ranks that did not answer (`cluster.hangs`). The
group's own collectives wait longer (`group_timeout_s`), so that the driver, which
can tell a stopped rank from its waiting peers, is the one that reports.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rlhf_trainer.api.config import Role
from rlhf_trainer.api.plan import Phase
from rlhf_trainer.cluster.groups import join
from rlhf_trainer.cluster.role_groups import RoleGroups
from rlhf_trainer.rollout.weight_sync import DEFAULT_BUCKET_BYTES, WeightSpec

log = logging.getLogger(__name__)


def group_timeout_s(timeout_s: float) -> float:
    """How long the sync group's collectives wait: well past the driver's own wait."""
    return 2 * timeout_s + 60


class WeightSync:
    """The driver's side of the weight sync between the actor and the rollout pool."""

    def __init__(
        self,
        groups: RoleGroups,
        timeout_s: float,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.actor = groups[Role.ACTOR]
        self.rollout = groups[Role.ROLLOUT]
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.specs: list[WeightSpec] | None = None  # what the actor sends, in order
        # Engine calls the next push waits for (an evaluation): an engine busy in one
        # would join the broadcast only after it, and be taken for a hung rank.
        self.engines_busy: list[tuple[list[Any], float]] = []  # (calls, their timeout)
        # An engine beside the actor on its pool shares the actor's GPUs: NCCL will not
        # join two ranks on one device, so such a group goes through host memory.
        # (CUDA IPC would skip the copies; see the README's weight-sync notes.)
        self.transport = "host" if self.actor.pool == self.rollout.pool else "accelerator"

    def open(self) -> None:
        """Form the sync group: the actor's rank 0 and every engine."""
        host, port = join([self.actor.hosts[0].rendezvous_address.remote()])[0]
        group = (host, port, 1 + self.rollout.world_size, self.transport)
        waits = group_timeout_s(self.timeout_s)
        # Together: creating the group waits for every member.
        opened = self.actor.run("open_weight_sync", *group, waits)
        joined = self.rollout.run("open_weight_sync", *group, waits)
        self.specs = join(opened + joined, self.timeout_s)[0]

    def push(self, version: int) -> list[Any]:
        """Broadcast the actor's weights into the engines as `version`. Waits until the
        actor has sent them; returns the engines' loads (futures), which end once each
        engine has its new weights (wait for them with `wait`). A paused engine stays
        paused."""
        if self.specs is None:
            raise RuntimeError("the weight sync is not open (call open first)")
        busy, self.engines_busy = self.engines_busy, []
        started = time.monotonic()
        for calls, timeout_s in busy:
            join(calls, timeout_s)  # past it: NoAnswer, naming the engines stuck in them
        if time.monotonic() - started > 1.0:
            log.info("the weight push waited %.1f s for the engines' evaluation",
                     time.monotonic() - started)  # fmt: skip
        sends = self.actor.run("send_weights", self.bucket_bytes, phase=Phase.SYNC_WEIGHTS)
        loads = self.rollout.run(
            "receive_weights", self.specs, self.bucket_bytes, version, phase=Phase.SYNC_WEIGHTS
        )
        join(sends, self.timeout_s, involved=loads)
        return loads

    def wait_before_next_push(self, calls: list[Any], timeout_s: float) -> None:
        """Let the engines finish `calls` (within `timeout_s`) before the next push."""
        self.engines_busy.append((calls, timeout_s))

    def wait(self, loads: list[Any]) -> None:
        """Wait for the engines' loads of a push, within the timeout."""
        join(loads, self.timeout_s)
