"""bench/real_model/calculator.py's tool-aware chat template for SmolLM2: the tools in
the prompt, its calls read by vLLM's "hermes" parser, tool results appended as tokens
by ChatRenderer (which refuses templates that rewrite earlier turns)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.real_model.calculator import tool_model
from rlhf_env.toys import Calculator
from rlhf_trainer.rollout.trajectory import ChatRenderer, ToolCallParser, template_message
from tests.conftest import needs
from tests.real_model import real_model_dir

pytestmark = needs(
    None
    if (real_model_dir() / "tokenizer.json").exists()
    else f"no SmolLM2 tokenizer at {real_model_dir()} (make real-model)"
)

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "3 + 9"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model(tmp_path_factory.mktemp("model")))


def test_the_copy_leaves_the_cached_model_alone(tmp_path: Path) -> None:
    model = tool_model(tmp_path)
    assert (model / "model.safetensors").resolve() == real_model_dir() / "model.safetensors"
    assert "tools" not in (real_model_dir() / "chat_template.jinja").read_text()
    assert "<tool_call>" in (model / "chat_template.jinja").read_text()


def test_a_calculator_episode_renders_through_the_template(tokenizer: Any) -> None:
    renderer = ChatRenderer(tokenizer, "SmolLM2 with tools")  # raises if not incremental
    calculator = Calculator()
    start = calculator.reset({"numbers": [3, 9]})
    prompt = tokenizer.decode(renderer.prompt_ids(start.messages, start.tools))
    assert '<tools>\n{"type": "function", "function": {"name": "calculate"' in prompt
    assert prompt.endswith("reply with the number alone.<|im_end|>\n<|im_start|>assistant\n")

    call = ToolCallParser("hermes", tokenizer, start.tools).parse(CALL, turn=0)
    assert [c.function.name for c in call.tool_calls] == ["calculate"]
    result = calculator.step(call).messages
    assert renderer.observation_text(result) == (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # The template writes a call as the parser reads it.
    whole = tokenizer.apply_chat_template(
        [template_message(m) for m in [*start.messages, call]], tokenize=False
    )
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>\n" in whole
