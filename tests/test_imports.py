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
        "bad = [m for m in ('torch', 'mlx', 'lightning', 'accelerate', 'boto3', 'botocore', 'zstandard') "
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
