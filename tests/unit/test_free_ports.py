"""The test harness's free ports: a port picked for a component that binds it later is
never picked again meanwhile (the real node's kube-proxy once got KubeRay's, and KubeRay
exited on "address already in use")."""

from __future__ import annotations

import random

import pytest

from tests.controlplane import processes


def test_a_port_given_is_not_given_again_though_still_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same candidates, in the same order, for every call: without the memory of
    # what was given, both calls would answer the same (still unbound) ports.
    monkeypatch.setattr(random, "sample", lambda ports, k: list(ports)[:k])
    monkeypatch.setattr(processes, "_given", set())
    first, second = processes.free_ports(4), processes.free_ports(4)
    assert len(set(first)) == len(set(second)) == 4
    assert not set(first) & set(second), (first, second)
