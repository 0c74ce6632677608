"""Error feedback (``DiLoCo(error_feedback=True)``, ``adapters/feedback.py``): the residual's
arithmetic, its way back into the parameters when its delta was merged (and only there: sent
again where the inner steps leave the parameters, not where they pull them back), its rules when
a delta is retried or not merged, what bf16 parameters cannot hold of it, that it is off byte for
byte when off, the same bytes from numpy, torch (host and device pipeline) and MLX, and the
closer's own handling of its commits' rounding error."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from harness import Cluster

import gradientmail_core as gm
from gradientmail_core.adapters.base import NumpyAdapter
from gradientmail_core.adapters.feedback import quantize_with_residual
from gradientmail_core.adapters.handles import FragmentIO
from gradientmail_core.codec import quant
from gradientmail_core.codec.payload import decode_payload, encode_payload
from gradientmail_core.mailbox.forwarding import ForwardingMailbox
from gradientmail_core.protocol.rebuild import rebuild_theta

F32 = np.float32
HAS_TORCH = importlib.util.find_spec("torch") is not None


def sent(q: dict) -> dict[str, np.ndarray]:
    return {n: quant.dequantize(v) for n, v in q.items()}


# ---- the residual's arithmetic -------------------------------------------------------------


def test_a_bf16_delta_below_half_an_ulp_goes_out_once_the_residual_reaches_it():
    # 1 + 2**-10 is 1.0 in bfloat16 (an ulp is 2**-7 there); each round carries 2**-10 more, until
    # the fifth sends 1 + 2**-7 (the fourth is a tie at 1 + 2**-8, rounded to even: 1.0), which
    # leaves -3 x 2**-10; three more rounds of 1.0 pay it back.
    d = {"w": np.array([1 + 2**-10], F32)}
    residual, out = None, []
    for _ in range(8):
        q, residual = quantize_with_residual(d, residual, {"w": "BF16"})
        out.append(float(sent(q)["w"][0]))
    assert out == [1.0, 1.0, 1.0, 1.0, 1 + 2**-7, 1.0, 1.0, 1.0]
    assert residual["w"][0] == 0  # 8 x (1 + 2**-10) - sum(out)
    assert np.mean(out) == 1 + 2**-10


@pytest.mark.parametrize("dtype", ["I2", "F4", "F8_E4M3", "F16"])
def test_the_residual_is_the_fed_delta_minus_what_was_sent(dtype):
    rng = np.random.default_rng(0)
    d = {"a": rng.standard_normal(100).astype(F32), "b": rng.standard_normal((3, 7)).astype(F32)}
    dtypes = dict.fromkeys(d, dtype)
    q1, r1 = quantize_with_residual(d, None, dtypes)
    for n in d:  # the first delta has nothing to carry: exactly the plain quantization
        assert quant.quantize(d[n], dtype).data.tobytes() == q1[n].data.tobytes()
        assert np.array_equal(r1[n], d[n] - quant.dequantize(q1[n]))
    q2, r2 = quantize_with_residual(d, r1, dtypes)
    for n in d:
        x = d[n] + r1[n]
        assert quant.quantize(x, dtype).data.tobytes() == q2[n].data.tobytes()
        assert np.array_equal(r2[n], x - quant.dequantize(q2[n]))


def test_non_finite_entries_leave_no_residual_and_f32_tensors_none():
    d = {"w": np.array([1.0, np.inf, np.nan, 0.3] + [0.1] * 28, F32), "f": np.ones(3, F32)}
    _, r = quantize_with_residual(d, None, {"w": "F4", "f": "F32"})
    assert np.isfinite(r["w"]).all() and "f" not in r  # the inf/NaN block decodes to NaN: reset to 0
    assert (r["w"] == 0).all()


@pytest.mark.parametrize("dtype", ["I2", "F4"])
def test_the_mean_of_fed_back_deltas_converges_to_the_true_delta(dtype):
    rng = np.random.default_rng(1)
    d = {"w": (1e-3 * rng.standard_normal(4096)).astype(F32)}
    rounds = 200
    residual, total = None, np.zeros(4096, np.float64)
    for _ in range(rounds):
        q, residual = quantize_with_residual(d, residual, {"w": dtype})
        total += sent(q)["w"]
    fed = np.abs(total / rounds - d["w"]).max()
    plain = np.abs(quant.dequantize(quant.quantize(d["w"], dtype)) - d["w"]).max()  # the same bias every round
    # What was sent sums to rounds x d minus the last residual, up to float64/32 rounding.
    assert np.allclose(total, rounds * d["w"].astype(np.float64) - residual["w"], rtol=0, atol=1e-7)
    assert fed < plain / 20


# ---- when the residual moves ---------------------------------------------------------------


def _io(feedback: bool = True):
    params = {"w": np.zeros(64, F32)}
    return params, FragmentIO(NumpyAdapter(params), feedback=feedback)


def test_a_retried_encode_sends_the_same_bytes_and_moves_the_residual_once():
    params, io = _io()
    anchor = {"w": np.zeros(64, F32)}
    params["w"][:] = np.linspace(-1, 1, 64, dtype=F32)
    c = io.capture(["w"], anchor, slot=(0, 0))
    first = c.encode({"w": "I2"}, compression="")
    held = io.residuals.of(0)
    assert c.encode({"w": "I2"}, compression="") == first
    assert io.residuals.of(0) is held


def test_a_merged_delta_gives_its_residual_back_to_the_parameters():
    params, io = _io()
    anchor = {"w": np.zeros(64, F32)}
    params["w"][:] = np.linspace(-1, 1, 64, dtype=F32)
    data = io.capture(["w"], anchor, slot=(0, 0)).encode({"w": "I2"}, compression="")
    x = anchor["w"] - np.linspace(-1, 1, 64, dtype=F32)
    owed = io.residuals.owed(0)
    assert np.array_equal(owed["w"], x - decode_payload(data, {"w": (64,)})["w"])
    theta = {"w": np.full(64, 0.5, F32)}  # the commit, written into the fragment
    io.stage(theta).write()
    io.settle(0, 0, merged=True)
    assert np.array_equal(params["w"], theta["w"] - owed["w"])
    assert io.residuals.of(0) is None and io.residuals.owed(0) is None  # float32 held all of it
    io.settle(0, 0, merged=True)  # settled once
    assert np.array_equal(params["w"], theta["w"] - owed["w"])


def test_a_delta_the_commit_left_out_gives_nothing_back():
    params, io = _io()
    anchor = {"w": np.zeros(64, F32)}
    params["w"][:] = np.linspace(-1, 1, 64, dtype=F32)
    io.capture(["w"], anchor, slot=(0, 0)).encode({"w": "I2"}, compression="")
    assert io.residuals.owed(0) is not None
    io.settle(0, 3, merged=False)  # another round: not this delta's
    assert io.residuals.owed(0) is not None
    before = params["w"].copy()
    io.settle(0, 0, merged=False)  # rejected, or over the quorum: as if never sent
    assert np.array_equal(params["w"], before) and io.residuals.of(0) is None and io.residuals.owed(0) is None


def test_a_delta_sent_before_the_older_ones_commit_arrived_takes_its_residual_in():
    # (records skipped to catch up: the older residual can no longer be given back on its own)
    params, io = _io()
    anchor = {"w": np.zeros(64, F32)}
    params["w"][:] = np.linspace(-1, 1, 64, dtype=F32)
    io.capture(["w"], anchor, slot=(0, 0)).encode({"w": "I2"}, compression="")
    owed = io.residuals.owed(0)
    data = io.capture(["w"], anchor, slot=(0, 4)).encode({"w": "I2"}, compression="")
    x = np.add(anchor["w"] - params["w"], owed["w"], dtype=F32)
    assert data == encode_payload({"w": x}, {"w": "I2"}, kind="delta")
    io.settle(0, 0, merged=True)  # the older delta's commit, late: nothing of it is owed any more
    assert np.array_equal(params["w"], np.linspace(-1, 1, 64, dtype=F32))


def test_the_residual_is_sent_again_only_where_the_inner_steps_leave_the_parameters():
    """Given back to the parameters, the residual reaches the next delta where training moves a
    parameter by a step whatever its start (flat), and not where training sets it to a point of
    its own (stiff: the displacement of the commit is brought back there already). Adding it to
    the next delta (the rule before issue 29) would send it in both halves."""
    params, io = _io()
    rng = np.random.default_rng(5)
    theta0 = {"w": np.zeros(64, F32)}
    params["w"][:] = rng.standard_normal(64).astype(F32)
    io.capture(["w"], theta0, slot=(0, 0)).encode({"w": "I2"}, compression="")
    owed = io.residuals.owed(0)["w"]
    theta1 = {"w": rng.standard_normal(64).astype(F32)}
    io.stage(theta1).write()
    io.settle(0, 0, merged=True)
    stiff, step = np.arange(64) < 32, rng.standard_normal(64).astype(F32)
    target = rng.standard_normal(64).astype(F32)
    params["w"][:] = np.where(stiff, target, params["w"] - step)  # one "inner step" of each kind
    data = io.capture(["w"], theta1, slot=(0, 1)).encode({"w": "I2"}, compression="")
    flat_part = np.subtract(theta1["w"], np.subtract(theta1["w"], owed, dtype=F32) - step, dtype=F32)
    d = np.where(stiff, np.subtract(theta1["w"], target, dtype=F32), flat_part)
    assert data == encode_payload({"w": d}, {"w": "I2"}, kind="delta")
    added_again = np.add(np.subtract(theta1["w"], params["w"], dtype=F32), owed, dtype=F32)
    assert data != encode_payload({"w": added_again}, {"w": "I2"}, kind="delta")


def test_a_publish_dropped_before_encoding_leaves_the_residual():
    params, io = _io()
    params["w"][:] = 0.5
    io.capture(["w"], {"w": np.zeros(64, F32)}, slot=(0, 0))  # never encoded: the node skipped it
    assert io.residuals.of(0) is None


# ---- off means off ---------------------------------------------------------------------------


def test_off_by_default_and_left_out_of_the_manifest():
    cfg = gm.DiLoCo(sync_every=4, fragments=2, delta_dtype="I2")
    assert cfg.error_feedback is False and "error_feedback" not in cfg.to_dict()
    on = gm.DiLoCo(sync_every=4, fragments=2, delta_dtype="I2", error_feedback=True)
    assert on.to_dict()["error_feedback"] is True
    assert gm.DiLoCo.from_dict(on.to_dict()) == on
    with pytest.raises(ValueError, match="error_feedback"):
        gm.DiLoCo(sync_every=4, fragments=2, error_feedback=1)


class Recording(ForwardingMailbox):
    """Keeps every payload written, garbage-collected or not."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.blobs: dict[str, bytes] = {}

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.startswith("blobs/"):
            self.blobs[key] = bytes(data)
        return super().put_if_absent(key, data)


