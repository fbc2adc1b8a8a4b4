"""Hypothesis strategies: valid RLHFJob manifests, and arbitrary damage done to them."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

POOL_NAMES = ["a", "b", "policy", "value", "rollout", "gen-2"]
ROLES = ["actor", "rollout", "critic", "ref", "reward"]
ESTIMATORS = ["gae", "grpo", "rloo", "reinforce++", "reinforce++-baseline"]
GROUP_ESTIMATORS = ["grpo", "rloo", "reinforce++-baseline"]


@st.composite
def valid_jobs(draw: st.DrawFn) -> dict[str, Any]:
    """A manifest that satisfies every rule, built so each rule holds by construction."""
    kl_coef = draw(st.sampled_from([0.0, 0.05]))
    reward_is_model = draw(st.booleans())
    estimator = draw(st.sampled_from(ESTIMATORS))
    present = ["actor", "rollout"] + (["critic"] if estimator == "gae" else [])
    present += ["ref"] if kl_coef > 0 or draw(st.booleans()) else []
    present += ["reward"] if reward_is_model or draw(st.booleans()) else []
    # A random surjection of roles onto pools: every pool hosts at least one role.
    n_pools = draw(st.integers(1, min(4, len(present))))
    names = draw(
        st.lists(st.sampled_from(POOL_NAMES), min_size=n_pools, max_size=n_pools, unique=True)
    )
    order = draw(st.permutations(present))
    roles = {
        role: names[i] if i < n_pools else draw(st.sampled_from(names))
        for i, role in enumerate(order)
    }
    asynchronous = roles["rollout"] != roles["actor"] and draw(st.booleans())
    pools = [
        {"name": n, "replicas": draw(st.integers(1, 4)), "gpusPerNode": draw(st.integers(1, 8))}
        for n in names
    ]
    gpus = {p["name"]: p["replicas"] * p["gpusPerNode"] for p in pools}
    per_rank = draw(st.integers(1, 4))
    mini = math.lcm(gpus[roles["actor"]], gpus.get(roles.get("critic", ""), 1)) * per_rank
    samples = draw(st.integers(2 if estimator in GROUP_ESTIMATORS else 1, 8))
    rollout_pool = next(p for p in pools if p["name"] == roles["rollout"])
    tp = draw(st.sampled_from([d for d in range(1, 9) if rollout_pool["gpusPerNode"] % d == 0]))
    spec: dict[str, Any] = {
        "pools": pools,
        "roles": roles,
        "models": {
            "actor": draw(
                st.sampled_from(
                    [{"path": "org/model"}, {"tiny": {"hiddenSize": 64, "numHeads": 2}}]
                )
            ),
            "reward": {"path": "/models/rm"} if reward_is_model else {"function": "toy_copy"},
        },
        "data": {"train": "toy:copy", "maxResponseLength": draw(st.integers(1, 4096))},
        "algorithm": {
            "klCoef": kl_coef,
            "gamma": draw(st.floats(0, 1)),
            "klMode": draw(st.sampled_from(["reward", "loss"])),
            "advantageEstimator": estimator,
            "clipRatioLow": draw(st.floats(0.05, 0.3)),
            "clipRatioHigh": draw(st.floats(0.3, 1.0)),
        },
        "generation": {
            "tensorParallelSize": tp,
            "temperature": draw(st.floats(0.1, 2.0)),
            "samplesPerPrompt": samples,
        },
        "trainer": {
            "batchSize": mini * draw(st.integers(1, 4)),
            "miniBatchSize": mini,
            "microBatchSize": draw(
                st.sampled_from([d for d in range(1, per_rank + 1) if per_rank % d == 0])
            ),
            "totalSteps": draw(st.integers(1, 10**6)),
        },
        "separation": draw(st.sampled_from(["node", "gpu"])),
    }
    if samples > 1 and draw(st.booleans()):
        spec["algorithm"]["dynamicSampling"] = {"maxAttempts": draw(st.integers(1, 10))}
    if draw(st.booleans()):
        spec["environments"] = [draw(st.sampled_from([
            {"name": "tools", "url": "http://tools.team.svc:8000"},
            {"name": "tools", "serve": "rlhf_env.toys:LetterLookup"},
            {"name": "tools", "image": "tools:1", "command": ["serve"], "port": 9000,
             "replicas": 2, "resources": {"cpu": 1}, "egress": True},
        ]))]  # fmt: skip
        spec["generation"]["multiTurn"] = {
            "environment": "tools",
            "maxTurns": draw(st.integers(1, 16)),
            "maxTokens": draw(st.integers(513, 8192)),  # above maxPromptLength's default
        }
        if draw(st.booleans()):
            policy: dict[str, Any] = {"policy": draw(st.sampled_from(["mask", "train"]))}
            if policy["policy"] == "train" and draw(st.booleans()):  # a score: train only
                policy["score"] = draw(st.sampled_from([-1.0, 0.5]))
            spec["generation"]["multiTurn"]["cuts"] = {"environmentError": policy}
        spec["models"]["reward"] = {"environment": True}
    if asynchronous:
        spec["async"] = {
            "stalenessThreshold": draw(st.floats(0, 4)),
            "partialRollout": draw(st.booleans()),
        }
    if draw(st.booleans()):
        spec["pools"][0]["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
        spec["pools"][0]["resources"] = {"cpu": draw(st.integers(1, 64)), "memory": "64Gi"}
    if draw(st.booleans()):
        spec["pods"] = {
            "volumes": [
                {"name": "models", "mountPath": "/models", "persistentVolumeClaim": {"claimName": "m"}},
                {"name": "cache", "mountPath": draw(st.sampled_from(["/cache", "/tmp/c"])), "emptyDir": {}},
            ],
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
            "labels": {"team": "ml"},
        }  # fmt: skip
        spec["pools"][-1]["extraResources"] = {"rdma/hca": 1}
    return {
        "apiVersion": "rlhf.dev/v1alpha1",
        "kind": "RLHFJob",
        "metadata": {"name": "job"},
        "spec": spec,
    }


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _paths(value, (*prefix, index))
    return found


@st.composite
def damaged_jobs(draw: st.DrawFn) -> Any:
    """A valid manifest with one to three places replaced, deleted or given a new key."""
    job = draw(valid_jobs())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(job)))
        if not path:
            return draw(json_values)
        parent = job
        for part in path[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["replace", "delete", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(json_values)
        elif action == "delete":
            del parent[path[-1]]
        elif isinstance(parent[path[-1]], dict):
            parent[path[-1]][draw(st.sampled_from(["name", "gpus", "x", "replicas"]))] = draw(
                json_values
            )
    return job


@st.composite
def rule_damaged_jobs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid manifest with well-typed changes that may break cross-field rules only."""
    job = draw(valid_jobs())
    spec = job["spec"]
    names = [p["name"] for p in spec["pools"]]
    pool_names = st.sampled_from([*names, "undeclared"])
    small = st.integers(1, 12)
    edits = {
        "role": lambda: spec["roles"].__setitem__(draw(st.sampled_from(ROLES)), draw(pool_names)),
        "drop-role": lambda: spec["roles"].pop(draw(st.sampled_from(["ref", "reward", "critic"])), None),
        "pool-name": lambda: draw(st.sampled_from(spec["pools"])).__setitem__("name", draw(pool_names)),
        "gpus": lambda: draw(st.sampled_from(spec["pools"])).__setitem__("gpusPerNode", draw(small)),
        "mini": lambda: spec["trainer"].__setitem__("miniBatchSize", draw(small)),
        "batch": lambda: spec["trainer"].__setitem__("batchSize", draw(small)),
        "micro": lambda: spec["trainer"].__setitem__("microBatchSize", draw(small)),
        "tp": lambda: spec["generation"].__setitem__("tensorParallelSize", draw(st.integers(1, 8))),
        "async": lambda: spec.__setitem__("async", {}),
        "kl": lambda: spec["algorithm"].__setitem__("klCoef", draw(st.sampled_from([0, 0.0, 0.1]))),
        "reward": lambda: spec["models"].__setitem__("reward", draw(st.sampled_from(
            [{"path": "/rm"}, {"function": "f"}, {}, {"path": "/rm", "function": "f"},
             {"url": "http://s:1"}, {"url": "http://s:1", "function": "f"},
             {"function": "f", "requests": {}}, {"function": "file:s.py:f"},
             {"function": "file:s.py:f", "configMap": "rw"}, {"function": "file:s.txt:f", "configMap": "rw"},
             {"function": "f", "configMap": "rw"}, {"path": "/rm", "configMap": "rw"}]))),
        "model": lambda: spec["models"].__setitem__("actor", draw(st.sampled_from(
            [{"path": "m", "tiny": {}}, {"tiny": {"hiddenSize": 64, "numHeads": 4}}, {}]))),
        "estimator": lambda: spec["algorithm"].__setitem__("advantageEstimator", draw(st.sampled_from(ESTIMATORS))),
        "samples": lambda: spec["generation"].__setitem__("samplesPerPrompt", draw(st.integers(1, 3))),
        "clip": lambda: spec["algorithm"].__setitem__(draw(st.sampled_from(["clipRatioLow", "clipRatioHigh", "clipRatio"])), draw(st.sampled_from([0.1, 0.2, 0.3]))),
        "dynamic": lambda: spec["algorithm"].__setitem__("dynamicSampling", {}),
        "multi-turn": lambda: spec["generation"].__setitem__("multiTurn", {"environment": draw(st.sampled_from(["tools", "none"])), "maxTokens": draw(st.sampled_from([100, 4096]))}),
        "cut-policy": lambda: spec["generation"].get("multiTurn", {}).__setitem__("cuts", {"maxTurns": draw(st.sampled_from([
            {"policy": "mask", "score": 1.0}, {"policy": "train", "score": -1.0}, {"policy": "mask"}]))}),
        "environments": lambda: spec.__setitem__("environments", [{"name": "tools", "url": "http://t:1"}] * draw(st.integers(0, 2))),
        "operator-run-environment": lambda: spec.__setitem__("environments", [draw(st.sampled_from([
            {"name": "tools"}, {"name": "tools", "serve": "a:B"}, {"name": "tools", "command": ["x"]},
            {"name": "tools", "url": "http://t:1", "serve": "a:B"}, {"name": "tools", "url": "http://t:1", "command": ["x"]},
            {"name": "tools", "url": "http://t:1", "image": "i", "egress": False},
            {"name": "tools-with-a-long-name", "serve": "a:B"}, {"name": "tools-with-a-long-name", "url": "http://t:1"},
            {"name": "tools", "serve": "a:B", "env": [{"name": "A", "value": "1"}] * draw(st.integers(1, 2))}]))]),
        "reward-environment": lambda: spec["models"].__setitem__("reward", {"environment": draw(st.booleans())}),
        "critic-model": lambda: spec["models"].__setitem__("critic", {"path": "/models/critic"}),
        "separation": lambda: (spec.__setitem__("separation", "gpu"),
                               spec["pools"][0].__setitem__("nodeSelector", {"pool": draw(st.sampled_from("ab"))}),
                               spec["pools"][-1].__setitem__("nodeSelector", {"pool": draw(st.sampled_from("ab"))})),
        "volume": lambda: spec.setdefault("pods", {}).__setitem__("volumes", [draw(st.sampled_from([
            {"name": "m", "mountPath": "/m"},
            {"name": "m", "mountPath": "/m", "emptyDir": {}, "configMap": {"name": "c"}},
            {"name": "spec", "mountPath": "/m", "emptyDir": {}},
            {"name": "m", "mountPath": draw(st.sampled_from(["/dev/shm", "/etc/rlhf/x", "/etc/rlhfx"])), "emptyDir": {}},
            {"name": "m", "mountPath": "/m", "emptyDir": {}}]))] * draw(st.integers(1, 2))),
        "env": lambda: spec.setdefault("pods", {}).__setitem__("env", [draw(st.sampled_from([
            {"name": "RLHF_JOB_NAME", "value": "x"}, {"name": "A", "value": "x", "valueFrom": {}},
            {"name": "A", "valueFrom": {}}, {"name": "A"}]))]),
        "labels": lambda: spec.setdefault("pods", {}).__setitem__("labels", {draw(st.sampled_from(
            ["rlhf.dev/job", "app.kubernetes.io/name", "team"])): "x"}),
        "extra": lambda: draw(st.sampled_from(spec["pools"])).__setitem__("extraResources", {draw(st.sampled_from(
            ["cpu", "memory", "nvidia.com/gpu", "rdma/hca"])): 1}),
    }  # fmt: skip
    for name in draw(st.lists(st.sampled_from(sorted(edits)), min_size=1, max_size=3)):
        edits[name]()
    return job
