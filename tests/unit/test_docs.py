"""The docs (README.md and the site under docs/) stay true to the repository: the site
builds with `mkdocs build --strict`, and every file path, `make` target and RLHFJob field
they name exists, and every manifest they show validates. A failure names the page.

What counts as a name, so that a page can be checked without guessing:
- a relative link (`[text](path#anchor)`) must point at a file, from the page's folder
  (the site's build checks the anchors of its own pages);
- a path is a code span with a `/` whose first part is a folder or file of the
  repository, of `trainer_image/`, or of either package (`rollout/engine.py` is
  `trainer_image/rlhf_trainer/rollout/engine.py`); `*` globs; one that git ignores is an
  output (`bench/results.jsonl`), not checked;
- a make target is `make NAME` in a code span or a shell block;
- a field is a code span that starts with `spec.`, `status.` or a field of `spec`
  (`trainer.checkpoint.path` is `spec.trainer.checkpoint.path`), up to the first
  character that cannot be in a path; `[]` after a list is optional.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf_operator.api.reference import openapi_schema
from rlhf_operator.api.validation import InvalidJob, load_documents, parse_job
from tests.controlplane.test_walkthrough import WALKTHROUGH_PAGE, walkthrough

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PATH_ROOTS = [ROOT, ROOT / "trainer_image", ROOT / "trainer_image" / "rlhf_trainer"]
PATH_ROOTS += [ROOT / "operator", ROOT / "operator" / "rlhf_operator"]
MAKEFILES = [ROOT / "Makefile", *ROOT.glob("tests/*/*.mk")]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")  # one may wrap onto a second line
MAKE = re.compile(r"\bmake\s+([a-z][a-z0-9-]*)")
FIELD = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:\[\])?(?:\.[A-Za-z][A-Za-z0-9]*(?:\[\])?)+")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FILE_SUFFIX = re.compile(r"\.(py|ya?ml|json|jsonl|md|txt|toml|png|parquet|in)$")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(text: str) -> Iterator[tuple[str, str]]:
    """The fenced code blocks: (language, body)."""
    for match in FENCE.finditer(text):
        yield match.group(1), match.group(2)


def code_spans(text: str) -> list[str]:
    """The inline code spans, outside fenced blocks, each on one line."""
    prose = FENCE.sub("", text)
    return [" ".join(span.split()) for span in CODE_SPAN.findall(prose)]


def named_paths(text: str) -> set[str]:
    found = set()
    for span in code_spans(text):
        if " " in span or "/" not in span or span.startswith(("/", "http", ".")):
            continue
        first = span.split("/", 1)[0]
        if any((root / first).exists() for root in PATH_ROOTS):
            found.add(span)
    return found


def broken_links(page: Path) -> list[str]:
    """Relative link targets (images too) that are no file, from the page's folder."""
    targets = LINK.findall(CODE_SPAN.sub("", FENCE.sub("", page.read_text())))
    relative = [t for t in targets if not re.match(r"[a-z]+:|#", t)]
    return [t for t in relative if not (page.parent / t.split("#")[0]).exists()]


def exists(path: str) -> bool:
    return any(list(root.glob(path.rstrip("/"))) for root in PATH_ROOTS)


def git_ignored(path: str) -> bool:
    """An output the repository ignores (runs/, bench/results.jsonl): named, never committed."""
    found = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT, check=False)
    return found.returncode == 0


def make_targets() -> set[str]:
    target = re.compile(r"^([a-z][a-z0-9-]*)\s*:(?!=)", re.MULTILINE)
    return {name for makefile in MAKEFILES for name in target.findall(makefile.read_text())}


def named_targets(text: str) -> set[str]:
    shell = [body for language, body in blocks(text) if language in ("sh", "bash", "")]
    return {name for chunk in [*code_spans(text), *shell] for name in MAKE.findall(chunk)}