def _blobs(cfg: gm.DiLoCo, steps: int = 24) -> tuple[dict[str, bytes], Cluster]:
    c = Cluster(cfg, mailbox=Recording(gm.MemoryMailbox()))
    c.join_all("ab")
    c.run(steps)
    c.settle()
    return c.mailbox.blobs, c


def test_without_quantized_deltas_feedback_changes_no_byte():
    for dtype in (None, "F32"):
        off, _ = _blobs(gm.DiLoCo(sync_every=4, fragments=2, delta_dtype=dtype))
        on, _ = _blobs(gm.DiLoCo(sync_every=4, fragments=2, delta_dtype=dtype, error_feedback=True))
        assert off == on, dtype


def test_with_i2_deltas_each_fragments_first_delta_is_the_same_and_later_ones_carry_the_residual():
    # quorum 2: both deltas are in every commit (with quorum 1 the slower one's first delta is
    # left out, its residual given back, and its second delta is the off run's, byte for byte)
    off, _ = _blobs(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2, delta_dtype="I2"))
    on, c = _blobs(gm.DiLoCo(sync_every=4, fragments=2, quorum_size=2, delta_dtype="I2", error_feedback=True))
    first = [k for k in on if k.startswith(("blobs/snapshots/0000000000/", "blobs/snapshots/0000000001/"))]
    assert first and all(on[k] == off.get(k) for k in first)
    later = {k for k in on if k.startswith("blobs/snapshots/")} - set(first)
    assert later and later.isdisjoint(off)  # different bytes, hence different keys (their sha256)
    # every residual went into the float32 parameters: nothing left to add to a next delta
    assert all(m.learner.io.residuals.of(f) is None for m in c.live() for f in (0, 1))


