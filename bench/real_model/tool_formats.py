"""Three ways to ask SmolLM2-135M-Instruct for a tool call, as ChatML chat templates,
and a probe of which one the model actually writes (`python -m
bench.real_model.tool_formats`).

Each format is a system prompt that lists the tools and says how to call them, the way
calls are written back, and the vLLM tool parser that reads them:

    hermes      <tool_call>{"name": ..., "arguments": {...}}</tool_call>    (hermes)
    json_list   <tool_call>[{"name": ..., "arguments": {...}}]</tool_call>  (xlam)
                SmolLM2's own: the prompt of HF's smol-tools, whose function-calling
                SFT data (argilla/Synth-APIGen) is in this form
    pythonic    [calculate(expression="3 + 9")]                          (pythonic)

Everything else is the same ChatML: SmolLM2's default system message first, tool
results as a user turn of <tool_response></tool_response> blocks (Qwen2.5's way), and a
message renders the same whatever follows it (ChatRenderer appends tool results as
tokens, after the sampled ids).

The probe renders `prompts` Calculator questions in every format, without and with a
demonstration (one worked exchange before the question, chat_template_kwargs
{demonstration: true}), samples one turn of each at temperature 1 (vLLM, one engine,
fp32), parses it with the format's parser and reports the share of turns with a parsed
call, with a valid call (the `calculate` tool, an `expression` argument that evaluates)
and with a right one (it evaluates to the sum). Arguments, optional: prompts (32), seed.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SHARES = ("parsed", "valid", "right")
MAX_TOKENS = 48  # a call is shorter
TOOLS_JSON = "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"


@dataclass(frozen=True)
class ToolFormat:
    parser: str  # vLLM's tool parser that reads the model's calls
    instructions: str  # Jinja: the system prompt's tool part ({{ tools }} listed)
    call: str  # Jinja: one `call` (name, arguments) of an assistant message, as written
    example: str  # the demonstration's call, calculate(expression="4 + 6"), as written


HERMES = ToolFormat(
    parser="hermes",
    instructions=(
        "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
        "query.\\n\\nYou are provided with function signatures within <tools></tools> XML "
        "tags:\\n<tools>' }}" + TOOLS_JSON + "{{- '\\n</tools>\\n\\nFor each function call, "
        "return a json object with function name and arguments within <tool_call></tool_call>"
        ' XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\\n</tool_call>' }}"
    ),
    call="{{- '\\n<tool_call>\\n' + call_json + '\\n</tool_call>' }}",
    example=(
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "4 + 6"}}\n</tool_call>'
    ),
)
# HF smol-tools' prompt (huggingface/smollm, tools/smol_tools), tools on one line.
JSON_LIST = ToolFormat(
    parser="xlam",
    instructions=(
        "{{- '\\n\\nYou are an expert in composing functions. You are given a question and a "
        "set of possible functions. \\nBased on the question, you will need to make one or more"
        " function/tool calls to achieve the purpose. \\nIf none of the functions can be used, "
        "point it out and refuse to answer. \\nIf the given question lacks the parameters "
        "required by the function, also point it out.\\n\\nYou have access to the following "
        "tools:\\n<tools>' + (tools | tojson) + '</tools>\\n\\nThe output MUST strictly adhere"
        " to the following format, and NO other text MUST be included.\\nThe example format "
        "is as follows. Please make sure the parameter type is correct. If no function call "
        "is needed, please make the tool calls an empty list \\'[]\\'.\\n<tool_call>[\\n"
        '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},'
        "\\n... (more tool calls as required)\\n]</tool_call>' }}"
    ),
    call="{{- '\\n<tool_call>[' + call_json + ']</tool_call>' }}",
    example='<tool_call>[{"name": "calculate", "arguments": {"expression": "4 + 6"}}]</tool_call>',
)
# Llama 3.2's pythonic prompt, which vLLM's `pythonic` parser reads.
PYTHONIC = ToolFormat(
    parser="pythonic",
    instructions=(
        "{{- '\\n\\nYou are an expert in composing functions. You are given a question and a "
        "set of possible functions. Based on the question, you will need to make one or more "
        "function/tool calls to achieve the purpose.\\nIf you decide to invoke any of the "
        "function(s), you MUST put it in the format of [func_name1(params_name1=params_value1,"
        " params_name2=params_value2...), func_name2(params)]\\nYou SHOULD NOT include any "
        "other text in the response.\\n\\nHere is a list of functions in JSON format that you "
        "can invoke.\\n[' }}" + TOOLS_JSON + "{{- '\\n]' }}"
    ),
    call=(
        "{{- '\\n[' + call.name + '(' }}{%- for key, value in call.arguments.items() %}"
        "{{ ', ' if not loop.first }}{{ key + '=' + (value | tojson) }}{%- endfor %}{{ ')]' }}"
    ),
    example='[calculate(expression="4 + 6")]',
)
FORMATS = {"hermes": HERMES, "json_list": JSON_LIST, "pythonic": PYTHONIC}

TEMPLATE = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}
{%- else %}{% set system = 'DEFAULT_SYSTEM' %}{% endif %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}INSTRUCTIONS{% endif %}
{{- '<|im_end|>\\n' }}
{%- if tools and demonstration is defined and demonstration %}DEMONSTRATION{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for call in message.tool_calls %}
{%- if call.function is defined %}{% set call = call.function %}{% endif %}
{%- set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}
{%- set call_json = '{"name": "' + call.name + '", "arguments": ' + arguments + '}' %}CALL
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""


# One worked exchange before the conversation, with chat_template_kwargs
# {demonstration: true} (and tools): a question, the call, its result, the answer.
DEMONSTRATION_TURNS = (
    "<|im_start|>user\nWhat is 4 + 6? Use the calculate tool, then reply with the number "
    "alone.<|im_end|>\n<|im_start|>assistant\nEXAMPLE<|im_end|>\n<|im_start|>user\n"
    "<tool_response>\n10\n</tool_response><|im_end|>\n<|im_start|>assistant\n10<|im_end|>\n"
)


def chat_template(name: str) -> str:
    """The ChatML template of format `name` (a key of FORMATS)."""
    form = FORMATS[name]
    demonstration = json.dumps(DEMONSTRATION_TURNS.replace("EXAMPLE", form.example))
    return (
        TEMPLATE.replace("DEMONSTRATION", "{{- " + demonstration + " }}")
        .replace("DEFAULT_SYSTEM", DEFAULT_SYSTEM)
        .replace("INSTRUCTIONS", form.instructions)
        .replace("CALL", form.call)
    )


def judge(parser: Any, request: Any, text: str, expected: int) -> tuple[bool, bool, bool]:
    """(parsed, valid, right) for one sampled turn (see the module doc)."""
    from rlhf_env.toys import calculate

    extracted = parser.extract_tool_calls(text, request)
    calls = extracted.tool_calls if extracted.tools_called else []
    values = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments)
            if call.function.name == "calculate" and isinstance(arguments, dict):
                values.append(calculate(str(arguments["expression"])))
        except (ValueError, KeyError, TypeError):
            pass
    return bool(calls), bool(values), expected in values


def probe(prompts: int, seed: int) -> dict[str, Any]:
    """Every format's shares of parsed, valid and right calls (see the module doc)."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    from rlhf_env.toys import Calculator
    from rlhf_trainer.rollout.engine_settings import platform_in_environment
    from tests.real_model import addends, real_model_dir

    platform_in_environment(1)
    model = str(real_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        seed=seed,
        enable_chunked_prefill=False,
        max_num_batched_tokens=2048,
    )
    episodes = []
    for a, b in addends(prompts, first=100):
        start = Calculator().reset({"numbers": [a, b]})
        messages = [m.model_dump(exclude_none=True) for m in start.messages]
        tools = [t.model_dump(exclude_none=True) for t in start.tools]
        episodes.append((messages, tools, a + b))
    report: dict[str, Any] = {}
    for (name, form), demonstration in itertools.product(FORMATS.items(), (False, True)):
        texts = [
            tokenizer.apply_chat_template(
                m, tools=t, chat_template=chat_template(name), add_generation_prompt=True,
                tokenize=False, demonstration=demonstration,
            )
            for m, t, _ in episodes
        ]  # fmt: skip
        params = [
            SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed * 1000 + i)
            for i in range(prompts)
        ]
        outputs = llm.generate(texts, params, use_tqdm=False)
        request = ChatCompletionRequest.model_validate({"messages": [], "tools": episodes[0][1]})
        parser = ToolParserManager.get_tool_parser(form.parser)(tokenizer, request.tools)
        judged = [
            judge(parser, request, o.outputs[0].text, expected)
            for o, (_, _, expected) in zip(outputs, episodes, strict=True)
        ]
        key = f"{name}{'+demonstration' if demonstration else ''}"
        report[key] = {
            "parser": form.parser,
            **{k: round(sum(j[i] for j in judged) / prompts, 3) for i, k in enumerate(SHARES)},
            "example": outputs[0].outputs[0].text[:120],
        }
        print(f"{key}: {report[key]}", file=sys.stderr, flush=True)
    return report


def main() -> None:
    prompts = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    started = time.time()
    formats = probe(prompts, seed)
    record = {
        "bench": "real_model_tool_formats",
        "prompts": prompts,
        "seed": seed,
        "temperature": 1.0,
        "wall_s": round(time.time() - started, 1),
        "formats": formats,
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
