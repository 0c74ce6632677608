"""The few errors gradientmail raises. Each one says what the caller should do."""

from __future__ import annotations


class GradientMailError(Exception):
    """Base class for every error this library raises on purpose."""


class MailboxUnavailable(GradientMailError):
    """The store could not be reached or kept failing after retries.

    Transient: the run keeps going and retries later. Raised to the user only when the
    store stays down past the retry budget of a blocking call.
    """


class StoreUnsupported(GradientMailError):
    """The store does not honour create-once writes (``If-None-Match: *``).

    Fatal: use a store with atomic conditional writes (AWS S3, R2, MinIO, Ceph RGW, a
    POSIX directory).
    """


class MissingExtra(GradientMailError, ImportError):
    """An optional dependency is not installed. Install the named extra."""

    def __init__(self, extra: str, module: str | None = None) -> None:
        self.extra = extra
        what = module or extra
        super().__init__(f"{what} is not installed; install it with: pip install 'gradientmail[{extra}]'")


class PayloadCorrupt(GradientMailError):
    """A payload does not hash to its reference, or is not a valid payload.

    The contribution or commit is rejected; nothing is loaded from it.
    """


class PayloadLayoutMismatch(PayloadCorrupt):
    """A well-formed payload whose tensors are not the expected ones: other names, shapes or
    dtypes. Its bytes are intact; a contribution like this is rejected as ``schema``."""


class ProtocolError(GradientMailError):
    """An object in the mailbox breaks the protocol (malformed, wrong version, bad field)."""


class RecordInvalid(ProtocolError):
    """A record failed validation while decoding. It is treated as corrupt, never trusted."""


class UnsupportedFormat(RecordInvalid):
    """A record of a format version this gradientmail does not read (a newer one's): upgrade."""


class RecordDamaged(ProtocolError):
    """A round's record is on the tape but does not read back as a commit, and nobody repaired it
    within the bound: the tape cannot be followed past it. The message names the key and the remedy."""


class RunConfigMismatch(GradientMailError):
    """This node's algorithm config differs from the run's manifest. Fix the config."""

    def __init__(self, differences: dict[str, tuple[object, object]]) -> None:
        self.differences = differences
        parts = ", ".join(f"{k}: run has {a!r}, this node has {b!r}" for k, (a, b) in sorted(differences.items()))
        super().__init__(
            f"this node's DiLoCo config differs from the run's manifest ({parts}); "
            "start this node with the run's config or use a new mailbox prefix"
        )


class SchemaMismatch(GradientMailError):
    """This node's model parameters differ from the run's schema. Use the run's model."""

    def __init__(self, differences: list[str], fix: str | None = None) -> None:
        self.differences = differences
        self.fix = fix  # what makes this node's names the run's, when a rule explains the difference
        shown = "; ".join(differences[:10])
        more = f" (and {len(differences) - 10} more)" if len(differences) > 10 else ""
        todo = fix or "build the same model architecture as the run, or use a new mailbox prefix"
        super().__init__(f"this node's model does not match the run's parameter schema: {shown}{more}; {todo}")


class BarrierTimeout(GradientMailError, TimeoutError):
    """A ``gm.Barrier`` gave up: the message names who had not arrived. Start them, or wait for
    fewer parties; every party of that use of the barrier gets this error, none is released."""


class DuplicateLearner(GradientMailError, ValueError):
    """Another live process already uses this learner id. Pick a different id."""


class SessionFailed(GradientMailError):
    """The background work of a session failed; the original error is the ``__cause__``."""