def named_fields(text: str, spec_fields: set[str]) -> set[str]:
    found = set()
    for span in code_spans(text):
        match = FIELD.match(span)
        if not match or FILE_SUFFIX.search(match.group()):
            continue
        field = match.group()
        first = field.split(".")[0].removesuffix("[]")
        if first in ("spec", "status"):
            found.add(field)
        elif first in spec_fields:
            found.add("spec." + field)
    return found


def field_exists(field: str, root: dict[str, Any]) -> bool:
    node = root
    for part in field.split("."):
        while node.get("type") == "array" and "properties" not in node:
            node = node.get("items", {})
        name = part.removesuffix("[]")
        if name not in node.get("properties", {}):
            return False
        node = node["properties"][name]
    return True


def manifests(text: str) -> Iterator[str]:
    for language, body in blocks(text):
        if language == "yaml" and re.search(r"^kind:\s*RLHFJob\s*$", body, re.MULTILINE):
            yield body


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return openapi_schema()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_paths_exist(page: Path) -> None:
    named = named_paths(page.read_text())
    missing = sorted(p for p in named if not exists(p) and not git_ignored(p))
    assert not missing, f"{page_id(page)} names paths the repository lacks: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_point_at_files(page: Path) -> None:
    broken = broken_links(page)
    assert not broken, f"{page_id(page)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_make_targets_exist(page: Path) -> None:
    missing = sorted(named_targets(page.read_text()) - make_targets())
    assert not missing, f"{page_id(page)} names make targets the Makefile lacks: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_fields_are_in_the_crd(page: Path, schema: dict[str, Any]) -> None:
    spec_fields = set(schema["properties"]["spec"]["properties"])
    named = named_fields(page.read_text(), spec_fields)
    missing = sorted(f for f in named if not field_exists(f, schema))
    assert not missing, f"{page_id(page)} names fields the CRD does not have: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_shown_manifests_validate(page: Path) -> None:
    text = page.read_text()
    shown = [yaml.safe_load(body) for body in manifests(text)]
    linked = {f for p in named_paths(text) if p.startswith("examples/") for f in ROOT.glob(p)}
    for file in sorted(f for f in linked if f.suffix == ".yaml"):
        shown += load_documents(file.read_text())
    for doc in shown:
        try:
            parse_job(doc)
        except InvalidJob as invalid:
            pytest.fail(f"{page_id(page)}: {doc['metadata']['name']}: {invalid.errors}")


def test_the_checks_find_what_they_look_for(schema: dict[str, Any], tmp_path: Path) -> None:
    """Bad input: a page naming a field the CRD lacks, a missing file or target, fails."""
    spec_fields = set(schema["properties"]["spec"]["properties"])
    page = "Set `trainer.checkpoint.gone` and `spec.pools[].replicas`; see `examples/nope.yaml`."
    fields = named_fields(page, spec_fields)
    assert fields == {"spec.trainer.checkpoint.gone", "spec.pools[].replicas"}
    assert [f for f in sorted(fields) if not field_exists(f, schema)] == [
        "spec.trainer.checkpoint.gone"
    ]
    assert not exists("examples/nope.yaml") and exists("examples/*.yaml")
    assert exists("rollout/engine.py")
    assert git_ignored("bench/results.jsonl") and not git_ignored("examples/nope.yaml")
    bad_link = tmp_path / "page.md"
    bad_link.write_text("[ok](https://x.dev) [gone](nope.md#a) [top](#a)\n")
    assert broken_links(bad_link) == ["nope.md#a"]
    assert named_targets("run `make no-such-target`\n```sh\nmake demo\n```\n") == {
        "no-such-target",
        "demo",
    }
    assert "demo" in make_targets() and "no-such-target" not in make_targets()


def test_the_walkthrough_lives_in_one_place() -> None:
    holders = [page_id(p) for p in PAGES if "<!-- walkthrough:" in p.read_text()]
    assert holders == [page_id(WALKTHROUGH_PAGE)]
    assert walkthrough()[0].startswith("make cluster")


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """Broken links, missing pages and missing included files fail the build."""
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's advert, not a warning
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert (tmp_path / "reference" / "rlhfjob" / "index.html").exists()
