"""The JAX adapters (Flax NNX module, pytree in a functional loop) and the layout rules: names,
reads and writes through ``layouts="torch"``, the refusal of an untransposed square kernel at
join, and the same delta encoding to the same bytes from torch, MLX, Flax and Keras."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")  # before any import of keras (its default is tensorflow)
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import gradientmail_core as gm  # noqa: E402
from gradientmail_core.adapters import adapter_for  # noqa: E402
from gradientmail_core.codec.payload import encode_payload  # noqa: E402

ALGO = gm.DiLoCo(sync_every=4, fragments=1, in_flight=1, overlap_steps=0)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = 4) -> None:
        self.embed = nnx.Embed(10, d, rngs=rngs)
        self.l0 = nnx.Linear(d, d, rngs=rngs)  # square: a missing transpose fits the shape
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(d, 3, rngs=rngs)])


def test_nnx_names_are_dotted_state_paths_without_value_and_record_kernel_layouts():
    specs = {s.name: s for s in adapter_for(Net(nnx.Rngs(0))).schema()}
    assert sorted(specs) == ["blocks.0.bias", "blocks.0.kernel", "embed.embedding", "l0.bias", "l0.kernel",
                             "norm.bias", "norm.scale"]  # fmt: skip
    assert specs["l0.kernel"].layout == "in,out" and specs["blocks.0.kernel"].shape == [4, 3]
    assert specs["embed.embedding"].layout == specs["norm.scale"].layout == ""


def test_torch_layout_rule_renames_transposes_and_writes_back_in_place():
    model = Net(nnx.Rngs(0))
    kernel = model.blocks[0].kernel
    adapter = adapter_for(model, layouts="torch")
    specs = {s.name: s for s in adapter.schema()}
    assert specs["blocks.0.weight"].shape == [3, 4] and specs["blocks.0.weight"].layout == ""
    assert {"embed.weight", "norm.weight", "norm.bias", "l0.weight"} <= set(specs)
    got = adapter.read(["blocks.0.weight"])["blocks.0.weight"]
    assert np.array_equal(got, np.asarray(kernel[...]).T)
    new = np.arange(12, dtype=np.float32).reshape(3, 4)
    adapter.write({"blocks.0.weight": new})
    assert model.blocks[0].kernel is kernel  # the same variable (an optimizer's state survives)
    assert np.array_equal(np.asarray(kernel[...]), new.T)
    out = {"blocks.0.weight": new.copy()}
    adapter.subtract_from(out)
    assert not out["blocks.0.weight"].any()


def test_writes_round_bf16_like_the_core_and_stay_on_the_device():
    params = {"w": {"kernel": jnp.zeros((3, 5), jnp.bfloat16)}}
    adapter = adapter_for(params)
    v = np.array(np.random.default_rng(0).standard_normal((3, 5)), np.float32)
    adapter.write({"w.kernel": v})
    tree = adapter.source.params
    from gradientmail_core.codec import quant

    got = np.asarray(tree["w"]["kernel"]).view(np.uint16)
    assert np.array_equal(got, quant.to_bf16_bits(v))
    assert tree["w"]["kernel"].devices() == params["w"]["kernel"].devices()


def test_flax_node_without_the_transpose_rule_is_refused_joining_a_torch_run():
    torch = pytest.importorskip("torch")
    box = gm.MemoryMailbox()

    class TorchNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l0 = torch.nn.Linear(4, 4)

    class FlaxNet(nnx.Module):
        def __init__(self) -> None:
            self.l0 = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    with gm.Session(TorchNet(), algorithm=ALGO, mailbox=box, learner_id="t", callbacks=()):
        # names= alone makes the names and the (square) shapes the run's, not the axis order
        renamed = gm.Session(FlaxNet(), algorithm=ALGO, mailbox=box, learner_id="f", callbacks=(),
                             names={"l0.kernel": "l0.weight"})  # fmt: skip
        with pytest.raises(gm.SchemaMismatch) as e:
            renamed.open()
        msg = str(e.value)
        assert "l0.weight: run lays it out as the reference (torch) order, this model as (in,out)" in msg
        assert "layouts='torch'" in msg
        # with the rule it joins, and starts from the torch node's parameters, transposed
        with gm.Session(FlaxNet(), algorithm=ALGO, mailbox=box, learner_id="g", callbacks=(), layouts="torch") as s:
            assert isinstance(s.model, FlaxNet)


def test_layouts_leave_the_schema_digest_of_a_run_without_layouts_unchanged():
    from gradientmail_core.codec.header import schema_digest
    from gradientmail_core.protocol.records import Manifest, TensorSpec, decode, encode

    plain = [TensorSpec(name="w", dtype="F32", shape=[2, 3])]
    rows = json.dumps([["w", "F32", [2, 3]]], sort_keys=True, separators=(",", ":")).encode()
    assert schema_digest(plain) == hashlib.sha256(rows).hexdigest()  # as before layouts existed
    laid = [TensorSpec(name="w", dtype="F32", shape=[2, 3], layout="in,out")]
    assert schema_digest(laid) != schema_digest(plain)
    m = Manifest(run_id="ab" * 8, created_by="a", schema=plain, schema_digest=schema_digest(plain), fragments=[["w"]])
    assert b"layout" not in encode(m)
    m2 = Manifest(run_id="ab" * 8, created_by="a", schema=laid, schema_digest=schema_digest(laid), fragments=[["w"]])
    assert decode(encode(m2), Manifest).schema[0].layout == "in,out"


def test_pytree_session_returns_the_aligned_tree_in_a_jitted_optax_loop():
    box = gm.MemoryMailbox()
    key = jax.random.PRNGKey(0)
    params = {"l0": {"kernel": jax.random.normal(key, (3, 2)), "bias": jnp.zeros(2)}}
    opt = optax.sgd(0.1)
    x = jax.random.normal(key, (8, 3))

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["l0"]["kernel"] + p["l0"]["bias"]) ** 2))(p)
        u, s = opt.update(g, s)
        return optax.apply_updates(p, u), s, loss

    first_kernel = params["l0"]["kernel"]
    with gm.Session(params, algorithm=ALGO, mailbox=box, learner_id="p", callbacks=()) as session:
        params = session.params
        state = opt.init(params)
        for _ in range(8):
            params, state, _ = step(params, state)
            params = session.step(samples=8, params=params)
        assert session.rounds_seen >= 1
        with pytest.raises(TypeError, match="params = session.step"):
            session.step(samples=8)
    final = session.params  # the newest commit, loaded at close
    zeros = jax.tree_util.tree_map(jnp.zeros_like, final)
    with gm.Session(zeros, algorithm=ALGO, mailbox=box, learner_id="q", callbacks=()) as other:
        newest = other.params  # a node joining later starts from the newest commit
    assert np.array_equal(np.asarray(final["l0"]["kernel"]), np.asarray(newest["l0"]["kernel"]))
    assert not np.array_equal(np.asarray(newest["l0"]["kernel"]), np.asarray(first_kernel))  # the run trained
    with pytest.raises(TypeError, match="immutable"):
        gm.align(zeros, mailbox=box)


def test_same_delta_encodes_to_the_same_bytes_in_torch_mlx_flax_and_keras():
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("mlx.core")
    mnn = pytest.importorskip("mlx.nn")
    keras = pytest.importorskip("keras")
    rng = np.random.default_rng(7)
    w = rng.standard_normal((5, 5)).astype(np.float32) * 10.0 ** rng.integers(-4, 4, (5, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)

    tlin = torch.nn.Linear(5, 5)
    with torch.no_grad():
        tlin.weight.copy_(torch.from_numpy(w))
        tlin.bias.copy_(torch.from_numpy(b))
    mlin = mnn.Linear(5, 5)
    mlin.weight, mlin.bias = mx.array(w), mx.array(b)
    flin = nnx.Linear(5, 5, rngs=nnx.Rngs(0))
    flin.kernel[...] = jnp.asarray(w.T)
    flin.bias[...] = jnp.asarray(b)
    klin = keras.layers.Dense(5, name="dense_bytes")
    klin.build((None, 5))
    klin.kernel.assign(w.T)
    klin.bias.assign(b)
    adapters = {
        "torch": adapter_for(tlin),
        "mlx": adapter_for(mlin),
        "flax": adapter_for(flin, layouts="torch"),
        "keras": adapter_for(klin, names=lambda n: n.removeprefix("dense_bytes."), layouts="torch"),
    }
    for a in adapters.values():  # one schema: torch's names, shapes and layout
        assert sorted((s.name, tuple(s.shape), s.layout) for s in a.schema()) == [
            ("bias", (5,), ""),
            ("weight", (5, 5), ""),
        ]
    anchor = {"weight": rng.standard_normal((5, 5)).astype(np.float32), "bias": np.zeros(5, np.float32)}
    for dtype in ("F32", "BF16", "F16", "F8_E4M3", "F4", "I2"):
        payloads = {}
        for framework, a in adapters.items():
            local = a.read(["weight", "bias"])
            delta = {n: np.subtract(anchor[n], local[n], dtype=np.float32) for n in anchor}
            payloads[framework] = encode_payload(delta, dtype, kind="delta")
        assert len(set(payloads.values())) == 1, (dtype, {k: len(v) for k, v in payloads.items()})
