"""Golden runs: small deterministic lockstep runs whose records and payload bytes are pinned.

Each ``Case`` below is a run of 2-4 learners (numpy models of a few hundred elements) over one
``MemoryMailbox`` and one ``FakeClock``, joined through ``join_run`` and driven single-threaded:
every live learner takes a training step (a seeded move toward a target), then every node polls
once (``node.tick``) and its learner takes in what committed, then the clock moves 0.05 s. A
learner that is done leaves as ``Session.close`` does (final contributions with
``flush_on_close``, its rounds in flight committed, the newest parameters loaded, its lease
released). Nothing reads the wall clock, no thread is started by the driver, every random draw is
seeded: a run gives the same bytes on every machine, in every process, under any
``PYTHONHASHSEED``.

What a golden file (``tests/golden/runs/<case>.json``) pins, taken from what the run wrote:

- ``rounds``: every round record on the tape, in round order, as its canonical JSON (the stored
  bytes are checked to be exactly the canonical JSON of what is kept here);
- ``payloads``: every payload object (``blobs/``: initial parameters, contributions, thetas, outer
  states, changes, every chunk of each) ever written, key -> sha256 and size, including those
  garbage collection deleted since; ``kept``: the payload keys still in the store at the end;
- ``snapshots``: every snapshot record ever written, key -> sha256 of its bytes;
- ``manifest``: the run's manifest; ``params``: each learner's final parameters, one sha256.

The test (``tests/test_golden.py``) runs every case again and compares.

Recorded from the engine before its closers became one (the whole-fragment closer, the chunk
closer and the sharded closer, 6432b87); the one merger (``syncer/merger.py``) commits these bytes.
Not run here: a sharded node's ranks (torch.distributed; ``tests/test_sharded_closer.py`` holds
their commits to a one-process closer's).

These bytes pin today's numerics and wire format: the merge (whole fragments, chunk by chunk),
the outer step, the quantizers, error feedback, clipping, outlier rejection, checkpoints,
alignment. NEVER regenerate them to make a refactor pass. A change to these bytes is a change of
the wire format or of the numerics, and needs its own justification, in its own commit, saying
which case changed and why. Regenerating is a deliberate act::

    PYTHONPATH=. python tests/golden_runs.py --write            # every case
    PYTHONPATH=. python tests/golden_runs.py --write CASE ...   # these cases
    PYTHONPATH=. python tests/golden_runs.py                     # compare only, print differences
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import gradientmail_core as gm
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.clock import FakeClock
from gradientmail_core.mailbox.forwarding import ForwardingMailbox
from gradientmail_core.mailbox.memory import MemoryMailbox
from gradientmail_core.protocol import keys
from gradientmail_core.protocol.records import RoundRecord, Snapshot, TensorSpec, canonical_json, decode
from gradientmail_core.protocol.run import RunInfo
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.host import join_run
from gradientmail_core.syncer.learner import Learner
from gradientmail_core.syncer.node import Node
from gradientmail_core.syncer.options import NodeOptions

RUNS = Path(__file__).parent / "golden" / "runs"
F32 = np.float32

# A model with an embedding (RDA merges it by the weighted mean) and tensors of 16 to 256
# elements: with chunk_elements 32 or 64 a fragment is several chunks and most tensors are split
# between chunks; with 64, one chunk holds the end of a tensor and a whole small one.
EMBED = {
    "embed.weight": (12, 16),
    "layers.0.w": (10, 13),
    "layers.1.w": (16, 16),
    "layers.1.b": (16,),
    "head.w": (7, 15),
}
# No tensor matches RDA's direct pattern: every tensor is merged radially.
PLAIN = {"layers.0.w": (9, 20), "layers.0.b": (20,), "layers.1.w": (11, 11), "layers.2.w": (6, 40)}

DT = 0.05  # clock seconds per lockstep iteration
MAX_ITERATIONS = 2000  # a run that has not ended by then is broken (raised, never recorded)


@dataclass(frozen=True)
class Case:
    """One golden run. ``steps``: training steps of each learner (a learner missing from it trains
    ``default_steps``), after which it leaves. ``loud``: learners whose training noise is scaled by
    ``loudness`` (outlier and clipping cases). ``param_dtypes``: tensors whose schema dtype is not F32."""

    name: str
    covers: str
    cfg: gm.DiLoCo
    shapes: dict[str, tuple[int, ...]] = field(default_factory=lambda: dict(EMBED))
    learners: str = "abc"
    default_steps: int = 16
    steps: dict[str, int] = field(default_factory=dict)
    compression: str = ""
    loud: str = ""
    loudness: float = 1.0
    param_dtypes: dict[str, str] = field(default_factory=dict)
    expect: tuple[str, ...] = ()  # what ``coverage`` must find in the run (``tests/test_golden.py``)


def _cfg(**kw: Any) -> gm.DiLoCo:
    kw.setdefault("chunk_elements", None)
    if "mixing" not in kw:
        kw.setdefault("alignment", gm.Overwrite())  # the default when these were recorded
    return gm.DiLoCo(**kw)


CASES: tuple[Case, ...] = (
    Case(
        "whole_f32_rda_embed",
        "whole fragments, F32 deltas, RDA with a direct (embedding) tensor, 2 fragments, 3 learners",
        _cfg(sync_every=4, fragments=2, quorum_size=3, delta_dtype="F32"),
        expect=("whole", "direct"),
    ),
    Case(
        "chunked_f32_rda_embed",
        "the same run in chunks of 32 elements (every tensor split), RDA with a direct tensor",
        _cfg(sync_every=4, fragments=2, quorum_size=3, delta_dtype="F32", chunk_elements=32),
        expect=("chunked", "split", "direct"),
    ),
    Case(
        "whole_bf16_weighted_mean_zstd",
        "whole fragment, BF16 deltas, WeightedMean, zstd payloads, 1 fragment, 2 learners",
        _cfg(sync_every=4, fragments=1, quorum_size=2, delta_dtype="BF16", merge=gm.WeightedMean()),
        learners="ab",
        compression="zstd",
        expect=("whole", "zstd"),
        default_steps=20,
    ),
    Case(
        "chunked_bf16_weighted_mean_zstd",
        "chunks of 64, BF16 deltas, WeightedMean, zstd payloads, 1 fragment, 2 learners",
        _cfg(sync_every=4, fragments=1, quorum_size=2, delta_dtype="BF16", merge=gm.WeightedMean(), chunk_elements=64),
        learners="ab",
        compression="zstd",
        expect=("chunked", "split", "zstd"),
        default_steps=20,
    ),
    Case(
        "whole_f4_p3",
        "whole fragments, F4 (E2M1) deltas, RDA, 3 fragments, 4 learners",
        _cfg(sync_every=6, fragments=3, quorum_size=4, delta_dtype="F4"),
        learners="abcd",
        expect=("whole", "direct"),
        default_steps=24,
    ),
    Case(
        "chunked_f4_p3",
        "chunks of 64, F4 (E2M1) deltas, RDA, 3 fragments, 4 learners, Strided partition",
        _cfg(sync_every=6, fragments=3, quorum_size=4, delta_dtype="F4", chunk_elements=64, partition=gm.Strided()),
        learners="abcd",
        shapes=dict(PLAIN),
        expect=("chunked", "split"),
        default_steps=24,
    ),
    Case(
        "whole_i2_error_feedback",
        "whole fragments, I2 deltas with error feedback, RDA, 2 fragments",
        _cfg(sync_every=4, fragments=2, quorum_size=3, delta_dtype="I2", error_feedback=True),
        expect=("whole",),
    ),
    Case(
        "chunked_i2_error_feedback_commit_i2",
        "chunks of 64, I2 deltas with error feedback, I2 commits (changes), 2 fragments",
        _cfg(
            sync_every=4,
            fragments=2,
            quorum_size=3,
            delta_dtype="I2",
            commit_dtype="I2",
            error_feedback=True,
            chunk_elements=64,
        ),
        expect=("chunked", "split", "change"),
    ),
    Case(
        "whole_outlier",
        "whole fragment, outlier_factor 3 with one learner's delta far larger: rejected as an outlier",
        _cfg(sync_every=4, fragments=1, quorum_size=4, outlier_factor=3.0),
        learners="abcd",
        loud="d",
        loudness=40.0,
        expect=("whole", "outlier"),
    ),
    Case(
        "chunked_outlier",
        "chunks of 64, outlier_factor 3, one learner far larger (rejected), 2 fragments, BF16 deltas",
        _cfg(sync_every=4, fragments=2, quorum_size=4, outlier_factor=3.0, delta_dtype="BF16", chunk_elements=64),
        learners="abcd",
        loud="d",
        loudness=40.0,
        expect=("chunked", "split", "outlier"),
    ),
    Case(
        "whole_clip_weighted_mean",
        "whole fragments, clip_norm between the deltas' norms (some clipped, some not), WeightedMean, 2 fragments",
        _cfg(sync_every=4, fragments=2, quorum_size=3, clip_norm=3.0, merge=gm.WeightedMean()),
        loud="c",
        loudness=5.0,
        expect=("whole", "clipped"),
    ),
    Case(
        "chunked_clip_rda",
        "chunks of 64, clip_norm between the deltas' norms (some clipped, some not), RDA with a direct tensor, "
        "2 fragments",
        _cfg(sync_every=4, fragments=2, quorum_size=3, clip_norm=3.0, chunk_elements=64),
        loud="c",
        loudness=5.0,
        expect=("chunked", "split", "clipped", "direct"),
    ),
    Case(
        "whole_commit_bf16_checkpoint3",
        "whole fragment, BF16 commits (changes), a checkpoint every 3rd version, 1 fragment",
        _cfg(sync_every=4, fragments=1, quorum_size=3, commit_dtype="BF16", checkpoint_every=3),
        default_steps=32,
        expect=("whole", "change", "between_checkpoints"),
    ),
    Case(
        "chunked_commit_f8_checkpoint2",
        "chunks of 64, F8_E4M3 deltas and commits (a tensor-wide scale over split tensors), "
        "a checkpoint every 2nd version, 2 fragments; the closer leaves early, the next one replays "
        "from the checkpoint chunk by chunk",
        _cfg(
            sync_every=4,
            fragments=2,
            quorum_size=3,
            delta_dtype="F8_E4M3",
            commit_dtype="F8_E4M3",
            checkpoint_every=2,
            chunk_elements=64,
        ),
        default_steps=20,
        steps={"a": 10},
        expect=("chunked", "split", "change", "between_checkpoints", "takeover"),
    ),
    Case(
        "chunked_commit_f4",
        "chunks of 64, F16 deltas, F4 commits (changes), 2 fragments",
        _cfg(sync_every=4, fragments=2, quorum_size=3, delta_dtype="F16", commit_dtype="F4", chunk_elements=64),
        expect=("chunked", "split", "change"),
    ),
    Case(
        "whole_carry_quorum2",
        "whole fragments, Carry alignment, quorum 2 of 3 learners (one a step behind), 2 fragments",
        _cfg(sync_every=4, fragments=2, quorum_size=2, alignment=gm.Carry()),
        steps={"c": 15},
        expect=("whole",),
    ),
    Case(
        "chunked_mixing",
        "chunks of 64, mixing 0.25 (Blend), BF16 deltas, 2 fragments",
        _cfg(sync_every=4, fragments=2, quorum_size=3, mixing=0.25, delta_dtype="BF16", chunk_elements=64),
        expect=("chunked", "split"),
    ),
    Case(
        "chunked_adaptive",
        "chunks of 64, Adaptive alignment (carry while the cosine is high), 1 fragment",
        _cfg(sync_every=4, fragments=1, quorum_size=3, alignment=gm.Adaptive(carry_above=0.2), chunk_elements=64),
        expect=("chunked", "split"),
        default_steps=20,
    ),
    Case(
        "chunked_leave_flush_zstd",
        "chunks of 64, flush_on_close: c leaves early with final contributions, the rest end with "
        "final rounds; zstd payloads, 2 fragments",
        _cfg(sync_every=4, fragments=2, quorum_size=3, flush_on_close=True, chunk_elements=64),
        default_steps=29,
        steps={"c": 10},
        compression="zstd",
        expect=("chunked", "split", "final_snapshot", "final_round", "zstd"),
    ),
    Case(
        "whole_leave_flush_takeover_f4_checkpoint2",
        "whole fragments, flush_on_close: the closer (a) leaves early with final contributions and is "
        "taken over, the rest end with final rounds; F4 commits, a checkpoint every 2nd version, 3 fragments",
        _cfg(sync_every=6, fragments=3, quorum_size=3, commit_dtype="F4", checkpoint_every=2, flush_on_close=True),
        steps={"a": 13},
        default_steps=27,
        expect=("whole", "change", "between_checkpoints", "takeover", "final_snapshot", "final_round"),
    ),
    Case(
        "chunked_bf16_params_mixed_chunks",
        "chunks of 256 over parameters stored in BF16 and F16 (the master written beside theta), "
        "F8_E4M3 deltas, 3 fragments: some fragments one chunk, some several",
        _cfg(sync_every=6, fragments=3, quorum_size=3, delta_dtype="F8_E4M3", chunk_elements=256),
        param_dtypes={"layers.1.w": "BF16", "embed.weight": "BF16", "head.w": "F16"},
        expect=("chunked", "split", "one_chunk_fragment", "master"),
        default_steps=24,
    ),
)

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"


# ---- the run ----------------------------------------------------------------------------------


class Recording(ForwardingMailbox):
    """Keeps every payload, snapshot and round record written through it (what garbage collection
    deletes later too). Content-addressed and create-once: a key is never given two contents."""

    PREFIXES = (keys.BLOBS, keys.SNAPSHOTS, keys.ROUNDS, keys.MANIFEST)

    def __init__(self, inner: MemoryMailbox) -> None:
        super().__init__(inner)
        self.written: dict[str, bytes] = {}

    def _keep(self, key: str, data: bytes) -> None:
        if key.startswith(self.PREFIXES):
            old = self.written.setdefault(key, data)
            assert old == data, f"{key} written twice with different bytes"

    def put_if_absent(self, key: str, data: bytes) -> bool:
        ok = self.inner.put_if_absent(key, data)
        if ok:
            self._keep(key, bytes(data))
        return ok

    def put_stream(self, key: str, chunks: Iterable[Any], *, create_once: bool = False) -> bool:
        data = b"".join(bytes(c) for c in chunks)
        ok = self.inner.put_stream(key, [data], create_once=create_once)
        if ok:
            self._keep(key, data)
        return ok


class TypedAdapter(NumpyAdapter):
    """A numpy model whose schema gives some tensors a 16-bit dtype (the values stay float32)."""

    def __init__(self, params: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
        super().__init__(params)
        self.dtypes = dtypes

    def schema(self) -> list[TensorSpec]:
        return [TensorSpec(name=s.name, dtype=self.dtypes.get(s.name, "F32"), shape=s.shape) for s in super().schema()]


@dataclass
class _Member:
    name: str
    params: dict[str, np.ndarray]
    node: Node
    learner: Learner
    rng: np.random.Generator
    target: dict[str, np.ndarray]
    steps: int
    noise: F32
    trained: int = 0
    flushes: int = 0  # final contributions still to hand over (``Session._flush``)
    leaving: bool = False
    alive: bool = True

    def train(self) -> None:
        """One deterministic 'optimizer step': a tenth of the way to the target, plus seeded noise."""
        for n, p in self.params.items():
            noise = self.rng.standard_normal(p.shape).astype(F32)
            p -= F32(0.1) * (p - self.target[n]) + self.noise * noise
        self.learner.step(4)
        self.trained += 1


def _params(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(F32) for n, s in shapes.items()}


def _join(case: Case, mailbox: Recording, clock: FakeClock, name: str, seed: int) -> _Member:
    params = _params(100 + seed, case.shapes)
    adapter = TypedAdapter(params, case.param_dtypes)
    options = NodeOptions(poll_interval=0.1, lease_timeout=2.0, round_timeout=1.0, compression=case.compression)
    node, learner = join_run(
        RunStore(mailbox),
        adapter,
        case.cfg,
        clock,
        learner=name,
        nonce=f"{seed + 1:08x}",
        emit=lambda e: None,
        options=options,
        rng=random.Random(seed),
    )
    noise = F32(0.01 * (case.loudness if name in case.loud else 1.0))
    steps = case.steps.get(name, case.default_steps)
    return _Member(name, params, node, learner, np.random.default_rng(seed), _params(7, case.shapes), steps, noise)


def _leave_step(m: _Member) -> None:
    """One poll's worth of ``Session.close`` for a learner done training: hand over its final
    contributions (``flush_on_close``), wait for its rounds in flight, then leave."""
    lr, view = m.learner, m.node.bridge.view
    lr.drain()
    while lr.published and lr.published[0].round <= view.head:
        lr.published.popleft()
    assert lr.cfg.in_flight is not None
    if m.flushes:
        if lr.next_round - lr.aligned <= lr.cfg.in_flight or lr.next_round <= view.head:
            lr.maybe_publish(final=True)
            m.flushes -= 1
        return
    if lr.maybe_publish() or lr.published:
        return
    m.node.bridge.leaving = True
    lr.drain()
    lr.write_newest()
    m.node.leave()
    m.alive = False


@dataclass
class Outcome:
    """A run's golden values (``golden``) and what the coverage checks read (never stored)."""

    golden: dict[str, Any]
    run: RunInfo
    records: list[RoundRecord]
    snapshots: list[Snapshot]
    blobs: dict[str, bytes]


