"""Creating and joining a run: the manifest, the initial parameters, the checks a node
passes before it trains (config and schema), and loading the newest committed state."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..codec.header import schema_digest
from ..codec.payload import encode_payload
from ..codec.plan import Piece, fragment_plan
from ..config import DiLoCo
from ..errors import ProtocolError
from ..mailbox import CreateOutcome
from . import keys
from .partition import plan
from .records import MAX_RECORD_BYTES, Manifest, PayloadRef, TensorSpec, canonical_json, chunk_refs, to_dict
from .schedule import is_checkpoint
from .schema import check_schema
from .store import RunStore

# The JSON of one chunk's ref in a round record, at its longest (a compressed round payload of the
# highest round, the largest size), and how many a round record may carry beside everything else
# (participants, rejections, estimates: a quarter of the record's cap is left to them).
_LONGEST_REF = PayloadRef(
    key=keys.round_blob_key(keys.MAX_ROUND, "change", "f" * 64, "zstd"), sha256="f" * 64, size=2**62
)
REF_BYTES = len(canonical_json(to_dict(_LONGEST_REF))) + 1  # and a comma
RECORD_REFS = (MAX_RECORD_BYTES - MAX_RECORD_BYTES // 4) // REF_BYTES

Read = Callable[[Sequence[str]], Mapping[str, np.ndarray]]
"""The model's current values of the named tensors, as host float32 arrays (``Adapter.read``)."""

Upload = Callable[[list[list[str]]], list[PayloadRef]]
"""Uploads the initial parameters of every fragment of a plan (each fragment's tensor names) and
returns each fragment's ref, in plan order: how a new run's parameters reach the store
(``upload_values`` for a model read whole; a sharded node's ranks upload the chunks they own)."""


@dataclass
class RunInfo:
    """What every node derives from the manifest."""

    manifest: Manifest
    cfg: DiLoCo
    schema: list[TensorSpec]
    digest: str
    fragments: list[list[str]]
    dtypes: dict[str, str] = field(init=False)
    shapes: list[dict[str, tuple[int, ...]]] = field(init=False)

    def __post_init__(self) -> None:
        self.dtypes = {s.name: s.dtype for s in self.schema}
        by_name = {s.name: tuple(s.shape) for s in self.schema}
        self.shapes = [{n: by_name[n] for n in names} for names in self.fragments]

    @property
    def P(self) -> int:
        return self.cfg.fragments

    @property
    def H(self) -> int:
        return self.cfg.sync_every

    def fragment_dtypes(self, f: int) -> dict[str, str]:
        return {n: self.dtypes[n] for n in self.fragments[f]}

    def delta_dtypes(self, f: int) -> dict[str, str]:
        """The dtype of each tensor of fragment ``f``'s deltas: ``delta_dtype``, else its own."""
        if self.cfg.delta_dtype:
            return dict.fromkeys(self.fragments[f], self.cfg.delta_dtype)
        return self.fragment_dtypes(f)

    def master_is_theta(self, f: int) -> bool:
        """True when fragment ``f``'s published parameters are its fp32 master (every tensor F32
        and no ``commit_dtype``): the outer-state payload then holds the momentum only (SPEC 3.3)."""
        return self.cfg.commit_dtype is None and all(self.dtypes[n] == "F32" for n in self.fragments[f])

    def outer_shapes(self, f: int) -> dict[str, tuple[int, ...]]:
        """The tensors of fragment ``f``'s outer-state payload: ``momentum/{name}`` and, unless the
        published parameters are the master, ``master/{name}``."""
        shapes = self.shapes[f]
        out = {f"momentum/{n}": s for n, s in shapes.items()}
        if not self.master_is_theta(f):
            out.update({f"master/{n}": s for n, s in shapes.items()})
        return out

    def split_outer(
        self, f: int, outer: dict[str, np.ndarray], theta: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """``(master, momentum)`` of fragment ``f`` from its decoded outer payload and parameters."""
        names = self.fragments[f]
        source, prefix = (theta, "") if self.master_is_theta(f) else (outer, "master/")
        return {n: source[prefix + n] for n in names}, {n: outer[f"momentum/{n}"] for n in names}

    def fragment_bytes(self, f: int) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * 4 for s in self.shapes[f].values())

    @property
    def chunk_elements(self) -> int | None:
        """The run's chunk size (None: one chunk per fragment; docs/protocol.md, "Chunked payloads")."""
        return self.cfg.chunk_elements

    def plan(self, f: int) -> list[list[Piece]]:
        """The chunks of fragment ``f``'s parameters, deltas and changes (``codec/plan.py``)."""
        return fragment_plan(self.shapes[f], self.chunk_elements)

    def checkpoint_due(self, f: int, version: int, *, final: bool, participants: int) -> bool:
        """Does the commit of fragment ``f``'s ``version`` write the full parameters and outer
        state? ``schedule.is_checkpoint``, and also a round between checkpoints whose record would
        list more chunk refs (the change, and every participant's contribution) than a record holds
        (``RECORD_REFS``): it writes a checkpoint instead, which is always valid."""
        if is_checkpoint(version, final=final, every=self.cfg.checkpoint_every):
            return True
        n = len(self.plan(f))
        return n * (participants + 1) > RECORD_REFS

    @classmethod
    def from_manifest(cls, m: Manifest) -> RunInfo:
        try:
            cfg = DiLoCo.from_dict(m.config)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"{keys.MANIFEST}: the run's config is invalid ({e})") from None
        if schema_digest(m.schema) != m.schema_digest:
            raise ProtocolError(f"{keys.MANIFEST}: schema digest does not match its schema")
        names = [s.name for s in m.schema]
        if len(set(names)) != len(names) or sorted(n for f in m.fragments for n in f) != sorted(names):
            raise ProtocolError(f"{keys.MANIFEST}: fragment plan does not cover the schema exactly once")
        if len(m.fragments) != cfg.fragments or len(m.init) != cfg.fragments:
            raise ProtocolError(f"{keys.MANIFEST}: {len(m.fragments)} fragments listed, config says {cfg.fragments}")
        return cls(manifest=m, cfg=cfg, schema=list(m.schema), digest=m.schema_digest, fragments=m.fragments)


