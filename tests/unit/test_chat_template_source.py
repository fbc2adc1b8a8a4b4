"""generation.multiTurn.chatTemplateFrom (issue 72): a chat template kept in a ConfigMap.
The operator mounts its key read-only in every Ray pod, as one file; the trainer reads
it from there; at most one of it and the inline chatTemplate; a local run, which has no
ConfigMap, refuses it saying so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from rlhf_operator.api.validation import parse_job
from rlhf_operator.render.children import JobRef, render_rayjob
from rlhf_trainer.api.agentic import MultiTurnConfig
from rlhf_trainer.rollout.chat_template import job_template
from tests.unit.celcheck import assert_refused
from tests.unit.test_render import RAYJOB_SCHEMA

EXAMPLE = Path(__file__).parents[2] / "examples" / "agentic-tools.yaml"
FIELD = "spec.generation.multiTurn"
REF = {"configMapKeyRef": {"name": "qwen3-templates", "key": "tools.jinja"}}
TEMPLATE = "{% for m in messages %}{{ m.content }}{{ eos_token }} {% endfor %}"
VOLUME = {
    "name": "chat-template",
    "configMap": {
        "name": "qwen3-templates",
        "items": [{"key": "tools.jinja", "path": "chat_template.jinja"}],
        "defaultMode": 0o444,
    },
}
MOUNT = {"name": "chat-template", "mountPath": "/etc/rlhf-chat-template", "readOnly": True}


def job(**multi_turn: Any) -> dict[str, Any]:
    """The agentic example, its environment at a url (as a cluster runs it)."""
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["environments"] = [{"name": "lookup", "url": "http://127.0.0.1:9"}]
    manifest["spec"]["generation"]["multiTurn"].update(multi_turn)
    return manifest


def ray_pods(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    parsed = parse_job(manifest)
    rayjob = render_rayjob(JobRef(parsed.metadata.name, "ns", "uid"), parsed.spec)
    jsonschema.Draft4Validator(RAYJOB_SCHEMA).validate(rayjob)
    cluster = rayjob["spec"]["rayClusterSpec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [group["template"]["spec"] for group in groups]


def test_the_configmap_key_is_mounted_read_only_on_every_ray_pod_as_one_file() -> None:
    pods = ray_pods(job(chatTemplateFrom=REF))
    assert len(pods) == 2  # the head (the driver checks it) and the rollout's pool
    for pod in pods:
        assert VOLUME in pod["volumes"]
        assert MOUNT in pod["containers"][0]["volumeMounts"]
    for pod in ray_pods(job(chatTemplate=TEMPLATE)) + ray_pods(job()):
        assert "chat-template" not in str(pod)


@pytest.mark.parametrize(
    ("fields", "path", "words", "cel_too"),
    [
        ({"chatTemplate": TEMPLATE, "chatTemplateFrom": REF}, "chatTemplateFrom",
         "set at most one of chatTemplate or chatTemplateFrom", True),
        ({"chatTemplateFrom": {"configMapKeyRef": {"name": "t", "key": "a/b"}}},
         "chatTemplateFrom.configMapKeyRef.key", "should match pattern", False),
        ({"chatTemplateFrom": {"configMapKeyRef": {"name": "T"}}},
         "chatTemplateFrom.configMapKeyRef.key", "required field is missing", False),
        ({"chatTemplateFrom": {}}, "chatTemplateFrom.configMapKeyRef", "required field is missing", False),
    ],
)  # fmt: skip
def test_a_bad_chat_template_source_is_refused_naming_the_field(
    fields: dict[str, Any], path: str, words: str, cel_too: bool
) -> None:
    assert_refused(job(**fields), f"{FIELD}.{path}", words, cel_too)


def test_a_user_volume_cannot_take_the_templates_name_or_place() -> None:
    volume = {"name": "chat-template", "mountPath": "/x", "emptyDir": {}}
    manifest = job()
    manifest["spec"]["pods"] = {"volumes": [volume]}
    assert_refused(manifest, "spec.pods.volumes[0].name", "the operator's own", True)
    manifest["spec"]["pods"]["volumes"] = [
        {"name": "t", "mountPath": "/etc/rlhf-chat-template", "emptyDir": {}}
    ]
    assert_refused(manifest, "spec.pods.volumes[0].mountPath", "/etc/rlhf-chat-template", True)


def multi_turn(**fields: Any) -> MultiTurnConfig:
    config = parse_job(job(**fields)).spec.job_config()
    assert config.multi_turn is not None
    return config.multi_turn


def test_the_trainer_reads_the_template_from_the_mount_and_renders_with_it(
    tmp_path: Path,
) -> None:
    from rlhf_trainer.models import chat_tokenizer
    from rlhf_trainer.rollout.chat_template import ChatRenderer

    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    template = job_template(multi_turn(chatTemplateFrom=REF), mount=tmp_path)
    assert template == TEMPLATE
    assert job_template(multi_turn(chatTemplate=TEMPLATE)) == TEMPLATE  # inline: as given
    assert job_template(multi_turn()) is None  # neither: the tokenizer's own

    config = parse_job(job()).spec.job_config()
    renderer = ChatRenderer(chat_tokenizer(config.models.actor), "tiny", template=template)
    assert renderer.end_of_turn == "</s>"  # read from the mounted template
    assert renderer.observation_text([]) == " "  # its glue after </s>


def test_without_the_mount_it_fails_saying_a_local_run_takes_the_template_inline(
    tmp_path: Path,
) -> None:
    """A local run has no ConfigMap: it refuses the job before it serves anything or
    starts Ray, saying what to do instead; a driver without the mount fails at load."""
    from rlhf_trainer.cluster.local import local_environments
    from rlhf_trainer.loop.setup import load_inputs

    config = parse_job(job(chatTemplateFrom=REF)).spec.job_config()
    with pytest.raises(ValueError) as refused, local_environments(config):
        pass
    assert str(refused.value) == (
        "generation.multiTurn.chatTemplateFrom: a local run has no ConfigMap to read key "
        "'tools.jinja' of 'qwen3-templates' from: give the template inline, as "
        "multiTurn.chatTemplate"
    )
    with pytest.raises(ValueError, match="local run has no ConfigMap") as failed:
        load_inputs(config, None)
    assert str(failed.value) == (
        "generation.multiTurn.chatTemplateFrom: key 'tools.jinja' of ConfigMap "
        "'qwen3-templates': no file /etc/rlhf-chat-template/chat_template.jinja, where the "
        "operator mounts it in the Ray pods (a local run has no ConfigMap: give the template "
        "inline, as multiTurn.chatTemplate)"
    )
    (tmp_path / "chat_template.jinja").write_text("\n")
    with pytest.raises(ValueError, match=r"chat_template\.jinja is empty; expected a Jinja"):
        job_template(multi_turn(chatTemplateFrom=REF), mount=tmp_path)