def run_case(case: Case) -> Outcome:
    mailbox, clock = Recording(MemoryMailbox()), FakeClock()
    members = [_join(case, mailbox, clock, name, seed) for seed, name in enumerate(case.learners)]
    for m in members:
        m.node.state.list_leases(
            m.node.store
        )  # every node sees every lease before the first step (``Session.wait_for``)
    for _ in range(MAX_ITERATIONS):
        live = [m for m in members if m.alive]
        if not live:
            break
        for m in live:
            if m.trained < m.steps:
                m.train()
            elif not m.leaving:
                m.leaving = True
                m.flushes = m.node.run.P if case.cfg.flush_on_close else 0
        for m in live:
            m.node.tick()
            m.learner.drain()
            if m.leaving:
                _leave_step(m)
        clock.advance(DT)
    else:
        raise AssertionError(f"{case.name}: the run did not end in {MAX_ITERATIONS} iterations")
    return _outcome(case, mailbox, members)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def params_digest(params: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for n in sorted(params):
        p = np.ascontiguousarray(params[n])
        h.update(f"{n}|{p.dtype.str}|{p.shape}|".encode())
        h.update(p.tobytes())
    return h.hexdigest()


def _outcome(case: Case, mailbox: Recording, members: list[_Member]) -> Outcome:
    written = mailbox.written
    round_keys = sorted(k for k in written if k.startswith(keys.ROUNDS))
    assert round_keys == mailbox.list(keys.ROUNDS), "the tape is kept whole"
    rounds, records = [], []
    for k in round_keys:
        data = written[k]
        as_json = json.loads(data)
        assert canonical_json(as_json) == data, f"{k} is not canonical JSON"
        rounds.append(as_json)
        records.append(decode(data, RoundRecord, key=k))
    assert [r.round for r in records] == list(range(len(records))), "the tape has no gaps"
    snapshot_keys = sorted(k for k in written if k.startswith(keys.SNAPSHOTS))
    blob_keys = sorted(k for k in written if k.startswith(keys.BLOBS))
    golden = {
        "case": case.name,
        "covers": case.covers,
        "manifest": json.loads(written[keys.MANIFEST]),
        "rounds": rounds,
        "snapshots": {k: _sha(written[k]) for k in snapshot_keys},
        "payloads": {k: {"sha256": _sha(written[k]), "size": len(written[k])} for k in blob_keys},
        "kept": mailbox.list(keys.BLOBS),
        "params": {m.name: params_digest(m.params) for m in members},
    }
    return Outcome(
        golden=golden,
        run=members[0].node.run,
        records=records,
        snapshots=[decode(written[k], Snapshot, key=k) for k in snapshot_keys],
        blobs={k: written[k] for k in blob_keys},
    )


# ---- comparing ----------------------------------------------------------------------------------


# The order differences are reported in: the tape first (the first differing field of the first
# differing round record says the most), then what follows from it.
SECTIONS = ("manifest", "rounds", "payloads", "snapshots", "kept", "params")


def differences(expected: dict[str, Any], got: dict[str, Any], per_section: int = 3) -> list[str]:
    """Where ``got`` differs from ``expected`` (two golden dicts), section by section: how many
    entries differ, then the first ``per_section`` places, each as ``path: expected X, got Y``
    (a path like ``rounds[3].participants[1].weight``: round 3's first participant's weight)."""
    out: list[str] = []
    for k in [*SECTIONS, *sorted((set(expected) | set(got)) - set(SECTIONS))]:
        a, b = expected.get(k), got.get(k)
        if a == b:
            continue
        if isinstance(a, dict | list) and isinstance(b, dict | list) and type(a) is type(b):
            out.append(f"{k}: {_count(a, b)} of {len(a)} entries differ")
        found: list[str] = []
        _diff(a, b, k, found, per_section)
        out += found
    return out


def _count(a: dict[str, Any] | list[Any], b: dict[str, Any] | list[Any]) -> int:
    if isinstance(a, dict) and isinstance(b, dict):
        return sum(a.get(k) != b.get(k) for k in set(a) | set(b))
    assert isinstance(a, list) and isinstance(b, list)
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def _diff(a: Any, b: Any, path: str, out: list[str], limit: int) -> None:
    if len(out) >= limit:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            where = f"{path}.{k}"
            if k not in b:
                out.append(f"{where}: missing (expected {_short(a[k])})")
            elif k not in a:
                out.append(f"{where}: unexpected (got {_short(b[k])})")
            else:
                _diff(a[k], b[k], where, out, limit)
            if len(out) >= limit:
                return
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} entries expected, got {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, limit)
            if len(out) >= limit:
                return
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: expected {_short(a)}, got {_short(b)}")


