"""When each object of a burst reached an endpoint, as a watch of the API server saw it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch
from urllib3.exceptions import ProtocolError

Event = dict[str, Any]  # a watch event: {"type": ..., "object": ...}
Kind = tuple[str, str, str]  # group, version, plural


def child_added(event: Event) -> str | None:
    """The owner's name of a child that appeared."""
    if event["type"] != "ADDED":
        return None
    name: str = event["object"]["metadata"]["ownerReferences"][0]["name"]
    return name


def status_written(event: Event) -> str | None:
    """The name of an object whose status is there."""
    name: str = event["object"]["metadata"]["name"]
    return name if event["object"].get("status") else None


class Appearances:
    """Watches a kind in a namespace and records when each name that `seen_in` finds in
    an event was first found."""

    def __init__(self, api: client.ApiClient, kind: Kind, namespace: str,
                 seen_in: Callable[[Event], str | None]) -> None:  # fmt: skip
        self.seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(api, kind, namespace, seen_in), daemon=True
        )
        self._thread.start()
        self._ready.wait(10)

    def _run(self, api: client.ApiClient, kind: Kind, namespace: str,
             seen_in: Callable[[Event], str | None]) -> None:  # fmt: skip
        objects = client.CustomObjectsApi(api)
        stream = watch.Watch()  # type: ignore[no-untyped-call]
        self._ready.set()
        group, version, plural = kind
        events = stream.stream(  # type: ignore[no-untyped-call]
            objects.list_namespaced_custom_object, group, version, namespace, plural,
            timeout_seconds=900,
        )  # fmt: skip
        try:
            for event in events:
                name = seen_in(event)
                if name is not None:
                    self.seen.setdefault(name, time.monotonic())
                if self._stop.is_set():
                    stream.stop()  # type: ignore[no-untyped-call]
        except ProtocolError:
            if not self._stop.is_set():
                raise  # else the control plane stopped under a watch no longer needed

    def wait_for(self, names: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not all(n in self.seen for n in names):
            if not self._thread.is_alive():
                raise RuntimeError("the watch ended early (its error is printed above)")
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in self.seen]
                raise TimeoutError(f"{len(missing)} never appeared, e.g. {missing[:3]}")
            time.sleep(0.05)

    def after(self, started: dict[str, float]) -> list[float]:
        """Each name's seconds from its start until it was seen."""
        return [self.seen[name] - t0 for name, t0 in started.items()]

    def close(self) -> None:
        self._stop.set()  # the stream ends at its next event