# ---- the same bytes on every path ---------------------------------------------------------


def _contributions(make_io, dtype: str, rounds: int = 6, params: str = "F32") -> list[bytes]:
    """Fragment 0 published ``rounds`` times, the parameters moved the same way on every path
    (half toward a point of their own, half by a step), each commit written into the fragment
    before the residual goes back into it, one round left out of its commit. ``params``: the
    parameters' dtype (``"BF16"``: the part of each residual they cannot hold is carried)."""
    rng = np.random.default_rng(3)
    theta = {"w": rng.standard_normal((8, 40)).astype(F32), "b": rng.standard_normal(40).astype(F32)}
    if params == "BF16":
        theta = {n: quant.dequantize(quant.quantize(v, "BF16")) for n, v in theta.items()}
    io, adapter = make_io(theta, params)
    out = []
    for r in range(rounds):
        io.stage(theta).write()
        if r:
            io.settle(0, r - 1, merged=r - 1 != 2)
        local = adapter.read(list(theta))
        pull = {n: rng.standard_normal(v.shape).astype(F32) for n, v in theta.items()}
        step = {n: (1e-2 * rng.standard_normal(v.shape)).astype(F32) for n, v in theta.items()}
        adapter.write(
            {
                n: np.where(np.arange(v.size).reshape(v.shape) % 2 == 0, pull[n], local[n] - step[n])
                for n, v in theta.items()
            }
        )
        data = io.capture(list(theta), theta, slot=(0, r)).encode(dict.fromkeys(theta, dtype), compression="")
        out.append(data)
        q = decode_payload(data, {n: v.shape for n, v in theta.items()})
        theta = {n: (theta[n] - F32(0.5) * q[n]).astype(F32) for n in theta}
        if params == "BF16":
            theta = {n: quant.dequantize(quant.quantize(v, "BF16")) for n, v in theta.items()}
    return out


