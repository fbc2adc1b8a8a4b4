"""A job's Events, aggregated as Kubernetes does: the same type, reason and message about
the same job again bumps the `count` and `lastTimestamp` of the Event already posted,
rather than adding one (a job that keeps failing to place its pods says so once, with
a count). client-go's EventCorrelator keeps such a cache too: in memory, bounded, so a
restarted operator starts new Events."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime

from kubernetes.client.exceptions import ApiException

from rlhf_operator.api.job import API_VERSION, KIND
from rlhf_operator.controller.kube import Kube, Obj

MAX_MESSAGE = 1024  # the API server's limit on an Event's message
REMEMBERED = 4096  # Events kept for aggregation, newest first (as client-go's LRU)

# (job uid, type, reason, message) -> (namespace, Event name, count)
_Key = tuple[str, str, str, str]


class EventRecorder:
    def __init__(self, kube: Kube, now: Callable[[], datetime]) -> None:
        self.kube = kube
        self.now = now
        self._lock = threading.Lock()
        self._posted: OrderedDict[_Key, tuple[str, str, int]] = OrderedDict()

    def post(self, job: Obj, reason: str, message: str, warning: bool) -> None:
        meta = job["metadata"]
        kind = "Warning" if warning else "Normal"
        key = (meta["uid"], kind, reason, message[:MAX_MESSAGE])
        now = self.now().isoformat().replace("+00:00", "Z")
        with self._lock:
            seen = self._posted.get(key)
        if seen is not None and self._bump(key, seen, now):
            return
        created = self.kube.create(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {
                    "apiVersion": API_VERSION,
                    "kind": KIND,
                    "name": meta["name"],
                    "namespace": meta["namespace"],
                    "uid": meta["uid"],
                },
                "type": kind,
                "reason": reason,
                "message": key[3],
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
                "source": {"component": "rlhf-operator"},
                "reportingComponent": "rlhf-operator",
            }
        )
        if created is not None:
            self._remember(key, (meta["namespace"], created["metadata"]["name"], 1))

    def _bump(self, key: _Key, seen: tuple[str, str, int], now: str) -> bool:
        """Count the Event posted before once more; False if it is gone (Events expire
        after an hour, by default) or may not be patched (a Role from before the
        operator aggregated): then a new one is posted."""
        namespace, name, count = seen
        try:
            self.kube.patch("Event", namespace, name, {"count": count + 1, "lastTimestamp": now})
        except ApiException as error:
            if error.status not in (403, 404):
                raise
            return False
        self._remember(key, (namespace, name, count + 1))
        return True

    def _remember(self, key: _Key, posted: tuple[str, str, int]) -> None:
        with self._lock:
            self._posted[key] = posted
            self._posted.move_to_end(key)
            while len(self._posted) > REMEMBERED:
                self._posted.popitem(last=False)
