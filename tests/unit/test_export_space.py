"""An export checks that its volume has room before it writes (roles.export_dir): it is
written beside the previous export and renamed in place of it, so at the peak the
volume holds both. Too little room fails naming the path and the bytes needed and free,
and leaves the previous export as it was. One process, a tiny model: ~2 s."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rlhf_trainer.api.sections import TrainedModel
from rlhf_trainer.models import build_tiny_model
from rlhf_trainer.roles import export_dir
from rlhf_trainer.roles.hf_export import ExportError, write_policy
from tests.exports import tree_bytes

TINY = {"vocabSize": 64, "hiddenSize": 64, "numHeads": 2}


@pytest.mark.parametrize(("dtype", "size"), [("fp32", 4), ("bf16", 2)])
def test_an_export_with_no_room_on_its_volume_fails_before_writing_naming_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, size: int
) -> None:
    actor = TrainedModel.model_validate({"tiny": TINY})
    assert actor.tiny is not None
    model = build_tiny_model(actor.tiny, seed=0)
    target = tmp_path / "policy"
    write_policy(model.state_dict(), actor, target, dtype, 1, "test", seed=0)
    previous = tree_bytes(target)
    weights = size * sum(p.numel() for p in model.parameters())  # the tied head once
    needed = weights + export_dir.SPACE_MARGIN
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(export_dir.shutil, "disk_usage",
                        lambda _: usage._replace(free=needed - 1))  # fmt: skip
    with pytest.raises(ExportError) as refused:
        write_policy(model.state_dict(), actor, target, dtype, 2, "test", seed=0)
    assert str(refused.value).startswith(f"{target}: not enough free space for the export")
    assert f"needs about {needed} bytes" in str(refused.value)
    assert f"{needed - 1} bytes" in str(refused.value)
    assert tree_bytes(target) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]

    monkeypatch.setattr(export_dir.shutil, "disk_usage", lambda _: usage._replace(free=needed))
    assert write_policy(model.state_dict(), actor, target, dtype, 2, "test", seed=0).step == 2
