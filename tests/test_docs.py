"""The documentation keeps up with the code: every public option is documented in
docs/options.md, and the docs are self-contained (no links outside the repository)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import gradientmail_core as gm
from gradientmail_core.mailbox.s3 import S3Mailbox
from gradientmail_lightning.options import SessionOptions

ROOT = Path(__file__).resolve().parent.parent
OPTIONS = ROOT / "docs" / "options.md"


def _parameters(fn: object) -> list[str]:
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
        if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


DOCUMENTED = {
    "gm.Session": _parameters(gm.Session.__init__),
    "gm.DiLoCo": _fields(gm.DiLoCo),
    "gm.RDA": _fields(gm.RDA),
    "gm.Strided": _fields(gm.Strided),
    "gm.S3Mailbox": _parameters(S3Mailbox.__init__),
    "gm.FileMailbox": _parameters(gm.FileMailbox.__init__),
    "gm.MemoryMailbox": _parameters(gm.MemoryMailbox.__init__),
    "SessionOptions": _fields(SessionOptions),
}


def _documented_names(text: str) -> set[str]:
    """Every name written as code (`name`, or `name=...` / `name,` inside a code span)."""
    names: set[str] = set()
    for span in re.findall(r"`([^`]+)`", text):
        names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span))
    return names


@pytest.mark.parametrize("owner", sorted(DOCUMENTED))
def test_every_option_is_in_docs_options(owner: str) -> None:
    names = DOCUMENTED[owner]
    assert names, f"no parameters found for {owner}: the introspection is broken"
    documented = _documented_names(OPTIONS.read_text())
    missing = [n for n in names if n not in documented]
    assert not missing, f"{owner} options missing from docs/options.md: {missing}"


def test_the_check_sees_a_missing_option() -> None:
    # The check itself can fail: a name that is not in the document is reported.
    assert "an_option_nobody_documented" not in _documented_names(OPTIONS.read_text())
    assert "sync_every" in _documented_names(OPTIONS.read_text())


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.name)
def test_docs_do_not_point_outside_the_repository(path: Path) -> None:
    text = path.read_text()
    assert "../shared" not in text, f"{path.name} refers to ../shared, which is not in the repository"


def test_readme_links_the_options_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert "docs/options.md" in text
    assert OPTIONS.exists()
