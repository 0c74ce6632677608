"""An example that lacks an extra stops at once and prints the exact ``pip install`` line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs the example as a user would, in a Python where ``transformers`` cannot be found.
HIDE = """
import importlib.util, runpy, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'transformers' else real(name, *a)
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_hf_trainer_without_transformers_says_the_pip_install_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HIDE, str(ROOT / "examples" / "hf_trainer.py"), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "examples/hf_trainer.py needs transformers" in proc.stderr
    assert f"{sys.executable} -m pip install -e '.[transformers]'" in proc.stderr
    assert "pip install 'gradientmail[transformers]'" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "hf_trainer_out").exists()  # nothing started
