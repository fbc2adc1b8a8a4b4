"""The watches' cache the reconcile reads from (controller/cache.py): newest version wins,
deletions, label selectors, and copies. That the operator then makes no per-event read
is proven on a real API server (tests/controlplane/test_examples.py)."""

from __future__ import annotations

from typing import Any

import pytest

from rlhf_operator.controller.cache import CachedKube, ObjectCache, matches
from rlhf_operator.controller.kube import Kube


def pod(
    name: str, version: int, job: str = "a", namespace: str = "ns", uid: str = "uid"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": str(version),
            "labels": {"rlhf.dev/job": job},
        },
        "status": {"phase": "Running"},
    }


def test_a_late_event_does_not_undo_a_newer_write() -> None:
    cache = ObjectCache(frozenset({"Pod"}))
    cache.observe("Pod", None, pod("p", 7))  # a write's answer
    cache.observe("Pod", "MODIFIED", pod("p", 5) | {"status": {"phase": "Pending"}})
    found = cache.get("Pod", "ns", "p")
    assert found is not None and found["metadata"]["resourceVersion"] == "7"
    assert found["kind"] == "Pod"  # list items and kopf bodies may lack it
    cache.observe(
        "Pod",
        "MODIFIED",
        pod("p", 8)
        | {"metadata": pod("p", 8)["metadata"] | {"managedFields": [{"manager": "kubelet"}]}},
    )
    assert (
        "managedFields" not in (cache.get("Pod", "ns", "p") or {})["metadata"]
    )  # never read: not kept
    cache.observe("Pod", "MODIFIED", pod("p", 9) | {"status": {"phase": "Failed"}})
    assert (cache.get("Pod", "ns", "p") or {})["status"]["phase"] == "Failed"


def test_a_deletion_removes_the_object_unless_a_newer_one_is_known() -> None:
    cache = ObjectCache(frozenset({"Pod"}))
    cache.observe("Pod", None, pod("p", 3))
    assert cache.holds("Pod", "ns", "p") and not cache.holds("Pod", "other", "p")
    cache.observe("Pod", "DELETED", pod("p", 4))
    assert cache.get("Pod", "ns", "p") is None and len(cache) == 0
    assert not cache.holds("Pod", "ns", "p")
    cache.observe("Pod", "ADDED", pod("q", 10))  # made again under the same name: newer
    cache.observe("Pod", "DELETED", pod("q", 8))  # the old one's deletion, late
    assert cache.get("Pod", "ns", "q") is not None and cache.holds("Pod", "ns", "q")


def test_a_list_selects_by_namespace_and_labels_and_returns_copies() -> None:
    cache = ObjectCache(frozenset({"Pod"}))
    for name, job, namespace in [("a1", "a", "ns"), ("a2", "a", "ns"), ("b1", "b", "ns"),
                                 ("a3", "a", "other")]:  # fmt: skip
        cache.observe("Pod", "ADDED", pod(name, 1, job, namespace))
    found = cache.list("Pod", "ns", "rlhf.dev/job=a")
    assert sorted(p["metadata"]["name"] for p in found) == ["a1", "a2"]
    found[0]["status"]["phase"] = "Changed"  # the reconcile may change what it reads
    again = cache.list("Pod", "ns", "rlhf.dev/job=a")
    assert {p["status"]["phase"] for p in again} == {"Running"}
    assert cache.list("Pod", "nowhere", "rlhf.dev/job=a") == []


def test_selectors_are_equality_terms_only() -> None:
    labels = {"rlhf.dev/job": "a", "app": "x"}
    assert matches(labels, "rlhf.dev/job=a,app=x")
    assert not matches(labels, "rlhf.dev/job=a,app=y")
    assert not matches({}, "rlhf.dev/job=a")
    for unsupported in ("rlhf.dev/job", "rlhf.dev/job!=a", "app in (x)"):
        with pytest.raises(ValueError, match="only key=value terms"):
            matches(labels, unsupported)


class NoApiServer:
    """Stands in for the ApiClient where a test proves no request is made: any use fails."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the API server was asked ({name})")


def test_reads_of_cached_kinds_make_no_request() -> None:
    cache = ObjectCache(frozenset({"Pod", "RayJob"}))
    cache.observe("RayJob", "ADDED", pod("j", 1) | {"spec": {"suspend": False}})
    cache.observe("Pod", "ADDED", pod("p", 1))
    kube = CachedKube(NoApiServer(), cache)
    assert (kube.get("RayJob", "ns", "j") or {})["spec"] == {"suspend": False}
    assert [p["metadata"]["name"] for p in kube.list("Pod", "ns", "rlhf.dev/job=a")] == ["p"]
    with pytest.raises(AssertionError, match="the API server was asked"):
        kube.get("RayCluster", "ns", "c")  # not cached: asked
    with pytest.raises(AssertionError, match="the API server was asked"):
        kube.get("RayJob", "ns", "missing")  # a miss: asked
    # `known` trusts the miss too: a new job's RayJob is looked up without a request.
    assert kube.known("RayJob", "ns", "missing") is None
    assert (kube.known("RayJob", "ns", "j") or {})["spec"] == {"suspend": False}
    with pytest.raises(AssertionError, match="the API server was asked"):
        kube.known("RayCluster", "ns", "c")  # not cached: asked


def deleted_by(answer: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands Kube.delete's answer in for the API server's."""

    def delete(self: Any, kind: str, namespace: str, name: str, uid: str) -> Any:
        return answer

    monkeypatch.setattr(Kube, "delete", delete)


