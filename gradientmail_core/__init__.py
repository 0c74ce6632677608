"""gradientmail: Decoupled DiLoCo over a shared object store.

    import gradientmail_core as gm

    with gm.Session(model, algorithm=gm.DiLoCo(sync_every=100, fragments=8),
                    mailbox=gm.FileMailbox("/shared/run-1")) as session:
        for batch in loader:
            train_step(model, optimizer, batch)
            session.step(samples=len(batch))

Importing this package imports neither torch, MLX, Lightning, Accelerate nor boto3.
"""

from __future__ import annotations

from typing import Any

from . import events
from .barrier import Barrier
from .clock import Clock, FakeClock, SystemClock
from .config import RDA, Adaptive, Balanced, Blend, Carry, DiLoCo, Overwrite, Strided, WeightedMean
from .errors import (
    BarrierTimeout,
    DuplicateLearner,
    GradientMailError,
    MailboxUnavailable,
    MissingExtra,
    PayloadCorrupt,
    ProtocolError,
    RecordDamaged,
    RunConfigMismatch,
    SchemaMismatch,
    SessionFailed,
    StoreUnsupported,
)
from .events import log_events
from .mailbox import CountingMailbox, Mailbox, open_mailbox
from .mailbox.file import FileMailbox
from .mailbox.memory import MemoryMailbox
from .session import Progress, Session, align
from .syncer.standalone import Syncer
from .workqueue.queue import HoldLost, WorkQueue

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # S3Mailbox's module is cheap to import (boto3 loads on first use), but keep the door
    # open for heavier backends by resolving them lazily.
    if name == "S3Mailbox":
        from .mailbox.s3 import S3Mailbox

        return S3Mailbox
    raise AttributeError(f"module 'gradientmail_core' has no attribute {name!r}")


__all__ = [
    "RDA",
    "Adaptive",
    "Balanced",
    "Barrier",
    "BarrierTimeout",
    "Blend",
    "Carry",
    "Clock",
    "CountingMailbox",
    "DiLoCo",
    "DuplicateLearner",
    "FakeClock",
    "FileMailbox",
    "GradientMailError",
    "HoldLost",
    "Mailbox",
    "MailboxUnavailable",
    "MemoryMailbox",
    "MissingExtra",
    "Overwrite",
    "PayloadCorrupt",
    "Progress",
    "ProtocolError",
    "RecordDamaged",
    "RunConfigMismatch",
    "S3Mailbox",
    "SchemaMismatch",
    "Session",
    "SessionFailed",
    "StoreUnsupported",
    "Strided",
    "Syncer",
    "SystemClock",
    "WeightedMean",
    "WorkQueue",
    "align",
    "events",
    "log_events",
    "open_mailbox",
]
