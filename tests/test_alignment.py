"""Alignment rules (``DiLoCo(alignment=...)``): how a commit meets the local steps a learner took
since its contribution. Overwrite drops them, Blend mixes, Carry keeps them
(``theta + (local - snapshot)``), Adaptive switches per fragment on the round's cosine. Torch (host
and device pipeline), MLX and numpy nodes write the same bits."""

from __future__ import annotations

import random

import numpy as np
import pytest
from harness import Cluster, Member

import gradientmail_core as gm
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.adapters.handles import FragmentIO
from gradientmail_core.protocol.records import RoundRecord
from gradientmail_core.protocol.store import RunStore
from gradientmail_core.syncer.bridge import CommitNotice, Publish
from gradientmail_core.syncer.host import join_run

F32 = np.float32


# ---- the config --------------------------------------------------------------------------


def test_mixing_is_blend_and_either_spelling_gives_one_config():
    a = gm.DiLoCo(sync_every=8, fragments=2, mixing=0.25)
    b = gm.DiLoCo(sync_every=8, fragments=2, alignment=gm.Blend(mixing=0.25))
    assert a == b and a.alignment == gm.Blend(mixing=0.25) and b.mixing == 0.25
    with pytest.raises(ValueError, match="pass one of them"):
        gm.DiLoCo(sync_every=8, fragments=2, mixing=0.5, alignment=gm.Blend(mixing=0.25))
    with pytest.raises(ValueError, match="mixing is gm.Blend"):
        gm.DiLoCo(sync_every=8, fragments=2, mixing=0.5, alignment=gm.Carry())


@pytest.mark.parametrize(
    "bad",
    [
        lambda: gm.Blend(mixing=1.0),
        lambda: gm.Adaptive(carry_above=0.1, overwrite_below=0.2),
        lambda: gm.Adaptive(carry_above=2),
    ],
)
def test_bad_alignment_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize("rule", [gm.Overwrite(), gm.Blend(mixing=0.5), gm.Carry(), gm.Adaptive(carry_above=0.5)])
def test_the_rule_round_trips_through_the_manifest(rule):
    cfg = gm.DiLoCo(sync_every=8, fragments=2, alignment=rule)
    assert gm.DiLoCo.from_dict(cfg.to_dict()) == cfg
    cfg.check_matches(cfg.to_dict())


def test_a_manifest_from_before_the_rules_matches_the_default():
    # Overwrite and Blend are not written (Blend is ``mixing``): older manifests compare equal.
    old = gm.DiLoCo(sync_every=8, fragments=2, mixing=0.5).to_dict()
    assert "alignment" not in old
    gm.DiLoCo(sync_every=8, fragments=2, alignment=gm.Blend(mixing=0.5)).check_matches(old)
    with pytest.raises(gm.RunConfigMismatch, match="alignment"):
        gm.DiLoCo(sync_every=8, fragments=2, alignment=gm.Carry()).check_matches(old)


def test_the_default_rule_is_adaptive_and_a_new_manifest_names_it():
    cfg = gm.DiLoCo(sync_every=8, fragments=2)
    assert cfg.alignment == gm.Adaptive(carry_above=0.3, overwrite_below=0.1)
    manifest = cfg.to_dict()
    assert manifest["alignment"] == {"kind": "adaptive", "carry_above": 0.3, "overwrite_below": 0.1}
    # Two nodes built with the same options write and accept the same manifest.
    assert gm.DiLoCo(sync_every=8, fragments=2).to_dict() == manifest
    assert gm.DiLoCo.from_dict(manifest) == cfg
    cfg.check_matches(manifest)
    with pytest.raises(gm.RunConfigMismatch, match="alignment"):
        gm.DiLoCo(sync_every=8, fragments=2, alignment=gm.Overwrite()).check_matches(manifest)


def test_a_capped_run_left_at_the_default_overwrites():
    # Under max_contributions most steps are in no commit; carrying them cost loss (bench/README.md,
    # section 6), so the default there is Overwrite, and its manifest reads back as what it is.
    cfg = gm.DiLoCo(sync_every=8, fragments=2, max_contributions=2)
    assert cfg.alignment == gm.Overwrite() and "alignment" not in cfg.to_dict()
    assert gm.DiLoCo.from_dict(cfg.to_dict()) == cfg
    named = gm.DiLoCo(sync_every=8, fragments=2, max_contributions=2, alignment=gm.Adaptive())
    assert named.alignment == gm.Adaptive()  # a rule named is kept


