"""Re-lists that keep the watch cache true (cache.py).

After a watch answered 410 Gone, or the API server restarted, kopf lists the kind again
and sends each object that exists as an event of type None, but nothing for what was
deleted in the gap: a RayJob deleted for a restart would stay in the cache and the job
would wait for its deletion for ever; a child deleted out of band would never be made
again. So a listing event (type None) asks for an authoritative list of its kind, taken
from the API server after the gap, which replaces what the cache holds
(`ObjectCache.replace`); the jobs whose objects it changed are reconciled. The same
re-list runs every `RELIST_SECONDS` too, for what no event can reveal (every object of
a kind gone in the gap, so kopf's listing sends nothing).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

from rlhf_operator.controller.cache import ObjectCache
from rlhf_operator.controller.kube import Kube, Obj
from rlhf_operator.controller.workqueue import Key
from rlhf_operator.render.children import JOB_LABEL

log = logging.getLogger(__name__)

RELIST_SECONDS = 300.0
# A listing's events come in a burst: the re-list it asks for waits this long, so that
# one list answers the whole burst.
SETTLE_SECONDS = 0.5


def job_of(kind: str, obj: Obj) -> Key:
    """The job an object of `kind` belongs to (a job, to itself)."""
    meta = obj["metadata"]
    if kind == "RLHFJob":
        return meta["namespace"], meta["name"]
    return meta["namespace"], meta["labels"][JOB_LABEL]


@dataclass(frozen=True)
class Relister:
    kube: Kube  # its `listing` asks the API server
    cache: ObjectCache
    selectors: Mapping[str, str]  # kind -> the label selector its watch's handler filters by

    def relist(self, kind: str) -> set[Key]:
        """List `kind` in each namespace the cache holds it in, replacing what the cache
        holds there; the jobs whose objects changed."""
        jobs = set()
        for namespace in self.cache.namespaces(kind):
            listed, version = self.kube.listing(
                kind, namespace, self.selectors[kind], verb="relist"
            )
            changed = self.cache.replace(kind, namespace, listed, version)
            jobs |= {job_of(kind, obj) for obj in changed}
            if changed:
                log.info("re-list of %s in %s at resourceVersion %d: %d changed (the "
                         "watch missed them)", kind, namespace, version, len(changed))  # fmt: skip
        return jobs


class Relists:
    """At most one re-list of a kind at a time; one asked for while it runs (a later
    event of the burst) runs once more after it."""

    def __init__(
        self, relister: Relister, executor: Executor, reconcile: Callable[[Key], None]
    ) -> None:
        self.relister = relister
        self.executor = executor
        self.reconcile = reconcile
        self.running: dict[str, asyncio.Task[None]] = {}
        self.again: set[str] = set()

    def ask_all(self) -> None:
        for kind in self.relister.selectors:
            self.ask(kind)

    def ask(self, kind: str) -> None:
        if kind in self.running:
            self.again.add(kind)
        else:
            self.running[kind] = asyncio.create_task(self._run(kind))

    async def _run(self, kind: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(SETTLE_SECONDS)
            while True:
                self.again.discard(kind)
                try:
                    jobs = await loop.run_in_executor(self.executor, self.relister.relist, kind)
                except Exception:  # the API server unreachable: the next ask, or the period
                    log.exception("re-list of %s failed", kind)
                    return
                for job in jobs:
                    self.reconcile(job)
                if kind not in self.again:
                    return
        finally:
            del self.running[kind]

    async def every(self, seconds: float = RELIST_SECONDS) -> None:
        """Re-list every kind each `seconds`, until `close`."""
        while True:
            await asyncio.sleep(seconds)
            self.ask_all()

    def close(self) -> None:
        """Cancel the re-lists under way (the operator stops; its executor with it)."""
        for task in list(self.running.values()):
            task.cancel()