def test_a_deletion_held_by_a_finalizer_is_seen_by_the_next_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KubeRay's finalizer keeps a deleted RayJob a while: the next reconcile must see
    it going (and not delete it again), before the watch says so."""
    cache = ObjectCache(frozenset({"RayJob"}))
    cache.observe("RayJob", "ADDED", pod("j", 1, uid="u1"))
    going = pod("j", 2, uid="u1")
    going["metadata"]["deletionTimestamp"] = "2026-11-29T07:00:00Z"
    deleted_by(going, monkeypatch)
    kube = CachedKube(NoApiServer(), cache)
    assert kube.delete("RayJob", "ns", "j", uid="u1") == going
    assert (kube.get("RayJob", "ns", "j") or {})["metadata"]["deletionTimestamp"]


def test_an_object_deleted_at_once_leaves_the_cache_but_a_newer_one_by_its_name_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = ObjectCache(frozenset({"Pod"}))
    for name, uid in (("old", "u1"), ("new", "u2")):
        cache.observe("Pod", "ADDED", pod(name, 1, uid=uid))
    deleted_by(None, monkeypatch)  # gone (a Status), or 409: another uid holds the name
    kube = CachedKube(NoApiServer(), cache)
    kube.delete("Pod", "ns", "old", uid="u1")
    kube.delete("Pod", "ns", "new", uid="u1")  # the newer pod "new" is not the one asked
    assert not cache.holds("Pod", "ns", "old")
    assert cache.holds("Pod", "ns", "new")


def test_an_answer_older_than_a_deletion_does_not_bring_the_object_back() -> None:
    """A write's answer (version 5) that returns after the watch said the object was
    deleted (at 6) is older than the deletion's tombstone: the object stays gone. One
    made again by the same name (version 9) is newer and is held."""
    cache = ObjectCache(frozenset({"Pod"}))
    cache.observe("Pod", "ADDED", pod("p", 4))
    assert cache.observe("Pod", "DELETED", pod("p", 6))
    assert not cache.observe("Pod", None, pod("p", 5))  # the write's answer, late
    assert not cache.observe("Pod", "MODIFIED", pod("p", 6))
    assert not cache.holds("Pod", "ns", "p")
    assert cache.observe("Pod", "ADDED", pod("p", 9, uid="new"))
    assert (cache.get("Pod", "ns", "p") or {})["metadata"]["uid"] == "new"
    cache.forget("Pod", "ns", "p")  # the API server said 404: buried at what was held
    assert not cache.observe("Pod", "MODIFIED", pod("p", 9, uid="new"))


def test_a_listing_replaces_what_the_cache_holds_in_its_namespace() -> None:
    """A re-list at version 20: `gone` (deleted in the watch's gap) is dropped, `changed`
    is updated, `fresh` (seen after the listing, at 21) and the other namespace's pod are
    kept; an event of the gap about `gone` arriving late cannot bring it back. The
    changes are returned: they name the jobs to reconcile."""
    cache = ObjectCache(frozenset({"Pod"}))
    for obj in (pod("same", 3), pod("gone", 4, job="b"), pod("changed", 5), pod("fresh", 21),
                pod("elsewhere", 2, namespace="other")):  # fmt: skip
        cache.observe("Pod", "ADDED", obj)
    changed = cache.replace("Pod", "ns", [pod("same", 3), pod("changed", 12)], version=20)
    assert sorted((o["metadata"]["name"], o["metadata"]["resourceVersion"]) for o in changed) == [
        ("changed", "12"),
        ("gone", "4"),
    ]
    assert sorted(o["metadata"]["name"] for o in cache.list("Pod", "ns", "rlhf.dev/job=a")) == [
        "changed",
        "fresh",
        "same",
    ]
    assert cache.holds("Pod", "other", "elsewhere")
    assert not cache.observe("Pod", "MODIFIED", pod("gone", 7, job="b"))
    assert cache.replace("Pod", "ns", [pod("same", 3), pod("changed", 12)], 20) == []
    assert cache.replace("Pod", "ns", [pod("same", 3), pod("changed", 12)], 30) == [
        pod("fresh", 21) | {"kind": "Pod"}
    ]  # not in a listing newer than it: gone too, by then
    assert sorted(cache.namespaces("Pod")) == ["ns", "other"]
