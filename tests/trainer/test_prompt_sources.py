"""Training prompts from datasets on disk: every format reads the same rows, chat
conversations go through the tokenizer's template, overlong prompts follow
data.overlongPrompts, and bad data fails at start naming file, row and column."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_trainer.api.sections import DataConfig
from rlhf_trainer.data.prompts import PromptStream, prompt_tokenizer
from rlhf_trainer.data.sources import Source, load_prompt_rows
from rlhf_trainer.data.tasks import check_reward_arguments, math_answer, toy_copy
from rlhf_trainer.loop.rewards import rule_rewards
from rlhf_trainer.models import build_tokenizer

CHATS = [
    {"question": [{"role": "system", "content": "copy"}, {"role": "user", "content": "c ="}],
     "answer": "c"},
    {"question": [{"role": "user", "content": "a b ="}], "answer": "a b"},
]  # fmt: skip
PLAIN = [{"question": "a b =", "answer": "a b"}, {"question": "c =", "answer": "c"}]
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    """`rows` in the format `path`'s name says; a directory is saved as HF datasets does."""
    table = pa.Table.from_pylist(rows)
    if path.suffix == ".parquet":
        pq.write_table(table, path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:  # Dataset.save_to_disk: Arrow stream files beside its metadata
        path.mkdir()
        arrow = path / "data-00000-of-00001.arrow"
        with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
            out.write_table(table)
        (path / "state.json").write_text(
            '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}'
        )
    return path


@pytest.mark.parametrize("rows", [PLAIN, CHATS], ids=["strings", "conversations"])
@pytest.mark.parametrize("name", ["train.parquet", "train.jsonl", "train.json", "saved"])
def test_every_format_reads_the_same_prompts(
    tmp_path: Path, name: str, rows: list[dict[str, Any]]
) -> None:
    path = write(tmp_path / name, rows)
    data = DataConfig(train=str(path), prompt_key="question")
    loaded = load_prompt_rows(data, seed=0)
    assert [r.prompt for r in loaded] == [row["question"] for row in rows]
    assert [r.fields for r in loaded] == [{"answer": row["answer"]} for row in rows]


def test_a_dataset_dict_directory_gives_its_train_split(tmp_path: Path) -> None:
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train"]}')
    write(tmp_path / "train", PLAIN)
    data = DataConfig(train=str(tmp_path), prompt_key="question")
    assert len(load_prompt_rows(data, seed=0)) == 2


def tokenizer(template: str | None = TEMPLATE) -> Any:
    tok = build_tokenizer(64)
    tok.chat_template = template
    return tok


def test_conversations_go_through_the_chat_template(tmp_path: Path) -> None:
    data = DataConfig(train=str(write(tmp_path / "t.jsonl", CHATS)), prompt_key="question")
    stream = PromptStream.load(data, 0, prompt_tokenizer(tokenizer(), data.chat_template))
    assert stream.prompts[0].text == "system: copy\nuser: c =\nassistant:"
    expected = tokenizer()(stream.prompts[0].text, add_special_tokens=False)["input_ids"]
    assert stream.prompts[0].token_ids == list(expected)
    with pytest.raises(ValueError, match="chatTemplate is off or the tokenizer has no chat"):
        PromptStream.load(data, 0, prompt_tokenizer(tokenizer(None), None))
    off = data.model_copy(update={"chat_template": False})
    with pytest.raises(ValueError, match="chatTemplate is off"):
        PromptStream.load(off, 0, prompt_tokenizer(tokenizer(), off.chat_template))
    plain = DataConfig(train=str(write(tmp_path / "p.jsonl", PLAIN)), prompt_key="question")
    first = PromptStream.load(plain, 0, prompt_tokenizer(tokenizer(), None)).prompts[0]
    assert first.text == "a b =" and first.token_ids == list(tokenizer()("a b =")["input_ids"])


@pytest.mark.parametrize(
    ("policy", "kept"),
    [("drop", [["<s>", "a"]]), ("truncate", [["<s>", "a"], ["b", "c"]])],
)
def test_overlong_prompts_are_dropped_or_truncated(
    tmp_path: Path, policy: str, kept: list[list[str]]
) -> None:
    path = write(tmp_path / "t.parquet", [{"prompt": "a"}, {"prompt": "a b c"}])
    data = DataConfig(train=str(path), max_prompt_length=2, overlong_prompts=policy)  # type: ignore[arg-type]
    tok = tokenizer()
    stream = PromptStream.load(data, 0, prompt_tokenizer(tok, None))
    assert [tok.convert_ids_to_tokens(p.token_ids) for p in stream.prompts] == kept
    assert stream.dropped == (1 if policy == "drop" else 0)


def test_overlong_prompts_fail_the_job_at_start_when_asked(tmp_path: Path) -> None:
    path = write(tmp_path / "t.parquet", [{"prompt": "a"}, {"prompt": "a b c"}])
    data = DataConfig(train=str(path), max_prompt_length=2, overlong_prompts="error")
    with pytest.raises(
        ValueError, match=r"t.parquet: row 1 has 4 prompt tokens, over maxPromptLength 2"
    ):
        PromptStream.load(data, 0, prompt_tokenizer(tokenizer(), None))
    data = data.model_copy(update={"overlong_prompts": "drop", "max_prompt_length": 1})
    with pytest.raises(ValueError, match="every prompt is over maxPromptLength 1"):
        PromptStream.load(data, 0, prompt_tokenizer(tokenizer(), None))


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("t.jsonl", '{"prompt": "a"}\n', r"t.jsonl: no column 'question' \(data.promptKey\); it has \['prompt'\]"),
        ("t.jsonl", '{"question": 3}\n', "row 0, column 'question': expected a string or a list of {role, content} messages, got int"),
        ("t.jsonl", '{"question": "a"}\n{"question": 3}\n', r"t.jsonl: cannot read it as .jsonl: .*Column\(/question\) changed from string to number in row 1"),
        ("t.json", '[{"question": [{"role": "user"}]}]', "row 0, column 'question': expected a string or a list of {role, content}"),
        ("t.json", "[]", "t.json: the dataset has no rows"),
        ("t.parquet", "not parquet", "t.parquet: cannot read it as .parquet"),
        ("t.jsonl", "{not json", "t.jsonl: cannot read it as .jsonl"),
        ("t.csv", "question\na\n", r"t.csv: unknown format; expected .parquet, .jsonl, .json"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("source", ["train", "eval"])
def test_bad_data_fails_naming_the_source_file_row_and_column(
    tmp_path: Path, name: str, content: str, message: str, source: Source
) -> None:
    path = str(tmp_path / name)
    (tmp_path / name).write_text(content)
    data = DataConfig(
        train=path if source == "train" else "toy:copy", eval=path, prompt_key="question"
    )
    with pytest.raises(ValueError, match=f"^data.{source}: {tmp_path}/.*{message}"):
        load_prompt_rows(data, seed=0, source=source)


def test_toy_tasks_and_missing_paths() -> None:
    rows = load_prompt_rows(DataConfig(train="toy:copy"), seed=0)
    assert str(rows[0].prompt).endswith(" =") and rows[0].fields == {} and len(rows) == 4096
    with pytest.raises(ValueError, match=r"data.train: /nowhere/p.parquet does not exist"):
        load_prompt_rows(DataConfig(train="/nowhere/p.parquet"), seed=0)
    data = DataConfig(train="toy:copy", eval="/nowhere/e.jsonl")
    with pytest.raises(ValueError, match=r"data.eval: /nowhere/e.jsonl does not exist"):
        load_prompt_rows(data, seed=0, source="eval")


def test_the_toy_task_holds_out_prompts_it_never_trains_on() -> None:
    data = DataConfig(train="toy:copy", eval="toy:copy:heldout")
    train = {row.prompt for row in load_prompt_rows(data, seed=0)}
    held_out = [row.prompt for row in load_prompt_rows(data, seed=0, source="eval")]
    assert len(held_out) == len(set(held_out)) == 64  # 1 in 8 of the 512 letter strings
    assert len(train) == 512 - 64  # 4096 draws see every other string
    assert not train & set(held_out)


def test_the_rows_other_columns_reach_the_reward_function(tmp_path: Path) -> None:
    rows = [{"prompt": "2 + 3 =", "answer": "5"}, {"prompt": "7 - 9 =", "answer": "-2"}]
    data = DataConfig(train=str(write(tmp_path / "math.parquet", rows)))
    prompts = PromptStream.load(data, 0, prompt_tokenizer(tokenizer(), None)).prompts
    assert [p.fields for p in prompts] == [{"answer": "5"}, {"answer": "-2"}]
    responses = ["2 + 3 = 5</s>", "so 1,000 or -2"]
    assert rule_rewards(math_answer, prompts, responses) == [1.0, 1.0]
    assert rule_rewards(math_answer, prompts, ["6", "2"]) == [0.0, 0.0]
    check_reward_arguments(math_answer, ["answer"], "data.train")


def test_a_reward_function_that_cannot_take_the_columns_fails_at_start() -> None:
    with pytest.raises(
        ValueError, match=r"toy_copy does not take the columns \['answer'\] of data.eval"
    ):
        check_reward_arguments(toy_copy, ["answer"], "data.eval")
    check_reward_arguments(toy_copy, [], "data.train")