def test_mixing_without_a_rule_is_still_blend():
    cfg = gm.DiLoCo(sync_every=8, fragments=2, mixing=0.5)
    assert cfg.alignment == gm.Blend(mixing=0.5) and "alignment" not in cfg.to_dict()
    assert gm.DiLoCo.from_dict(cfg.to_dict()).alignment == gm.Blend(mixing=0.5)
    # An explicit Overwrite with mixing is Blend, as it always was; the default named with mixing is refused.
    assert gm.DiLoCo(sync_every=8, fragments=2, mixing=0.5, alignment=gm.Overwrite()) == cfg
    with pytest.raises(ValueError, match="mixing is gm.Blend"):
        gm.DiLoCo(sync_every=8, fragments=2, mixing=0.5, alignment=gm.Adaptive())


def test_a_manifest_without_an_alignment_reads_as_overwrite():
    # What every run created before Adaptive was the default wrote (Overwrite is still not written).
    old = gm.DiLoCo(sync_every=8, fragments=2, alignment=gm.Overwrite()).to_dict()
    assert "alignment" not in old
    assert gm.DiLoCo.from_dict(old).alignment == gm.Overwrite()
    # A node that left the rule at its default joins such a run, and follows the run's rule.
    gm.DiLoCo(sync_every=8, fragments=2).check_matches(old)
    with pytest.raises(gm.RunConfigMismatch, match="alignment"):
        gm.DiLoCo(sync_every=8, fragments=2, alignment=gm.Carry()).check_matches(old)


def test_a_node_left_at_the_default_follows_a_run_of_overwrite():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, alignment=gm.Overwrite()))
    c.join("a")
    c.cfg = gm.DiLoCo(sync_every=4, fragments=1)  # a node built after the default became Adaptive
    b = c.join("b")
    c.run(16)
    assert b.node.state.stats.committed + c.members["a"].node.state.stats.committed > 0
    assert b.learner.cfg.alignment == gm.Overwrite()  # the rule Learner.apply reads: the run's


# ---- what a commit does to the model --------------------------------------------------------


def _aligned(rule: gm.Overwrite | gm.Blend | gm.Carry | gm.Adaptive, *, contributed: bool, cosine: float | None = 0.9):
    """One learner of a 1-fragment run: publish at step 4, train 3 more steps, then a commit of
    the round arrives. Returns (parameters after, anchor, snapshot, local before, theta)."""
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, alignment=rule))
    m = c.join("a")
    anchor = {n: p.copy() for n, p in m.params.items()}
    for _ in range(4):
        m.train()
    snapshot = {n: p.copy() for n, p in m.params.items()}
    assert [p.round for p in m.learner.published] == [0]  # the 4th step published round 0
    for _ in range(3):
        m.train()
    local = {n: p.copy() for n, p in m.params.items()}
    theta = {n: (a + F32(0.5)).astype(F32) for n, a in anchor.items()}
    m.learner.apply(CommitNotice(0, 0, 1, theta, participants=("a",) if contributed else ("b",), cosine=cosine))
    return m.params, anchor, snapshot, local, theta


def test_overwrite_drops_the_local_steps():
    params, _, _, _, theta = _aligned(gm.Overwrite(), contributed=True)
    for n in theta:
        assert np.array_equal(params[n], theta[n])


def test_carry_keeps_the_steps_since_the_contribution_exactly():
    params, _, snapshot, local, theta = _aligned(gm.Carry(), contributed=True)
    for n in theta:
        want = theta[n] + (local[n] - snapshot[n])  # float32 throughout, the subtraction first
        assert want.dtype == F32 and np.array_equal(params[n], want)
        assert not np.array_equal(params[n], theta[n])


def test_carry_without_a_part_in_the_round_keeps_everything_since_the_anchor():
    params, anchor, _, local, theta = _aligned(gm.Carry(), contributed=False)
    for n in theta:
        assert np.array_equal(params[n], theta[n] + (local[n] - anchor[n]))


def test_carry_reports_the_kept_steps_in_the_next_contribution():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, alignment=gm.Carry()))
    m = c.join("a")
    for _ in range(4):
        m.train()
    assert m.learner.published
    for _ in range(3):
        m.train()
    m.learner.apply(CommitNotice(0, 0, 1, {n: p.copy() for n, p in m.params.items()}, participants=("a",)))
    assert m.learner.steps_since[0] == 3  # Overwrite would report 0: the steps are gone