def _short(v: Any) -> str:
    s = json.dumps(v, sort_keys=True)
    return s if len(s) <= 160 else s[:157] + "..."


def golden_path(name: str) -> Path:
    return RUNS / f"{name}.json"


def dump(golden: dict[str, Any]) -> str:
    """Sorted keys, one level of indent per level of nesting; a container of scalars that fits on
    a line (a payload ref, a participant) is written on one line: the files stay readable and half
    the size of ``json.dumps(indent=1)``'s."""
    return _format(golden, 0) + "\n"


def _format(v: Any, level: int) -> str:
    flat = json.dumps(v, sort_keys=True)
    nested = isinstance(v, dict | list) and any(isinstance(x, dict | list) and x for x in _values(v))
    if not isinstance(v, dict | list) or (not nested and len(flat) <= 300):
        return flat
    pad = " " * (level + 1)
    if isinstance(v, dict):
        items = [f"{pad}{json.dumps(k)}: {_format(v[k], level + 1)}" for k in sorted(v)]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    return "[\n" + ",\n".join(pad + _format(x, level + 1) for x in v) + "\n" + " " * level + "]"


def _values(v: dict[str, Any] | list[Any]) -> Iterable[Any]:
    return v.values() if isinstance(v, dict) else v


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="write the golden files (a deliberate act: see above)")
    parser.add_argument("cases", nargs="*", help="case names (default: every case)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.cases if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {sorted(BY_NAME)}")
    failed = 0
    for case in [BY_NAME[n] for n in args.cases] or list(CASES):
        golden = run_case(case).golden
        path = golden_path(case.name)
        if args.write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(dump(golden))
            print(f"wrote {path}")
            continue
        if not path.exists():
            print(f"{case.name}: no golden file at {path}")
            failed += 1
            continue
        diffs = differences(json.loads(path.read_text()), golden)
        print(f"{case.name}: {'ok' if not diffs else 'DIFFERS'}")
        for d in diffs:
            print(f"    {d}")
        failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
