"""Atomic checkpoint directories, the driver's state, and DCP role state on gloo ranks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import Tensor

from rlhf_trainer.roles.checkpoint import (
    TrainerState,
    capture_rng,
    commit,
    latest,
    load_role_state,
    load_trainer_state,
    prune,
    restore_rng,
    save_json,
    save_role_state,
    save_trainer_state,
    staging_dir,
    staging_path,
    step_of,
)
from rlhf_trainer.roles.sharding import full_state_dict, shard_model
from tests.trainer.distributed import run_ranks
from tests.trainer.tiny_training import (
    assert_state_dicts_close,
    build,
    optimizer,
    rank_batch,
    train_step,
)

# Directories


def write_checkpoint(root: Path, step: int) -> Path:
    staging = staging_dir(root, step)
    (staging / "payload").write_text(str(step))
    return commit(root, step)


def test_a_committed_checkpoint_appears_whole_under_its_step(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert latest(root) is None
    path = write_checkpoint(root, 10)
    assert path == root / "step-00000010" == latest(root)
    assert step_of(path) == 10
    assert (path / "payload").read_text() == "10"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000010"]  # no staging left


def test_a_crash_before_commit_leaves_latest_on_the_previous_step(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    staging = staging_dir(tmp_path, 20)
    (staging / "payload").write_text("half written")  # ... and the process dies here
    assert latest(tmp_path) == tmp_path / "step-00000010"
    # The restarted run stages step 20 again, from scratch.
    assert list(staging_dir(tmp_path, 20).iterdir()) == []


def test_commit_refuses_to_replace_a_committed_step_or_to_commit_nothing(
    tmp_path: Path,
) -> None:
    write_checkpoint(tmp_path, 10)
    staging_dir(tmp_path, 10)  # an empty one: a plain rename would replace the checkpoint
    with pytest.raises(FileExistsError):
        commit(tmp_path, 10)
    assert (tmp_path / "step-00000010" / "payload").read_text() == "10"
    with pytest.raises(FileNotFoundError):
        commit(tmp_path, 30)


def test_prune_keeps_the_newest_and_removes_staging_but_not_other_names(
    tmp_path: Path,
) -> None:
    for step in (30, 10, 20, 100_000_000):  # beyond 8 digits still sorts by step
        write_checkpoint(tmp_path, step)
    staging_dir(tmp_path, 40)
    (tmp_path / ".del-step-00000005").mkdir()  # a crash during an earlier prune
    junk = ["notes.txt", "step-abc", "step-5", "step-00000050", ".tmp-other"]
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-5").mkdir()
    for name in ("notes.txt", "step-00000050", ".tmp-other"):  # files, not directories
        (tmp_path / name).write_text("")
    assert latest(tmp_path) == tmp_path / "step-100000000"

    removed = prune(tmp_path, keep=2)

    assert [step_of(p) for p in removed] == [10, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["step-00000030", "step-100000000", *junk]
    )
    assert prune(tmp_path, keep=2) == []
    with pytest.raises(ValueError, match="at least 1"):
        prune(tmp_path, keep=0)


def test_step_of_reads_only_committed_names() -> None:
    assert step_of(Path("/ckpt/step-00000042")) == 42
    for name in (".tmp-step-00000042", "step-42", "step-0000004x"):
        with pytest.raises(ValueError, match="not a committed checkpoint"):
            step_of(Path(name))


# Driver state


def test_save_json_replaces_the_file_whole_or_not_at_all(tmp_path: Path) -> None:
    save_json(tmp_path, "state.json", {"step": 1})
    with pytest.raises(TypeError):
        save_json(tmp_path, "state.json", {"step": object()})  # fails mid-write
    assert json.loads((tmp_path / "state.json").read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temp file left


def test_trainer_state_round_trips_and_restores_the_next_random_numbers(
    tmp_path: Path,
) -> None:
    random.seed(5)
    torch.manual_seed(5)
    random.gauss(0, 1)  # leaves a cached second normal in Python's state
    state = TrainerState(
        step=7, policy_version=6, data_epoch=1, data_position=32, rng=capture_rng(), kl_coef=0.03
    )
    expected = (random.random(), random.gauss(0, 1), torch.rand(3))

    save_trainer_state(tmp_path, state)
    random.seed(99)
    torch.manual_seed(99)
    loaded = load_trainer_state(tmp_path)
    assert loaded == state
    restore_rng(loaded.rng)

    assert random.random() == expected[0]
    assert random.gauss(0, 1) == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


# Role state (DCP) on real ranks

STEPS_BEFORE_SAVE = 2


def train_and_save(rank: int, root: Path) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """2 ranks: a few steps, a checkpoint, then one more step uninterrupted. Returns the
    full weights at the checkpoint and after the next step."""
    model = shard_model(build("actor"))
    opt = optimizer(model)
    for step in range(STEPS_BEFORE_SAVE):
        train_step("actor", model, opt, rank_batch(step, rank, 2))
    at_save = full_state_dict(model)
    if rank == 0:  # the driver's part, done before and after the role's collective
        staging_dir(root, STEPS_BEFORE_SAVE)
    torch.distributed.barrier()
    save_role_state(staging_path(root, STEPS_BEFORE_SAVE) / "actor", model, opt)
    if rank == 0:
        commit(root, STEPS_BEFORE_SAVE)
    train_step("actor", model, opt, rank_batch(STEPS_BEFORE_SAVE, rank, 2))
    return at_save, full_state_dict(model)


def resume_and_step(
    rank: int, world_size: int, root: Path
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Other initial weights and a fresh optimizer, then the checkpoint: returns the
    full weights loaded and after the next step."""
    model = shard_model(build("actor", seed=1))
    opt = optimizer(model)
    checkpoint = latest(root)
    assert checkpoint is not None
    load_role_state(checkpoint / "actor", model, opt)
    loaded = full_state_dict(model)
    train_step("actor", model, opt, rank_batch(STEPS_BEFORE_SAVE, rank, world_size))
    return loaded, full_state_dict(model)


