"""gradientmail: Decoupled DiLoCo over a shared object store."""

from .config import RDA, Balanced, DiLoCo, Strided, WeightedMean
from .errors import (
    DuplicateLearner,
    GradientMailError,
    MailboxUnavailable,
    MissingExtra,
    PayloadCorrupt,
    ProtocolError,
    RunConfigMismatch,
    SchemaMismatch,
    SessionFailed,
    StoreUnsupported,
)

__all__ = [
    "RDA",
    "Balanced",
    "DiLoCo",
    "DuplicateLearner",
    "GradientMailError",
    "MailboxUnavailable",
    "MissingExtra",
    "PayloadCorrupt",
    "ProtocolError",
    "RunConfigMismatch",
    "SchemaMismatch",
    "SessionFailed",
    "StoreUnsupported",
    "Strided",
    "WeightedMean",
]