def open_run(
    store: RunStore,
    schema: list[TensorSpec],
    read: Read,
    cfg: DiLoCo,
    *,
    learner: str,
    compression: str,
    rng: random.Random,
    create: bool = True,
) -> tuple[RunInfo, bool]:
    """Join the run in the mailbox, creating it (manifest + initial parameters) if absent; ``read``
    is read only then. Returns the run and whether this call created it. Raises
    ``RunConfigMismatch`` or ``SchemaMismatch`` before anything is trained."""
    manifest = read_manifest(store)
    created = False
    # More fragments than tensors: each fragment gets one tensor (min(fragments, tensors)), the
    # clamped config is the run's, and a node asking the same is compared with the clamp applied.
    cfg = cfg.for_tensors(len(schema))
    if manifest is None:
        if not create:
            raise ProtocolError(f"no run in this mailbox ({keys.MANIFEST} is missing)")
        upload = functools.partial(upload_values, store, read, schema, cfg, compression)
        manifest, created = create_run(store, schema, cfg, upload, learner=learner, rng=rng)
    check_schema(manifest.schema, schema)
    cfg.check_matches(manifest.config)
    return RunInfo.from_manifest(manifest), created


def initial_fragments(schema: list[TensorSpec], cfg: DiLoCo) -> list[list[str]]:
    """The fragment plan (each fragment's tensor names) of a run created with ``cfg`` over ``schema``."""
    cfg = cfg.for_tensors(len(schema))
    return plan(schema, cfg.fragments, cfg.partition)