@pytest.mark.parametrize("rule, dropped", [(gm.Overwrite(), 3), (gm.Blend(mixing=0.5), 1), (gm.Carry(), 0)])
def test_aligned_says_how_many_local_steps_the_alignment_discarded(rule, dropped):
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, alignment=rule))
    m = c.join("a")
    for _ in range(7):  # the 4th step published round 0; 3 more steps are local only
        m.train()
    m.learner.apply(CommitNotice(0, 0, 1, {n: p.copy() for n, p in m.params.items()}, participants=("a",)))
    (aligned,) = [e for e in m.events if isinstance(e, gm.events.Aligned)]
    assert aligned.dropped == dropped and m.learner.steps_since[0] == 3 - dropped  # Blend keeps round(1.5) = 2


@pytest.mark.parametrize("rule", [gm.Carry(), gm.Overwrite()])
def test_aligned_says_how_many_handed_over_steps_carry_keeps_when_the_contribution_missed_its_round(rule):
    # Contributions late for their round (or skipped, or cut off) are not merged; Carry keeps their
    # steps in the local delta, and the next contribution that lands merges them: goodput counts
    # them there (bench/goodput.py). Overwrite discards them with the rest.
    carry = isinstance(rule, gm.Carry)
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, alignment=rule))
    m = c.join("a")
    theta = lambda: {n: p.copy() for n, p in m.params.items()}  # noqa: E731
    published = []
    for r, merged in ((0, False), (1, False), (2, True), (3, False)):
        while not any(p.round == r for p in m.learner.bridge.outbox):
            m.train()
        published.append(m.learner.bridge.outbox[-1].steps)
        m.train()
        m.learner.apply(CommitNotice(r, 0, r + 1, theta(), participants=("a",) if merged else ("b",)))
    aligned = [e.carried for e in m.events if isinstance(e, gm.events.Aligned)]
    if carry:
        # round 0 missed: its steps ride on; round 1 missed too: both; round 2 landed: nothing; 3 missed
        assert aligned == [published[0], published[0] + published[1], 0, published[3]]
    else:
        assert aligned == [0, 0, 0, 0]


def test_carry_keeps_only_the_steps_since_a_contribution_that_landed_in_a_round_the_node_skipped():
    # b contributes to a round, then freezes (a SIGSTOP, a cut) while a commits many rounds with its
    # contribution in the first. Caught up, b's node skips to each fragment's newest record; the
    # commit descends from the one that merged b's delta, so Carry must keep only the steps since
    # that contribution: keeping all since b's anchor would merge that delta a second time.
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, alignment=gm.Carry(), quorum_size=1))
    a, b = c.join_all(["a", "b"])
    c.run(24)
    snapshots: dict[int, dict[str, np.ndarray]] = {}
    publish = b.learner.publish

    def on_publish(r: int, *, final: bool = False) -> None:
        snapshots[r] = {n: b.params[n].copy() for n in b.learner.run.fragments[r % b.learner.run.P]}
        publish(r, final=final)

    b.learner.publish = on_publish  # type: ignore[method-assign]
    while not snapshots:
        c.run(1)
    (r,) = snapshots
    b.node.tick()  # its contribution uploaded, b freezes
    b.alive = False
    for _ in range(60):
        a.train()
        c.tick_all()
        c.clock.advance(0.05)
    head = c.head()
    assert head >= r + 4 * c.cfg.fragments  # far enough behind that b's node skips records
    assert "b" in [p.learner for p in RunStore(c.mailbox).try_record(f"rounds/{r:010d}.json", RoundRecord).participants]
    f = r % c.cfg.fragments
    names = b.learner.run.fragments[f]
    local = {n: b.params[n].copy() for n in names}
    aligned: list[CommitNotice] = []
    apply = b.learner.apply

    def on_apply(notice: CommitNotice) -> None:
        aligned.append(notice)
        apply(notice)

    b.learner.apply = on_apply  # type: ignore[method-assign]
    b.alive = True
    c.tick_all()
    (notice,) = [x for x in aligned if x.fragment == f]
    assert notice.round > r + 1 and "b" not in notice.participants and notice.landed == r
    for n in names:
        want = np.add(notice.theta[n], np.subtract(local[n], snapshots[r][n], dtype=F32), dtype=F32)
        assert np.array_equal(b.params[n], want), n


def test_adaptive_switches_per_fragment_with_hysteresis():
    rule = gm.Adaptive(carry_above=0.5, overwrite_below=0.1)
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, alignment=rule))
    m = c.join("a")
    decisions = []
    for cosine in (0.3, 0.6, 0.3, None, 0.05, 0.3, 0.9):
        decisions.append(m.learner._carries(CommitNotice(0, 0, 1, {}, cosine=cosine)))
    # starts on Overwrite; 0.6 switches to Carry; 0.3 and None keep it; 0.05 switches back; 0.9 again
    assert decisions == [False, True, True, True, False, False, True]


