"""What the operator's watches have seen, so a reconcile reads from memory, not the API
server, as KubeRay reads from its informers' caches.

kopf watches the jobs and every kind of child (app/handlers.py); each handler stores the
event's object here before it queues the job, so the reconcile an event brings sees at
least that event. The reconcile's own writes are stored too (read-your-writes): its next
look sees the status it wrote, and does not post the same event again. An object is
replaced only by one at least as new (by resourceVersion), so a late watch event does
not undo a write.

A get that misses asks the API server: an object made since the last event, or not yet
listed while the operator starts. A list is answered from memory alone: at start-up,
before kopf has listed everything, it may see fewer pods for a moment, and the events
that follow bring the reconcile that sees them.

A watch can miss deletions: after a 410 Gone (or an API server restart) kopf lists
again and sends every object that exists, but no DELETED for what went in the gap.
`replace` takes an authoritative listing (relist.py) and drops what it lacks. A deletion
leaves a tombstone at its resourceVersion, so an older event or write answer that
arrives after it cannot bring the object back.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from rlhf_operator.controller.kube import MERGE_PATCH, Kube, Obj

DELETED = "DELETED"
# Tombstones kept per kind (the oldest go first): enough for every deletion of a burst
# of jobs to outlive the stale answers in flight about it.
MAX_TOMBSTONES = 10_000


@dataclass(frozen=True)
class _Stored:
    """One object as JSON: a tenth of the memory of its dicts, and each read parses a
    fresh copy (the reconcile may change what it reads)."""

    namespace: str
    name: str
    version: int  # its resourceVersion as a number (etcd's revision); -1 if none
    labels: dict[str, str]
    json: str

    @classmethod
    def of(cls, kind: str, obj: Obj) -> _Stored:
        # A list's items carry no kind. managedFields (who set which field) are often an
        # object's largest part, and never read.
        meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
        version = str(meta.get("resourceVersion") or "")
        return cls(
            meta["namespace"],
            meta["name"],
            int(version) if version.isdigit() else -1,
            dict(meta.get("labels") or {}),
            json.dumps({**obj, "kind": kind, "metadata": meta}),
        )

    def object(self) -> Obj:
        obj: Obj = json.loads(self.json)
        return obj


def matches(labels: dict[str, str], selector: str) -> bool:
    """Whether `labels` match `selector`, a comma-separated list of key=value (the only
    form the operator asks for)."""
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if not sep or "!" in key:
            raise ValueError(f"label selector {selector!r}: only key=value terms are cached")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class ObjectCache:
    """The last seen version of each object of the cached kinds, by namespace and name."""

    def __init__(self, kinds: frozenset[str]) -> None:
        self.kinds = kinds
        self._lock = threading.Lock()
        # kind -> namespace -> name -> object
        self._objects: dict[str, dict[str, dict[str, _Stored]]] = {kind: {} for kind in kinds}
        # kind -> (namespace, name) -> the resourceVersion it was deleted at, or after
        self._tombstones: dict[str, dict[tuple[str, str], int]] = {kind: {} for kind in kinds}

    def observe(self, kind: str, event_type: str | None, obj: Obj) -> bool:
        """A watch event (`event_type` None: a listing's) or a write's answer; whether it
        changed what the cache holds."""
        with self._lock:
            return self._observe(kind, event_type, _Stored.of(kind, obj))

    def _observe(self, kind: str, event_type: str | None, stored: _Stored) -> bool:
        namespace, name = stored.namespace, stored.name
        names = self._objects[kind].setdefault(namespace, {})
        known = names.get(name)
        if known is not None and stored.version < known.version:
            return False  # older than what a write already stored
        if event_type == DELETED:
            self._bury(kind, namespace, name, stored.version)
            return names.pop(name, None) is not None
        buried = self._tombstones[kind].get((namespace, name))
        if buried is not None:
            if stored.version <= buried:
                return False  # an answer about the object before it was deleted
            del self._tombstones[kind][(namespace, name)]  # a newer one by its name
        names[name] = stored
        return known is None or known.version != stored.version

    def _bury(self, kind: str, namespace: str, name: str, version: int) -> None:
        graves = self._tombstones[kind]
        graves[(namespace, name)] = max(version, graves.pop((namespace, name), -1))
        if len(graves) > MAX_TOMBSTONES:
            del graves[next(iter(graves))]

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """The API server said the object is gone: what the cache held is buried."""
        with self._lock:
            known = self._objects[kind].get(namespace, {}).pop(name, None)
            if known is not None:
                self._bury(kind, namespace, name, known.version)

    def replace(self, kind: str, namespace: str, listed: list[Obj], version: int) -> list[Obj]:
        """An authoritative listing of `kind` in `namespace`, taken at resourceVersion
        `version`: what the cache holds there and the listing lacks is dropped (unless
        seen after the listing), and what it has is observed. Returns what changed: the
        objects dropped, as they were, and those new or newer."""
        changed = []
        with self._lock:
            for stored in (_Stored.of(kind, obj) for obj in listed):
                if self._observe(kind, None, stored):
                    changed.append(stored.object())
            names = self._objects[kind].get(namespace, {})
            present = {obj["metadata"]["name"] for obj in listed}
            for name in [n for n, s in names.items() if n not in present and s.version <= version]:
                changed.append(names.pop(name).object())
                self._bury(kind, namespace, name, version)
        return changed

    def namespaces(self, kind: str) -> list[str]:
        """The namespaces the cache holds objects of `kind` in."""
        with self._lock:
            return [namespace for namespace, names in self._objects[kind].items() if names]

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        with self._lock:
            found = self._objects[kind].get(namespace, {}).get(name)
        return None if found is None else found.object()

    def holds(self, kind: str, namespace: str, name: str) -> bool:
        with self._lock:
            return name in self._objects[kind].get(namespace, {})

    def list(self, kind: str, namespace: str, selector: str) -> list[Obj]:
        with self._lock:
            found = [
                stored
                for stored in self._objects[kind].get(namespace, {}).values()
                if matches(stored.labels, selector)
            ]
        return [stored.object() for stored in found]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(names) for by_ns in self._objects.values() for names in by_ns.values())


class CachedKube(Kube):
    """Kube whose reads of the cached kinds come from `cache`, and whose writes of them
    are stored in it; every other kind goes to the API server as before."""

    def __init__(self, api: Any, cache: ObjectCache) -> None:
        super().__init__(api)
        self.cache = cache

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        if kind not in self.cache.kinds:
            return super().get(kind, namespace, name)
        found = self.cache.get(kind, namespace, name)
        if found is None:  # made since the last event, or not listed yet: ask
            found = super().get(kind, namespace, name)
            if found is not None:
                self.cache.observe(kind, None, found)
        return found

    def known(self, kind: str, namespace: str, name: str) -> Obj | None:
        """What the cache holds, a miss included (not asked about): for a look-up where a
        wrong miss costs no more than a create answered 409."""
        if kind not in self.cache.kinds:
            return super().get(kind, namespace, name)
        return self.cache.get(kind, namespace, name)

    def read(self, kind: str, namespace: str, name: str) -> Obj | None:
        """From the API server; what it says is stored, a deletion too (the watch may
        tell later: the reconciles between would each ask again)."""
        found = super().get(kind, namespace, name)
        if kind in self.cache.kinds:
            if found is None:
                self.cache.forget(kind, namespace, name)
            else:
                self.cache.observe(kind, None, found)
        return found

    def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        if kind not in self.cache.kinds:
            return super().list(kind, namespace, label_selector)
        return self.cache.list(kind, namespace, label_selector)

    def create(self, obj: Obj) -> Obj | None:
        created = super().create(obj)
        self._store(obj["kind"], created)
        return created

    def patch(self, kind: str, namespace: str, name: str, patch: Any,
              content_type: str = MERGE_PATCH, subresource: str | None = None) -> Obj:  # fmt: skip
        patched = super().patch(kind, namespace, name, patch, content_type, subresource)
        self._store(kind, patched)
        return patched

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> Obj | None:
        """As Kube's; the cache then holds what is left (going), or no longer that object
        (a newer one by its name stays): the next reconcile does not delete it again."""
        left = super().delete(kind, namespace, name, uid)
        if kind not in self.cache.kinds:
            return left
        known = self.cache.get(kind, namespace, name)
        if left is not None:
            self.cache.observe(kind, None, left)
        elif known is not None and known["metadata"].get("uid") == uid:
            self.cache.forget(kind, namespace, name)
        return left

    def _store(self, kind: str, obj: Obj | None) -> None:
        if obj is not None and kind in self.cache.kinds:
            self.cache.observe(kind, None, obj)
