"""The codec sits below the protocol: payload bytes and the chunk plan know nothing of keys,
records, stores, nodes or frameworks; ``protocol/layout.py`` adds rank ownership on top of the
codec's plan."""

from __future__ import annotations

import ast
from pathlib import Path

CODEC = Path(__file__).resolve().parents[1] / "gradientmail_core" / "codec"
ABOVE = ("protocol", "syncer", "sharded", "adapters", "aggregators", "mailbox", "session", "sim", "cli")


def _imports(path: Path) -> set[str]:
    """What a codec module imports, relative imports resolved against ``gradientmail_core.codec``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ["gradientmail_core", "codec"][: 3 - node.level] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def test_the_codec_imports_nothing_above_it() -> None:
    offenders = [
        f"{path.name} imports {name}"
        for path in sorted(CODEC.glob("*.py"))
        for name in sorted(_imports(path))
        if any(name.startswith(f"gradientmail_core.{pkg}") for pkg in ABOVE)
    ]
    assert not offenders, offenders


def test_the_import_check_sees_an_import_from_above(tmp_path: Path) -> None:
    fake = tmp_path / "x.py"
    fake.write_text("def f():\n    from ..protocol.layout import Layout\n")
    assert "gradientmail_core.protocol.layout.Layout" in _imports(fake)