@pytest.mark.parametrize(
    "rule, carries",
    [
        (gm.Adaptive(carry_above=0.999, overwrite_below=-0.999), True),  # between the thresholds: Carry
        (gm.Adaptive(carry_above=0.9999, overwrite_below=0.999), False),  # at or below overwrite_below
    ],
)
def test_adaptive_starts_a_learner_joining_a_run_under_way_on_the_rule_its_newest_commit_implies(rule, carries):
    # The learners that ran through the run's early, agreeing rounds carry once the cosines fall
    # between the thresholds; one restarted there must not start on Overwrite (and keep dropping
    # its in-flight steps for the rest of the run, bench/README.md section 16).
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, alignment=rule))
    c.join_all(["a", "b"])
    c.run(40)
    newest = c.members["a"].node.state.newest
    assert set(newest) == {0, 1} and all(rec.cosine is not None for rec in newest.values())
    cosines = {f: rec.cosine for f, rec in newest.items()}
    assert all(rule.overwrite_below < x < rule.carry_above for x in cosines.values()) == carries, cosines
    # join_run, as a process joining (or restarting into) the run does
    adapter = NumpyAdapter({n: p.copy() for n, p in c.members["a"].params.items()})
    events: list = []
    _, learner = join_run(
        RunStore(c.mailbox),
        adapter,
        c.cfg,
        c.clock,
        learner="late",
        nonce="0000abcd",
        emit=events.append,
        options=c.options,
        rng=random.Random(5),
    )
    assert learner._carrying == {0: carries, 1: carries}
    m = c.join("later")  # the tests' harness joins the same way
    assert m.learner._carrying == {0: carries, 1: carries}


def _watch_alignment(m: Member) -> tuple[list[bool], list[Publish]]:
    """Checks every commit ``m``'s learner aligns with against ``theta + (local - snapshot)``,
    computed here (float32, the subtraction first): ``snapshot`` is the fragment as ``m`` trained
    it up to its contribution to the committed round (recorded as its learner publishes), or its
    anchor if it has no part in the round. Returns, per commit, whether steps were kept (the
    parameters had moved since the snapshot), and the contributions the learner handed its node."""
    learner, kept, sent = m.learner, [], []
    snapshots: dict[int, dict[str, np.ndarray]] = {}
    publish, apply, hand_over = learner.publish, learner.apply, learner.bridge.publish

    def on_publish(r: int, *, final: bool = False) -> None:
        snapshots[r] = {n: m.params[n].copy() for n in learner.run.fragments[r % learner.run.P]}
        publish(r, final=final)

    def on_apply(c: CommitNotice) -> None:
        names = learner.run.fragments[c.fragment]
        fresh = c.version > learner.versions.get(c.fragment, -1)
        local = {n: m.params[n].copy() for n in names}
        base = snapshots[c.round] if m.name in c.participants else dict(learner.anchors[c.fragment])
        apply(c)
        if fresh:
            for n in names:
                want = np.add(c.theta[n], np.subtract(local[n], base[n], dtype=F32), dtype=F32)
                assert np.array_equal(m.params[n], want), (m.name, c.round, n)
            kept.append(any(not np.array_equal(local[n], base[n]) for n in names))

    def on_hand_over(p: Publish) -> None:
        sent.append(p)
        hand_over(p)

    learner.publish, learner.apply = on_publish, on_apply  # type: ignore[method-assign]
    learner.bridge.publish = on_hand_over  # type: ignore[method-assign]
    return kept, sent


def test_learners_with_carry_keep_the_steps_since_their_contribution_at_every_commit_of_a_run():
    c = Cluster(gm.DiLoCo(sync_every=8, fragments=2, alignment=gm.Carry(), quorum_size=2, overlap_steps=0))
    a, b = c.join_all(["a", "b"])
    watched = {m.name: _watch_alignment(m) for m in (a, b)}
    # The nodes poll every third step, so a commit finds its learners a step or two past their
    # contributions: the steps Carry keeps (Overwrite would drop them).
    for step in range(48):
        for m in (a, b):
            m.train()
        if step % 3 == 2:
            c.tick_all()
            c.clock.advance(0.05)
    c.settle()
    assert c.head() >= 9
    for name, (steps_kept, sent) in watched.items():
        assert len(steps_kept) >= 10 and sum(steps_kept) >= 8, (name, steps_kept)
        # Each contribution reports the steps its delta carries: with Carry nothing is dropped,
        # so every step since the learner's previous contribution of the fragment (4 samples each).
        last = dict.fromkeys(range(c.cfg.fragments), 0)
        assert len(sent) >= 10
        for p in sent:
            assert (p.steps, p.tokens) == (p.local_step - last[p.fragment], 4 * (p.local_step - last[p.fragment])), p
            last[p.fragment] = p.local_step
    for m in (a, b):
        c.close(m)
    for n in a.params:
        assert np.array_equal(a.params[n], b.params[n])


