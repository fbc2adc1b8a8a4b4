"""Where training prompts come from: a built-in toy task, or a dataset on disk read with
pyarrow (Parquet, JSON lines, a JSON array, or a directory saved by HF `datasets`).

A prompt is a string, or a chat conversation: a list of {role, content} messages (the
tokenizer's chat template renders it, see prompts.py). The row's other columns (an
answer, a ground truth) go with it to the reward function, as keyword arguments. Every
problem names the file, and where it can, the row and the column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rlhf_trainer.api.sections import DataConfig

Message = dict[str, str]  # {"role": ..., "content": ...}
PromptInput = str | list[Message]
Source = Literal["train", "eval"]  # which of the spec's data sources

TOY_PROMPTS = 4096  # prompts a toy task generates (an epoch)
FORMATS = ".parquet, .jsonl, .json, or a directory saved by HF datasets (save_to_disk)"


@dataclass(frozen=True)
class PromptRow:
    """A data row. A multi-turn task's row (toy:lookup) has no prompt: its environment
    writes the first message from `fields`, which are then the whole row."""

    prompt: PromptInput  # "" for a multi-turn task's row
    fields: dict[str, Any] = field(default_factory=dict)  # the row's other columns


def source_name(data: DataConfig, source: Source) -> str:
    """How errors name a data source: its field and its value."""
    return f"data.{source}: {data.train if source == 'train' else data.eval}"


def load_prompt_rows(data: DataConfig, seed: int, source: Source = "train") -> list[PromptRow]:
    """The prompts of `data.train` (or of `data.eval`: source "eval"), in file order."""
    location = data.train if source == "train" else data.eval
    assert location is not None, f"data.{source} is unset"
    named = source_name(data, source)
    if location.startswith("toy:"):
        from rlhf_trainer.data.tasks import is_multi_turn_task, toy_prompts, toy_rows

        if is_multi_turn_task(location):
            return [PromptRow("", row) for row in toy_rows(location, TOY_PROMPTS, seed)]
        return [PromptRow(p.text) for p in toy_prompts(location, TOY_PROMPTS, seed)]
    path = Path(location)
    if not path.exists():
        raise ValueError(f"{named} does not exist (expected 'toy:<task>' or {FORMATS})")
    rows = read_rows(path, named)
    if not rows:
        raise ValueError(f"{named}: the dataset has no rows")
    key = data.prompt_key
    return [
        PromptRow(prompt_of(row, key, named, number), {k: v for k, v in row.items() if k != key})
        for number, row in enumerate(rows)
    ]


def read_rows(path: Path, named: str) -> list[dict[str, Any]]:
    """Every row of the dataset at `path`, as a dict of its columns (errors say `named`)."""
    import pyarrow as pa
    import pyarrow.json as pa_json
    import pyarrow.parquet as pq

    try:
        if path.is_dir():
            table = _saved_dataset(path, named)
        elif path.suffix == ".parquet":
            table = pq.read_table(path)
        elif path.suffix == ".jsonl":
            table = pa_json.read_json(path)
        elif path.suffix == ".json":
            table = _json_file(path)
        else:
            raise ValueError(f"{named}: unknown format; expected {FORMATS}")
    except (pa.ArrowException, OSError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{named}: cannot read it as {path.suffix or 'a dataset'}: {error}"
        ) from error
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def _json_file(path: Path) -> Any:
    """A JSON array of objects, or JSON lines under a .json name (as HF exports)."""
    import pyarrow as pa
    import pyarrow.json as pa_json

    text = path.read_text()
    if text.lstrip().startswith("["):
        records = json.loads(text)
        if not all(isinstance(r, dict) for r in records):
            raise ValueError(f"{path}: expected a JSON array of objects")
        return pa.Table.from_pylist(records)
    return pa_json.read_json(path)


def _saved_dataset(path: Path, named: str) -> Any:
    """A `Dataset.save_to_disk` directory (Arrow stream files), or a DatasetDict's, whose
    `train` split is taken."""
    import pyarrow as pa

    if (path / "dataset_dict.json").exists():
        path = path / "train"
    files = sorted(path.glob("*.arrow"))
    if not files:
        raise ValueError(f"{named}: {path} holds no .arrow files; expected {FORMATS}")
    tables = []
    for file in files:
        with pa.memory_map(str(file)) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables)


def prompt_of(row: dict[str, Any], key: str, source: str, number: int) -> PromptInput:
    where = f"{source}: row {number}, column {key!r}"
    if key not in row:
        raise ValueError(f"{source}: no column {key!r} (data.promptKey); it has {sorted(row)}")
    value = row[key]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ValueError(
        f"{where}: expected a string or a list of {{role, content}} messages, "
        f"got {type(value).__name__} {str(value)[:80]!r}"
    )


def _is_message(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("role"), str)
        and isinstance(value.get("content"), str)
    )