def _numpy_io(theta, params):
    assert params == "F32"
    adapter = NumpyAdapter({n: v.copy() for n, v in theta.items()})
    return FragmentIO(adapter, feedback=True), adapter


def _torch_io(pipeline: bool):
    def make(theta, params):
        import torch

        from gradientmail_core.adapters.torch import TorchAdapter

        dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[params]
        model = torch.nn.Module()
        for n, v in theta.items():
            model.register_parameter(n, torch.nn.Parameter(torch.from_numpy(v.copy()).to(dtype)))
        adapter = TorchAdapter(model, device_pipeline=pipeline)
        return FragmentIO(adapter, feedback=True), adapter

    return make


PATHS = {"torch-host": _torch_io(False), "torch-device": _torch_io(True)}
if importlib.util.find_spec("mlx") is not None:  # pragma: no cover - MLX is absent on Linux CI

    def _mlx_io(theta, params):
        import mlx.core as mx
        import mlx.nn as nn

        from gradientmail_core.adapters.mlx import MLXAdapter

        dtype = {"F32": mx.float32, "BF16": mx.bfloat16}[params]
        model = nn.Module()
        for n, v in theta.items():
            setattr(model, n, mx.array(v).astype(dtype))
        adapter = MLXAdapter(model)
        return FragmentIO(adapter, feedback=True), adapter

    PATHS["mlx"] = _mlx_io


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", ["I2", "F4", "F8_E4M3", "BF16"])
def test_every_path_sends_the_numpy_paths_bytes(path, dtype):
    assert _contributions(PATHS[path], dtype) == _contributions(_numpy_io, dtype)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("path", sorted(set(PATHS) - {"torch-host"}))
