"""The wheel holds the product: the core and the integrations, every module of them, and nothing
that only development uses (the simulation, the fault injector, the mutants, the test oracles)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("gradientmail_core", "gradientmail_lightning")
# Module names that only development uses, wherever they would sit in the wheel.
DEVELOPMENT = ("sim", "faults", "mutants", "reference", "closer_reference", "oracle", "_compat")


def _checkout(dest: Path) -> None:
    """The files of the working tree (tracked, and untracked ones git does not ignore), so an old
    ``build/`` folder in the checkout cannot leak stale modules into the wheel."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(
            ROOT,
            dest,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__"),
        )
        return
    for name in filter(None, listed.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    _checkout(src)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", out],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if built.returncode != 0 and "No module named pip" in built.stderr:
        pytest.skip("pip is not installed in this environment")
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("gradientmail-*.whl")
    with zipfile.ZipFile(path) as z:
        return z.namelist()


def test_the_wheel_holds_every_module_of_the_product(wheel: list[str]) -> None:
    tops = {n.split("/")[0] for n in wheel if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PRODUCT)
    source = {str(p.relative_to(ROOT)) for pkg in PRODUCT for p in (ROOT / pkg).rglob("*.py")}
    assert source <= set(wheel), sorted(source - set(wheel))[:5]
    (entry,) = [n for n in wheel if n.endswith(".dist-info/entry_points.txt")]
    assert entry  # the ``gradientmail`` command


def test_the_wheel_holds_no_simulation_fault_injector_mutant_or_oracle(wheel: list[str]) -> None:
    dev = [
        n for n in wheel if n.endswith(".py") and any(part.removesuffix(".py") in DEVELOPMENT for part in n.split("/"))
    ]
    assert not dev, dev
    assert not [n for n in wheel if n.startswith(("gradientmail_sim/", "tests/"))]


def test_the_development_check_sees_a_development_module() -> None:
    # The name check above must be able to fail: the development package's own modules match it.
    names = [
        f"gradientmail_core/{p.relative_to(ROOT / 'gradientmail_sim')}"
        for p in (ROOT / "gradientmail_sim").glob("*.py")
    ]
    caught = [n for n in names if any(part.removesuffix(".py") in DEVELOPMENT for part in n.split("/"))]
    assert {"gradientmail_core/faults.py", "gradientmail_core/mutants.py", "gradientmail_core/reference.py"} <= set(
        caught
    )