def create_run(
    store: RunStore, schema: list[TensorSpec], cfg: DiLoCo, upload: Upload, *, learner: str, rng: random.Random
) -> tuple[Manifest, bool]:
    """Create the run: plan the fragments, refuse a plan whose records would not fit (before any
    upload), ``upload`` the initial parameters, write the manifest create-once. Returns the
    manifest and whether this call created it (else another node's, our other payloads deleted)."""
    cfg = cfg.for_tensors(len(schema))
    fragments = initial_fragments(schema, cfg)
    by_name = {s.name: tuple(int(d) for d in s.shape) for s in schema}
    check_record_size([{n: by_name[n] for n in names} for names in fragments], cfg)
    refs = upload(fragments)
    manifest = Manifest(
        run_id=f"{rng.getrandbits(64):016x}",
        created_by=learner,
        schema=schema,
        schema_digest=schema_digest(schema),
        fragments=fragments,
        config=cfg.to_dict(),
        init=refs,
    )
    outcome, existing = store.put_record(keys.MANIFEST, manifest)
    if outcome is CreateOutcome.TAKEN:
        # Another node created the run first: join theirs and drop our initial payloads,
        # except those that are theirs too (same bytes, same content-addressed key).
        theirs = store.decode_record(existing, Manifest, keys.MANIFEST)
        keep = {c.key for r in theirs.init for c in chunk_refs(r)}
        store.delete([c.key for r in refs for c in chunk_refs(r) if c.key not in keep])
        return theirs, False
    return manifest, True


def upload_values(
    store: RunStore,
    read: Read,
    schema: list[TensorSpec],
    cfg: DiLoCo,
    compression: str,
    fragments: list[list[str]],
) -> list[PayloadRef]:
    """A model's initial parameters, fragment by fragment as ``read`` gives them: one payload of a
    fragment that is one chunk of whole tensors, else its chunks (``RunStore.put_fragment``)."""
    dtypes = {s.name: s.dtype for s in schema}
    by_name = {s.name: tuple(int(d) for d in s.shape) for s in schema}
    refs: list[PayloadRef] = []
    for f, names in enumerate(fragments):
        values = read(names)
        key_for_sha = functools.partial(keys.init_blob_key, f, compression=compression)
        shapes = {n: by_name[n] for n in names}
        frag_dtypes = {n: dtypes[n] for n in names}
        if RunStore.one_payload(shapes, cfg.chunk_elements):
            data = encode_payload(values, frag_dtypes, kind="init", compression=compression)
            refs.append(store.put_payload(key_for_sha, data))
        else:
            refs.append(
                store.put_fragment(
                    key_for_sha,
                    values,
                    shapes=shapes,
                    dtypes=frag_dtypes,
                    chunk_elements=cfg.chunk_elements,
                    kind="init",
                    compression=compression,
                )
            )
    return refs


def check_record_size(shapes: list[dict[str, tuple[int, ...]]], cfg: DiLoCo) -> None:
    """Refuse (``ValueError``) a run whose checkpoint records would not fit ``MAX_RECORD_BYTES``: a
    round record names every chunk of a fragment's parameters, outer state (momentum, and the
    master unless the parameters are it) and change, one ref of about ``REF_BYTES`` each."""
    c = cfg.chunk_elements
    if c is None:
        return
    for f, frag in enumerate(shapes):
        n = len(fragment_plan(frag, c))
        # The outer state: momentum and master of every tensor (the master may be theta itself; the
        # bound counts it, so the check does not depend on the parameters' dtypes).
        outer = len(fragment_plan({f"{part}/{k}": v for part in ("momentum", "master") for k, v in frag.items()}, c))
        refs = n + outer + (n if cfg.commit_dtype is not None else 0)
        if refs > RECORD_REFS:
            elements = sum(int(np.prod(s, dtype=np.int64)) for s in frag.values())
            raise ValueError(
                f"fragment {f} ({elements} elements) is {n} chunks of chunk_elements={c}: its round records would "
                f"name {refs} chunk payloads, more than the {RECORD_REFS} a record of {MAX_RECORD_BYTES} bytes "
                "holds; raise chunk_elements or fragments"
            )


def payload_cap(run: RunInfo, f: int) -> int:
    # Every payload of a fragment is at most fp32-sized plus scales and a header.
    return 2 * run.fragment_bytes(f) + (1 << 20)


def max_payload_bytes(run: RunInfo) -> int:
    """The largest payload of the run (a fragment's outer state: momentum and master)."""
    return max(3 * payload_cap(run, f) for f in range(run.P))


def read_manifest(store: RunStore) -> Manifest | None:
    """The run's manifest, validated; None if the mailbox holds no run."""
    return store.read_record(keys.MANIFEST, Manifest)