# ---- the same bits from every adapter ----------------------------------------------------------


def _carry_through(io: FragmentIO, read, set_local, anchor, snapshot_local, local, theta, contributed: bool):
    set_local(anchor)
    io.stage(anchor).write()  # the device pipeline's anchor is what it last aligned with
    set_local(snapshot_local)
    since = io.capture(list(theta), anchor)
    set_local(local)
    io.stage(theta).carry(since if contributed else None, anchor)
    return read()


def _values(seed: int, shapes, dtype_of) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: dtype_of(n, (rng.standard_normal(s) * 3).astype(F32)) for n, s in shapes.items()}


@pytest.mark.parametrize("contributed", [True, False])
def test_torch_host_device_and_mlx_carry_to_the_same_bits(contributed):
    torch = pytest.importorskip("torch")
    from gradientmail_core.adapters.torch import TorchAdapter

    shapes = {"w": (33, 7), "b": (7,), "h": (40,)}
    dtypes = {"w": torch.float32, "b": torch.bfloat16, "h": torch.float16}
    np_dtypes = {"w": np.float32, "b": None, "h": np.float16}

    def representable(n: str, v: np.ndarray) -> np.ndarray:
        # values each parameter dtype holds exactly (a theta is decoded from the parameter's dtype)
        return torch.from_numpy(v).to(dtypes[n]).float().numpy()

    anchor = _values(1, shapes, representable)
    theta = _values(2, shapes, representable)
    snapshot_local = _values(3, shapes, representable)
    local = _values(4, shapes, representable)

    results = []
    for pipeline in (False, True):
        model = torch.nn.Module()
        for n, s in shapes.items():
            model.register_parameter(n, torch.nn.Parameter(torch.zeros(s, dtype=dtypes[n])))
        adapter = TorchAdapter(model, device_pipeline=pipeline)

        def set_local(values, model=model):
            with torch.no_grad():
                for n, v in values.items():
                    getattr(model, n).copy_(torch.from_numpy(v))

        def read(model=model):
            return {n: getattr(model, n).detach().float().numpy().copy() for n in shapes}

        results.append(
            _carry_through(FragmentIO(adapter), read, set_local, anchor, snapshot_local, local, theta, contributed)
        )

    mx = pytest.importorskip("mlx.core")
    nn = pytest.importorskip("mlx.nn")
    from gradientmail_core.adapters.mlx import MLXAdapter

    mx_dtypes = {"w": mx.float32, "b": mx.bfloat16, "h": mx.float16}

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            for n, s in shapes.items():
                setattr(self, n, mx.zeros(s, dtype=mx_dtypes[n]))

    mlx_model = M()
    adapter = MLXAdapter(mlx_model)

    def set_mlx(values):
        mlx_model.update({n: mx.array(v).astype(mx_dtypes[n]) for n, v in values.items()})

    def read_mlx():
        return {n: np.array(getattr(mlx_model, n).astype(mx.float32)) for n in shapes}

    results.append(
        _carry_through(FragmentIO(adapter), read_mlx, set_mlx, anchor, snapshot_local, local, theta, contributed)
    )

    # and the plain numpy adapter (float32 parameters) on the float32 tensor
    params = {"w": np.zeros(shapes["w"], F32)}
    np_io = FragmentIO(NumpyAdapter(params))
    np_out = _carry_through(
        np_io,
        lambda: {"w": params["w"].copy()},
        lambda v: params["w"].__setitem__(..., v["w"]),
        {"w": anchor["w"]},
        {"w": snapshot_local["w"]},
        {"w": local["w"]},
        {"w": theta["w"]},
        contributed,
    )
    base = snapshot_local if contributed else anchor
    for out in results:
        for n in shapes:
            assert np.array_equal(out[n], results[0][n]), n
    assert np.array_equal(np_out["w"], results[0]["w"])
    assert np.array_equal(results[0]["w"], theta["w"] + (local["w"] - base["w"]))
    del np_dtypes
