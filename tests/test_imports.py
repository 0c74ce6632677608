"""Importing the core pulls in no framework and no cloud SDK; no pickle in library code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_core_imports_no_framework_or_sdk():
    code = (
        "import sys, gradientmail_core as gm\n"
        "gm.MemoryMailbox(); gm.FileMailbox\n"
        "bad = [m for m in ('torch', 'mlx', 'lightning', 'accelerate', 'boto3', 'botocore', 'zstandard', "
        "'cryptography') "
        "if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""


def test_s3_mailbox_class_loads_without_importing_boto3_until_used():
    code = "import sys, gradientmail_core as gm\ngm.S3Mailbox\nprint('boto3' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_no_unpickling_in_library_code():
    pattern = re.compile(r"\bpickle\b|torch\.load\((?![^)]*weights_only=True)|allow_pickle\s*=\s*True|\bdill\b")
    offenders = []
    for pkg in ("gradientmail_core", "gradientmail_lightning"):
        for path in (ROOT / pkg).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def _imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved), lazy ones too."""
    import ast

    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        for name in sorted(_imports_of(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    return bad


def test_dependencies_run_one_way_between_the_packages():
    # The core never reaches up into the integrations, nor into the development package beside it
    # (the simulation and the fault injector, outside the wheel) or the tests.
    assert not _offenders(
        "gradientmail_core", ("gradientmail_lightning", "lightning", "accelerate", "gradientmail_sim", "tests")
    )
    assert not _offenders("gradientmail_lightning", ("gradientmail_sim", "tests"))
    # The simulation drives the product from outside: it imports the core, never the integrations.
    assert not _offenders("gradientmail_sim", ("gradientmail_lightning", "tests"))
    # The protocol is below the engine: keys, records, the store and the tape never import the syncer,
    # nor the adapters (a run is opened with a schema and a read function, not a model).
    assert not _offenders(
        "gradientmail_core.protocol",
        ("gradientmail_core.syncer", "gradientmail_core.session", "gradientmail_core.adapters"),
    )
    # Backends and wrappers know the contract and the keys, nothing of the engine above them.
    assert not _offenders(
        "gradientmail_core.mailbox",
        ("gradientmail_core.syncer", "gradientmail_core.session", "gradientmail_core.aggregators"),
    )
    # Pure arithmetic and codecs do no I/O and know nothing of who calls them.
    for pkg in ("gradientmail_core.aggregators", "gradientmail_core.codec"):
        assert not _offenders(
            pkg, ("gradientmail_core.syncer", "gradientmail_core.mailbox", "gradientmail_core.session")
        )


def _module_graph(package: str = "gradientmail_core", root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of ``package`` it imports, lazy ones too.
    ``from p import x`` imports the module ``p.x`` when there is one, else ``p``."""
    import ast

    modules = {}
    for path in (root / package).rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)] = path

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for m, path in modules.items():
        here = m.split(".") if path.name == "__init__.py" else m.split(".")[:-1]
        found: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(owner(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
                found.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else owner(mod) for a in node.names)
        graph[m] = {o for o in found if o is not None and o != m}
    return graph


def _circle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A shortest import circle from ``start`` back to itself, or None."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        m = todo.pop(0)
        for n in sorted(graph.get(m, ())):
            if n == start:
                return [*paths[m], start]
            if n not in paths:
                paths[n] = [*paths[m], n]
                todo.append(n)
    return None


# The core's layers, bottom to top (docs/ENGINE_NOTES.md): a module imports only from its own
# layer and the layers below it. The package's ``__init__`` is the layer above them all.
LAYERS = (
    ("errors", "clock", "events", "config", "ahead"),
    ("codec", "mailbox"),
    ("protocol", "aggregators"),
    ("adapters", "workqueue", "data", "barrier"),
    ("syncer",),
    ("sharded", "cli"),
    ("session",),
)


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS)  # the package itself
    for i, names in enumerate(LAYERS):
        if parts[1] in names:
            return i
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{m} (layer {_layer(m)}) imports {n} (layer {_layer(n)})"
        for m, names in graph.items()
        for n in names
        if _layer(n) > _layer(m)
    )


def test_every_module_imports_only_from_its_layer_and_below():
    graph = _module_graph()
    assert len(graph) > 100  # the graph sees the whole core
    assert not _upward(graph), _upward(graph)


def test_the_layer_check_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "gradientmail_core"
    (pkg / "codec").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "codec" / "__init__.py").write_text("")
    (pkg / "codec" / "x.py").write_text("def f():\n    from ..syncer.node import Node\n")
    (pkg / "syncer").mkdir()
    (pkg / "syncer" / "__init__.py").write_text("")
    (pkg / "syncer" / "node.py").write_text("from ..codec import x\n")
    assert _upward(_module_graph(root=tmp_path)) == [
        "gradientmail_core.codec.x (layer 1) imports gradientmail_core.syncer.node (layer 4)"
    ]


def test_the_core_has_no_import_circle():
    graph = _module_graph()
    circles = [c for m in sorted(graph) if (c := _circle_through(graph, m))]
    assert not circles, circles[:5]


def test_the_session_and_its_engine_hosts_form_no_import_circle():
    # The session delegates to a host chosen from the model; the hosts never reach back up to it.
    assert not _offenders("gradientmail_core.sharded", ("gradientmail_core.session",))
    assert not _offenders("gradientmail_core.syncer", ("gradientmail_core.session", "gradientmail_core.sharded"))
    graph = _module_graph()
    assert "gradientmail_core.sharded.runtime" in graph["gradientmail_core.session"]  # the check sees the edge
    ours = ["gradientmail_core.session", *sorted(m for m in graph if m.startswith("gradientmail_core.sharded."))]
    circles = [c for m in ours if (c := _circle_through(graph, m))]
    assert not circles, circles


def test_the_circle_check_finds_a_circle(tmp_path):
    # The check above must be able to fail: two modules importing each other (one lazily) are a
    # circle, and a module importing a sibling through its package is not one with the package.
    pkg = tmp_path / "gradientmail_core"
    (pkg / "sharded").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .session import Session\n")
    (pkg / "events.py").write_text("")
    (pkg / "sharded" / "__init__.py").write_text("")
    (pkg / "session.py").write_text("from . import events\nfrom .sharded.runtime import sharded_host\n")
    (pkg / "sharded" / "runtime.py").write_text("def f():\n    from ..session import Session\n")
    graph = _module_graph(root=tmp_path)
    assert graph["gradientmail_core.session"] == {"gradientmail_core.events", "gradientmail_core.sharded.runtime"}
    assert _circle_through(graph, "gradientmail_core.session") == [
        "gradientmail_core.session",
        "gradientmail_core.sharded.runtime",
        "gradientmail_core.session",
    ]


def test_the_import_check_sees_relative_and_lazy_imports(tmp_path):
    # The check above must not pass for want of seeing: a relative import inside a function, and an
    # absolute one, in a module of protocol/ are both found and resolved to the syncer.
    fake = tmp_path / "gradientmail_core" / "protocol" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ..syncer import node\n\nimport gradientmail_core.syncer.closer\n")
    found = _imports_of(fake, root=tmp_path)
    assert "gradientmail_core.syncer.node" in found and "gradientmail_core.syncer.closer" in found
