"""Leader election through a coordination.k8s.io Lease, as controller-runtime does it.

Every replica runs the same code; only the one holding the Lease reconciles. A standby
reads the Lease every `retry` seconds and takes it once its holder stopped renewing for
`duration` seconds, timed on the standby's own clock from when it last saw the record
change (so the replicas' clocks need not agree, as client-go's leaderelection). The
leader renews every `retry` seconds; one that cannot for `renew_deadline` (less than
`duration`) stops at once, before a standby may take over, so two never reconcile
together. A leader that stops cleanly gives the Lease up, and a standby takes it within
`retry` seconds.

Why not kopf's peering: replicas of equal priority all pause there, and with distinct
priorities a replacement pod of higher priority pre-empts the running leader, whose
pause only stops kopf's watches (this operator's own work queue and delayed requeues
would go on), with no lock between the two meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rlhf_operator.controller.kube import KINDS, Kube, Obj

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseTiming:
    """controller-runtime's defaults: 15 s, 10 s, 2 s."""

    duration: float = 15.0  # how long a standby waits for an unrenewed Lease
    renew_deadline: float = 10.0  # how long the leader tries to renew before it stops
    retry: float = 2.0  # how often each replica tries

    @classmethod
    def scaled(cls, duration: float) -> LeaseTiming:
        """controller-runtime's proportions for another duration."""
        return cls(duration, duration * 2 / 3, duration * 2 / 15)


@dataclass
class LeaseLock:
    """One replica's view of the Lease; every call is one or two requests."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    timing: LeaseTiming = field(default_factory=LeaseTiming)
    # The holder's record as last seen, and when (this process's monotonic clock).
    _seen: Any = None
    _seen_at: float = 0.0

    def try_acquire_or_renew(self) -> bool:
        """Take or renew the Lease; False while another replica holds it, or when another
        write won the race. API errors propagate (the caller decides what they mean)."""
        lease = self.kube.get("Lease", self.namespace, self.name)
        if lease is None:
            return self.kube.create(self._ours(None)) is not None  # None: 409, lost the race
        spec = lease.get("spec") or {}
        record = (lease["metadata"].get("resourceVersion"), spec.get("renewTime"))  # each write
        now = time.monotonic()
        if record != self._seen:
            self._seen, self._seen_at = record, now
        holder = spec.get("holderIdentity") or ""
        expired = now >= self._seen_at + float(spec.get("leaseDurationSeconds") or 0)
        if holder and holder != self.identity and not expired:
            return False
        return self.kube.replace(self._ours(lease)) is not None

    def holder(self) -> str:
        """Who holds the Lease now ("" if nobody)."""
        lease = self.kube.get("Lease", self.namespace, self.name) or {}
        return str((lease.get("spec") or {}).get("holderIdentity") or "")

    def release(self) -> None:
        """Give the Lease up (only if still ours), so a standby takes it at once."""
        lease = self.kube.get("Lease", self.namespace, self.name)
        spec = (lease or {}).get("spec") or {}
        if lease is None or spec.get("holderIdentity") != self.identity:
            return
        lease["spec"] = spec | {"holderIdentity": "", "leaseDurationSeconds": 1,
                                "renewTime": _micro_time()}  # fmt: skip
        self.kube.replace(lease)

    def _ours(self, lease: Obj | None) -> Obj:
        """The Lease (a new one if None) held by this replica from now."""
        now = _micro_time()
        spec = (lease or {}).get("spec") or {}
        ours = spec.get("holderIdentity") == self.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours or not lease else 1)
        body = lease or {
            "apiVersion": KINDS["Lease"].api_version,
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
        }
        body["kind"] = "Lease"  # a read object has it too; Kube.replace needs it
        body["spec"] = spec | {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.timing.duration)),
            "acquireTime": spec.get("acquireTime") if ours else now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        return body


class LeaderElector:
    """Waits to lead, then keeps the Lease; `lost` is set when it no longer can."""

    def __init__(self, lock: LeaseLock) -> None:
        self.lock = lock
        self.leading = False
        self.lost = asyncio.Event()
        self._renewing: asyncio.Task[None] | None = None

    async def acquire(self) -> None:
        """Return once this replica leads; renewals go on in the background."""
        logged = False
        while not await self._try():
            if not logged:
                log.info("waiting to lead: Lease %s/%s is held by another replica",
                         self.lock.namespace, self.lock.name)  # fmt: skip
                logged = True
            await asyncio.sleep(self.lock.timing.retry)
        log.info("leading as %s (Lease %s/%s)", self.lock.identity, self.lock.namespace,
                 self.lock.name)  # fmt: skip
        self.leading = True
        self._renewing = asyncio.create_task(self._renew())

    async def _try(self) -> bool | None:
        """Whether this replica holds the Lease now; None if the API server did not say."""
        try:
            return await asyncio.to_thread(self.lock.try_acquire_or_renew)
        except Exception as error:  # the API server unreachable: try again later
            log.warning("Lease %s/%s: %s", self.lock.namespace, self.lock.name, error)
            return None

    async def _renew(self) -> None:
        timing, renewed = self.lock.timing, time.monotonic()
        while True:
            await asyncio.sleep(timing.retry)
            held = await self._try()
            if held:
                renewed = time.monotonic()
                continue
            if held is None and time.monotonic() - renewed < timing.renew_deadline:
                continue
            why = "another replica holds it" if held is False else (
                f"could not renew it for {timing.renew_deadline:.0f}s")  # fmt: skip
            log.error("Lease %s/%s: no longer leading: %s", self.lock.namespace,
                      self.lock.name, why)  # fmt: skip
            self.leading = False
            self.lost.set()
            return

    async def release(self) -> None:
        """Stop renewing and give the Lease up, if this replica led."""
        if self._renewing is not None:
            self._renewing.cancel()
        if not self.leading:
            return
        self.leading = False
        try:
            await asyncio.to_thread(self.lock.release)
        except Exception as error:  # it expires anyway, `duration` seconds on
            log.warning("could not give up Lease %s/%s: %s", self.lock.namespace,
                        self.lock.name, error)  # fmt: skip


def _micro_time() -> str:
    """A Lease's MicroTime."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
