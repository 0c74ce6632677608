"""The algorithm's configuration: frozen, keyword-only, validated at construction."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import RunConfigMismatch

DELTA_DTYPES = ("F32", "F16", "BF16", "F8_E4M3", "F4", "I2")
CHUNK_BLOCK = 32  # chunk sizes are multiples of the F4/I2 quantizer block (codec/plan.py BLOCK)
DEFAULT_CHUNK_ELEMENTS = 1 << 24  # 16 Mi elements: 64 MiB of fp32, 8 MiB of F4 per chunk payload
DEFAULT_VERIFY_WINDOW = 8  # rounds whose inputs GC keeps for verification (docs/security.md)
# ``DiLoCo.frugal``: the fewest bytes measured at no quality cost (docs/options.md, "Presets";
# bench/README.md, section 6, issue 29): the change goes out in F4.
FRUGAL: dict[str, Any] = dict(delta_dtype="I2", error_feedback=True, commit_dtype="F4", checkpoint_every=10)
# ``DiLoCo.frontier``: the fewest bytes: the change goes out in I2 too, and the closer takes the
# learners' pull back toward the master's 2-bit rounding out of each merged delta (``gap_projection``),
# which brings I2 commits' cost on textbook DiLoCo from 2.2% to 0.4% (bench/README.md): ~20% fewer
# bytes than ``frugal`` in all, ~10% fewer at the closer.
FRONTIER: dict[str, Any] = {**FRUGAL, "commit_dtype": "I2", "gap_projection": True}


@dataclass(frozen=True, kw_only=True)
class WeightedMean:
    """Merge deltas by their weighted mean."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "weighted_mean"}


@dataclass(frozen=True, kw_only=True)
class RDA:
    """Radial-directional averaging (Decoupled DiLoCo); names containing ``direct_pattern``
    (embeddings; compared case-insensitively) use the weighted mean."""

    direct_pattern: str = "embed"

    def is_direct(self, name: str) -> bool:
        """True for a tensor merged by the weighted mean: its name contains ``direct_pattern``,
        compared case-insensitively (``Embed``, ``embed_tokens`` and ``EMBED`` all match "embed")."""
        return self.direct_pattern.lower() in name.lower()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "rda", "direct_pattern": self.direct_pattern}


@dataclass(frozen=True, kw_only=True)
class Balanced:
    """Default partition: tensors largest first, each to the lightest fragment so far."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "balanced"}


@dataclass(frozen=True, kw_only=True)
class Strided:
    """Streaming DiLoCo partition: transformer blocks dealt round-robin to fragments."""

    block_pattern: str = r"\.(\d+)\."

    def __post_init__(self) -> None:
        try:
            pattern = re.compile(self.block_pattern)
        except re.error as e:
            raise ValueError(f"Strided(block_pattern={self.block_pattern!r}) is not a regex: {e}") from None
        if pattern.groups < 1:
            raise ValueError(f"Strided(block_pattern={self.block_pattern!r}) needs one group capturing the block index")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "strided", "block_pattern": self.block_pattern}


@dataclass(frozen=True, kw_only=True)
class Overwrite:
    """A commit replaces the fragment, dropping the local steps taken since this learner's
    contribution (they were not in the merge). The default before ``Adaptive``: what a manifest
    without an ``alignment`` (and without ``mixing``) means."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "overwrite"}


@dataclass(frozen=True, kw_only=True)
class Blend:
    """A commit is blended in: ``mixing*local + (1-mixing)*theta`` (``DiLoCo(mixing=)`` is this)."""

    mixing: float

    def __post_init__(self) -> None:
        if isinstance(self.mixing, bool) or not isinstance(self.mixing, int | float) or not 0.0 <= self.mixing < 1.0:
            raise ValueError(f"Blend(mixing={self.mixing!r}) is invalid: expected a number in [0, 1)")
        object.__setattr__(self, "mixing", float(self.mixing))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "blend", "mixing": self.mixing}