@pytest.mark.parametrize("dtype", ["I2", "F4"])
def test_with_bf16_parameters_every_path_carries_what_they_cannot_hold_alike(path, dtype):
    assert _contributions(PATHS[path], dtype, params="BF16") == _contributions(
        PATHS["torch-host"], dtype, params="BF16"
    )


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
@pytest.mark.parametrize("pipeline", [False, True])
def test_what_bf16_parameters_cannot_hold_of_a_residual_goes_into_the_next_delta(pipeline):
    import torch

    theta = {"w": quant.dequantize(quant.quantize(np.linspace(1, 2, 64, dtype=F32), "BF16"))}
    io, adapter = _torch_io(pipeline)(theta, "BF16")
    io.stage(theta).write()
    adapter.write({"w": theta["w"] - np.random.default_rng(2).standard_normal(64).astype(F32) * F32(0.1)})
    io.capture(["w"], theta, slot=(0, 0)).encode({"w": "I2"}, compression="")
    owed = np.asarray(torch.as_tensor(io.residuals.owed(0)["w"]).cpu())
    io.stage(theta).write()
    io.settle(0, 0, merged=True)
    wanted = np.subtract(theta["w"], owed, dtype=F32)
    held = adapter.read(["w"])["w"]
    assert np.array_equal(held, quant.dequantize(quant.quantize(wanted, "BF16")))  # what bf16 holds of it
    left = np.asarray(torch.as_tensor(io.residuals.of(0)["w"]).cpu())
    assert np.array_equal(left, held - wanted) and left.any()
    data = io.capture(["w"], theta, slot=(0, 1)).encode({"w": "I2"}, compression="")
    x = np.add(np.subtract(theta["w"], held, dtype=F32), left, dtype=F32)  # = owed, up to float32 rounding
    assert data == encode_payload({"w": x}, {"w": "I2"}, kind="delta")


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_a_run_on_the_device_path_with_feedback_stores_the_host_paths_bytes():
    from test_torch_pipeline import run_cluster

    cfg = gm.DiLoCo(sync_every=4, fragments=2, delta_dtype="I2", commit_dtype="F4", error_feedback=True)
    host, host_params = run_cluster(cfg, pipeline=False)
    dev, dev_params = run_cluster(cfg, pipeline=True)
    assert sum(k.startswith("rounds/") for k in host) >= 4
    assert host == dev
    for a, b in zip(host_params, dev_params, strict=True):
        for x, y in zip(a, b, strict=True):
            assert x.equal(y)


# ---- the closer's commits, and a whole run -------------------------------------------------


def test_the_closer_feeds_its_commits_rounding_error_into_the_next_change():
    """The change a commit publishes is ``master - theta_prev`` quantized, never the master's own
    step: the fp32 master keeps what the quantized commits left out, and the published theta stays
    within one change's rounding error of it however many rounds go by."""
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=1, delta_dtype="F4", commit_dtype="I2"))
    a, _ = c.join_all("ab")
    states = []
    for _ in range(60):
        c.run(1)
        st = a.node.merger.held(0)
        if st is not None and (not states or st.version > states[-1].version):
            states.append(st)
    assert len(states) >= 10 and all(y.version == x.version + 1 for x, y in zip(states, states[1:]))
    run = a.learner.run
    worst_one_round = 0.0
    for prev, new in zip(states, states[1:]):
        change = {n: np.subtract(new.master[n], prev.theta[n], dtype=F32) for n in new.master}
        q = {n: quant.dequantize(quant.quantize(v, "I2")) for n, v in change.items()}
        rebuilt = rebuild_theta(run, 0, prev.theta, q)
        for n in new.theta:
            assert np.array_equal(rebuilt[n], new.theta[n]), (new.version, n)
            worst_one_round = max(worst_one_round, float(np.abs(change[n] - q[n]).max()))
    last = states[-1]
    drift = max(float(np.abs(last.theta[n] - last.master[n]).max()) for n in last.theta)
    assert drift <= worst_one_round * 1.01


def test_a_run_with_i2_deltas_and_feedback_commits_every_round_and_ends_identical():
    c = Cluster(gm.DiLoCo(sync_every=4, fragments=2, delta_dtype="I2", commit_dtype="I2", error_feedback=True))
    ms = c.join_all("abc")
    c.run(40)
    c.settle()
    for m in c.live():
        c.close(m)
    heads = {m.node.state.head for m in ms}
    assert heads == {40 // 4 * 2 - 1}
    for m in ms[1:]:
        for n in ms[0].params:
            assert np.array_equal(ms[0].params[n], m.params[n])
    assert not any(m.node.state.stats.rejected for m in ms)