@pytest.fixture(scope="module")
def saved_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, dict[str, Tensor], dict[str, Tensor]]:
    root = tmp_path_factory.mktemp("checkpoints")
    (at_save, uninterrupted), _ = run_ranks(train_and_save, 2, root)
    return root, at_save, uninterrupted


def test_two_ranks_resume_exactly_where_the_run_left_off(
    saved_run: tuple[Path, dict[str, Tensor], dict[str, Tensor]],
) -> None:
    root, at_save, uninterrupted = saved_run
    assert latest(root) == root / f"step-{STEPS_BEFORE_SAVE:08d}"
    (loaded, resumed), (nothing, _) = run_ranks(resume_and_step, 2, 2, root)
    assert nothing == {}
    fresh = build("actor", seed=1).state_dict()
    assert not torch.equal(fresh["model.norm.weight"], at_save["model.norm.weight"])
    assert_state_dicts_close(loaded, at_save, atol=0)
    # The same step from the same weights and Adam moments: bit for bit. A fresh
    # optimizer (no moments, step 1 bias correction) would step elsewhere.
    assert_state_dicts_close(resumed, uninterrupted, atol=0)


def test_one_rank_loads_the_two_rank_checkpoint(
    saved_run: tuple[Path, dict[str, Tensor], dict[str, Tensor]],
) -> None:
    root, at_save, uninterrupted = saved_run
    ((loaded, resumed),) = run_ranks(resume_and_step, 1, 1, root)
    assert_state_dicts_close(loaded, at_save, atol=0)
    # One rank on the whole batch sums in another order: float32 noise (test_sharding).
    assert_state_dicts_close(resumed, uninterrupted, atol=1e-4)