@dataclass(frozen=True, kw_only=True)
class Carry:
    """Keep the local steps taken since the contribution: ``theta + (local - snapshot)``, where the
    snapshot is the fragment as this learner contributed it to the committed round, or to an
    earlier round of the fragment whose commit merged it and that this node skipped while catching
    up (its anchor, if neither merged its contribution). The delay-corrected alignment of LOSCAR-SGD: a straggler's steps
    since its snapshot are not thrown away."""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "carry"}


@dataclass(frozen=True, kw_only=True)
class Adaptive:
    """Carry while the learners agree, Overwrite while they do not, per fragment: a commit whose
    mean pairwise cosine is at least ``carry_above`` switches the fragment to Carry, one at most
    ``overwrite_below`` back to Overwrite; in between (and with one contributor, no cosine) the
    fragment keeps its rule. A run starts on Overwrite; a learner joining it later starts each
    fragment on Carry unless its newest commit's cosine is at most ``overwrite_below``. The default
    (``DEFAULT_ALIGNMENT``)."""

    carry_above: float = 0.3
    overwrite_below: float = 0.1

    def __post_init__(self) -> None:
        for name in ("carry_above", "overwrite_below"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not -1.0 <= v <= 1.0:
                raise ValueError(f"Adaptive({name}={v!r}) is invalid: expected a cosine in [-1, 1]")
            object.__setattr__(self, name, float(v))
        if not self.overwrite_below < self.carry_above:
            raise ValueError(
                f"Adaptive(carry_above={self.carry_above}, overwrite_below={self.overwrite_below}) is invalid: "
                "expected overwrite_below < carry_above (the gap between them is the hysteresis)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "adaptive", "carry_above": self.carry_above, "overwrite_below": self.overwrite_below}


Merge = WeightedMean | RDA
Partition = Balanced | Strided
Alignment = Overwrite | Blend | Carry | Adaptive
# The rule of a config given neither ``alignment`` nor ``mixing``: with Carry, the most computed
# steps reaching a commit, and the only rule no worse than Overwrite on any seed of the rule arms
# (bench/README.md, section 6, "Alignment rules"). A manifest names it; one without an
# ``alignment`` is from before it was the default, a run of Overwrite.
DEFAULT_ALIGNMENT: Alignment = Adaptive()


@dataclass(frozen=True, kw_only=True)
class DiLoCo:
    """Decoupled / Streaming DiLoCo. See SPEC section 2 for every field."""

    sync_every: int
    fragments: int
    in_flight: int | None = None  # None: min(2, fragments)
    overlap_steps: int | None = None
    mixing: float = 0.0
    quorum_size: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    merge: Merge = field(default_factory=RDA)
    partition: Partition = field(default_factory=Balanced)
    global_batch_size: int | None = None
    delta_dtype: str | None = None
    commit_dtype: str | None = None
    flush_on_close: bool = False
    outlier_factor: float | None = None  # reject deltas whose norm exceeds this x the others' median
    clip_norm: float | None = None  # scale each delta down to at most this whole-fragment L2 norm
    # How a commit meets the local steps. None: gm.Blend(mixing) if mixing is set, else
    # DEFAULT_ALIGNMENT (left out, so that mixing with an explicit rule other than Blend can refuse).
    alignment: Alignment | None = None
    # each learner gives a merged delta's quantization error back to its parameters when the
    # commit arrives (adapters/feedback.py), so the next delta carries it where the loss is flat
    error_feedback: bool = False
    # The closer writes the full parameters and outer state only every k-th version of a fragment
    # (and on a final round); the rounds between carry the quantized change and what a recovering
    # closer needs to replay them bit for bit (docs/protocol.md, "Checkpoints"). Needs commit_dtype.
    checkpoint_every: int = 1
    # With commit_dtype: the part of each merged delta that pulls the learners back toward the
    # rounding the master keeps (master - published parameters, per block of 32 elements) is taken
    # out before the outer step, which would apply it a second time (aggregators/outer.py,
    # ``drop_pullback``; bench/README.md section 6).
    gap_projection: bool = False
    # Payloads are stored as chunks of this many elements of a fragment's line (a positive multiple
    # of 32; docs/protocol.md, "Chunked payloads"): what lets a sharded node's ranks each upload and
    # download only their part. A fragment of at most this many elements is one chunk, with the
    # bytes a whole-fragment payload always had. None: one chunk per fragment, however large (what
    # every run created before the option stores: a manifest without the field reads as None).
    chunk_elements: int | None = DEFAULT_CHUNK_ELEMENTS
    # Garbage collection keeps what verifying a round needs (its contributions, their snapshot
    # records, the state its fragment started from) for the newest this many rounds, so any reader
    # can recompute them (``gradientmail verify``; docs/security.md, "Verifying commits"). 0: keep
    # only what the run itself needs. A manifest from before the option reads as the default.
    verify_window: int = DEFAULT_VERIFY_WINDOW
    # A fleet of any size (docs/protocol.md, "A fleet of any size"): each round merges at most this
    # many contributions, drawn without bias (the lowest hashes of run, round and learner id among
    # those that reported), and once the run has committed a round a node that closes nothing polls
    # only the round records and the claimant's lease: no node's reads grow with the fleet. None:
    # every contribution is merged and every node lists every lease and snapshot (as before).
    max_contributions: int | None = None

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"DiLoCo({what}) is invalid")

        for name in ("sync_every", "fragments", "quorum_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name}={v!r}: expected an integer >= 1")
        if self.in_flight is None:
            object.__setattr__(self, "in_flight", min(2, self.fragments))
        inf = self.in_flight
        if not isinstance(inf, int) or isinstance(inf, bool):
            raise bad(f"in_flight={inf!r}: expected an integer")
        if not 1 <= inf <= self.fragments <= self.sync_every:
            raise bad(
                f"in_flight={inf}, fragments={self.fragments}, sync_every={self.sync_every}: "
                "expected 1 <= in_flight <= fragments <= sync_every"
            )
        if self.overlap_steps is not None and (
            not isinstance(self.overlap_steps, int) or isinstance(self.overlap_steps, bool) or self.overlap_steps < 0
        ):
            raise bad(f"overlap_steps={self.overlap_steps!r}: expected None or an integer >= 0")
        if not isinstance(self.mixing, int | float) or not 0.0 <= self.mixing < 1.0:
            raise bad(f"mixing={self.mixing!r}: expected a number in [0, 1)")
        if self.alignment is None:
            # Under a cap most contributions are in no commit: carrying their late steps cost loss
            # there (bench/README.md, section 6), so a capped run left at the default overwrites.
            rule = Overwrite() if self.max_contributions is not None else DEFAULT_ALIGNMENT
            object.__setattr__(self, "alignment", Blend(mixing=self.mixing) if self.mixing else rule)
        if not isinstance(self.alignment, Overwrite | Blend | Carry | Adaptive):
            raise bad(
                f"alignment={self.alignment!r}: expected gm.Overwrite(), gm.Blend(m), gm.Carry() or gm.Adaptive()"
            )
        # ``mixing`` is ``Blend(mixing)``: either spelling, never two different values.
        if isinstance(self.alignment, Blend):
            if self.mixing not in (0.0, self.alignment.mixing):
                raise bad(f"mixing={self.mixing!r} with alignment={self.alignment!r}: pass one of them")
            object.__setattr__(self, "mixing", self.alignment.mixing)
        elif self.mixing:
            if not isinstance(self.alignment, Overwrite):
                raise bad(
                    f"mixing={self.mixing!r} with alignment={self.alignment!r}: mixing is gm.Blend(mixing), "
                    f"pass alignment=gm.Blend(mixing={self.mixing!r}) or mixing alone"
                )
            object.__setattr__(self, "alignment", Blend(mixing=self.mixing))
        if not isinstance(self.outer_lr, int | float) or not self.outer_lr > 0:
            raise bad(f"outer_lr={self.outer_lr!r}: expected a number > 0")
        if not isinstance(self.outer_momentum, int | float) or not 0 <= self.outer_momentum < 1:
            raise bad(f"outer_momentum={self.outer_momentum!r}: expected a number in [0, 1)")
        if not isinstance(self.merge, WeightedMean | RDA):
            raise bad(f"merge={self.merge!r}: expected gm.RDA() or gm.WeightedMean()")
        if not isinstance(self.partition, Balanced | Strided):
            raise bad(f"partition={self.partition!r}: expected gm.Balanced() or gm.Strided()")
        if self.global_batch_size is not None and (
            not isinstance(self.global_batch_size, int) or self.global_batch_size < 1
        ):
            raise bad(f"global_batch_size={self.global_batch_size!r}: expected None or an integer >= 1")
        for name in ("delta_dtype", "commit_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DELTA_DTYPES:
                raise bad(f"{name}={v!r}: expected None or one of {DELTA_DTYPES}")
        for name, low in (("outlier_factor", 1.0), ("clip_norm", 0.0)):
            v = getattr(self, name)
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not v > low
            ):
                raise bad(f"{name}={v!r}: expected None or a finite number > {low:g}")
            if v is not None:
                object.__setattr__(self, name, float(v))
        ce = self.checkpoint_every
        if not isinstance(ce, int) or isinstance(ce, bool) or ce < 1:
            raise bad(f"checkpoint_every={ce!r}: expected an integer >= 1")
        if ce > 1 and self.commit_dtype is None:
            raise bad(
                f"checkpoint_every={ce} with commit_dtype=None: the rounds between checkpoints publish only "
                "the quantized change, so set commit_dtype (e.g. 'F4') or keep checkpoint_every=1"
            )
        c = self.chunk_elements
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1 or c % CHUNK_BLOCK):
            raise bad(f"chunk_elements={c!r}: expected None or a positive multiple of {CHUNK_BLOCK}")
        w = self.verify_window
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise bad(f"verify_window={w!r}: expected an integer >= 0 (rounds whose inputs the store keeps)")
        if not isinstance(self.error_feedback, bool):
            raise bad(f"error_feedback={self.error_feedback!r}: expected True or False")
        k = self.max_contributions
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise bad(f"max_contributions={k!r}: expected None or an integer >= 1 (contributions merged a round)")
        if not isinstance(self.gap_projection, bool):
            raise bad(f"gap_projection={self.gap_projection!r}: expected True or False")
        if self.gap_projection and self.commit_dtype is None:
            raise bad(
                "gap_projection=True, commit_dtype=None: the gap it projects on is the rounding of quantized "
                "commits; set commit_dtype (e.g. 'I2') or leave gap_projection off"
            )
        object.__setattr__(self, "mixing", float(self.mixing))
        object.__setattr__(self, "outer_lr", float(self.outer_lr))
        object.__setattr__(self, "outer_momentum", float(self.outer_momentum))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "alignment" and isinstance(v, Overwrite | Blend):
                # What a manifest without the key means: Overwrite (the default before Adaptive), or Blend
                # with ``mixing``. Manifests of these rules keep the bytes they had.
                continue
            if f.name in ("error_feedback", "gap_projection") and not v:
                continue  # off, the default: manifests from before agree
            if f.name == "checkpoint_every" and v == 1:
                continue  # the default: manifests from before the option keep their bytes and agree
            if f.name == "max_contributions" and v is None:
                continue  # every contribution merged: manifests from before the option agree
            if f.name == "chunk_elements" and v is None:
                continue  # whole fragments: what a manifest from before the option means
            if f.name == "verify_window" and v == DEFAULT_VERIFY_WINDOW:
                continue  # the default: manifests from before the option keep their bytes and agree
            d[f.name] = v.to_dict() if hasattr(v, "to_dict") else v
        return d

    @classmethod
    def frugal(cls, *, sync_every: int, fragments: int = 1, **options: Any) -> DiLoCo:
        """A run that moves about a thousandth of data parallel's bytes: I2 deltas with error
        feedback, F4 commits, the full parameters and outer state every 10th version (``FRUGAL``).
        Any other option may be given, and one given here wins over the preset's."""
        return cls(sync_every=sync_every, fragments=fragments, **{**FRUGAL, **options})

    @classmethod
    def frontier(cls, *, sync_every: int, fragments: int = 1, **options: Any) -> DiLoCo:
        """The fewest bytes: ``frugal`` with I2 commits, the closer projecting out of each merged
        delta the learners' pull back toward the master's rounding (``FRONTIER``). Any other
        option may be given, and one given here wins over the preset's."""
        return cls(sync_every=sync_every, fragments=fragments, **{**FRONTIER, **options})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiLoCo:
        d = dict(d)
        d["merge"] = _merge_from(d.get("merge", {}))
        d["partition"] = _partition_from(d.get("partition", {}))
        if "alignment" in d:
            d["alignment"] = _alignment_from(d["alignment"])
        elif not d.get("mixing"):
            d["alignment"] = Overwrite()  # written before Adaptive was the default, or of Overwrite
        # A manifest from before chunks stores whole fragments, forever (not the new default).
        d.setdefault("chunk_elements", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DiLoCo field(s) {sorted(unknown)}")
        return cls(**d)

    def for_tensors(self, tensors: int) -> DiLoCo:
        """This config as a run over a model of ``tensors`` tensors uses it: ``fragments`` clamped
        to ``min(fragments, tensors)`` (a fragment holds at least one tensor), ``in_flight`` to at
        most that. The manifest records the clamped config; a joining node compares against it
        after clamping its own the same way."""
        used = min(self.fragments, max(tensors, 1))
        if used == self.fragments:
            return self
        assert self.in_flight is not None
        return dataclasses.replace(self, fragments=used, in_flight=min(self.in_flight, used))

    def check_matches(self, run_config: dict[str, Any]) -> None:
        """Raise ``RunConfigMismatch`` naming every field that differs from the run's."""
        mine = self.to_dict()
        if "chunk_elements" not in run_config and mine.get("chunk_elements") == DEFAULT_CHUNK_ELEMENTS:
            # A run from before chunks (whole fragments), joined by a node that left the option at
            # its default: the run's layout is the run's, every node reads it from the manifest.
            del mine["chunk_elements"]
        if "alignment" not in run_config and not run_config.get("mixing") and self.alignment == DEFAULT_ALIGNMENT:
            # A run of Overwrite (created before Adaptive was the default, or with Overwrite), joined by
            # a node that left the rule at its default (or named it: the two are one config), as
            # for chunks: the rule is the run's, every node reads it from the manifest.
            del mine["alignment"]
        diffs = {
            k: (run_config.get(k), mine.get(k))
            for k in sorted(set(mine) | set(run_config))
            if run_config.get(k) != mine.get(k)
        }
        if diffs:
            raise RunConfigMismatch(diffs)


def _merge_from(d: dict[str, Any]) -> Merge:
    if not isinstance(d, dict):
        raise ValueError(f"merge must be an object, found {d!r:.80}")
    kind = d.get("kind")
    if kind == "weighted_mean":
        return WeightedMean()
    if kind == "rda":
        return RDA(direct_pattern=str(d.get("direct_pattern", "embed")))
    raise ValueError(f"unknown merge {d!r}")


def _partition_from(d: dict[str, Any]) -> Partition:
    if not isinstance(d, dict):
        raise ValueError(f"partition must be an object, found {d!r:.80}")
    kind = d.get("kind")
    if kind == "balanced":
        return Balanced()
    if kind == "strided":
        return Strided(block_pattern=str(d.get("block_pattern", r"\.(\d+)\.")))
    raise ValueError(f"unknown partition {d!r}")


def _alignment_from(d: dict[str, Any]) -> Alignment:
    if not isinstance(d, dict):
        raise ValueError(f"alignment must be an object, found {d!r:.80}")
    kind = d.get("kind")
    if kind == "overwrite":
        return Overwrite()
    if kind == "blend":
        return Blend(mixing=d.get("mixing", 0.0))
    if kind == "carry":
        return Carry()
    if kind == "adaptive":
        return Adaptive(carry_above=d.get("carry_above", 0.3), overwrite_below=d.get("overwrite_below", 0.1))
    raise ValueError(f"unknown alignment {d!r}")
