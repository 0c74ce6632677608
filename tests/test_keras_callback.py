"""``GradientMailKerasCallback`` in a real ``model.fit``, on the jax and torch backends (each in
its own process: Keras fixes its backend at the first import).

This file is also the process: ``python tests/test_keras_callback.py BACKEND`` runs the cases and
prints one JSON line. Cases:

- ``fit``: a Keras node trains in lockstep with a second learner (a thread over a numpy model
  that moves its parameters by +0.01 a step). The Keras optimizer's learning rate is 0, so the
  Keras weights change only by alignments: at every batch the weights the trainer holds (read
  after ``jax_state_sync``) must be what the callback wrote at the batch before. On the jax
  backend that fails if an alignment is written without syncing the trainer's state first.
- ``auto_names``: a run made by a model with unnamed layers (``dense``, ``dense_1``), joined in
  the same process by a second such model (``dense_2``, ``dense_3``): refused, naming the layers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS, BATCH = 16, 8


def _fit_case() -> dict:
    import keras

    import gradientmail_core as gm
    from gradientmail_lightning import GradientMailKerasCallback

    keras.utils.set_random_seed(0)
    box = gm.MemoryMailbox()
    # overlap_steps=1: a round aligns at the step after its publish, a step that reads nothing first
    algo = gm.DiLoCo(sync_every=4, fragments=2, in_flight=1, overlap_steps=1, quorum_size=2, merge=gm.WeightedMean())
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="l0"), keras.layers.Dense(1, name="l1")])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0), loss="mse")
    peer_params = {"l0.kernel": np.zeros((4, 3), np.float32), "l0.bias": np.zeros(3, np.float32),
                   "l1.kernel": np.zeros((3, 1), np.float32), "l1.bias": np.zeros(1, np.float32)}  # fmt: skip
    # the peer joins a run of Keras' layout: its arrays are laid out as Keras' (in, out)
    peer_layouts = {"l0.kernel": "in,out", "l1.kernel": "in,out"}

    class Peer:
        def schema(self):
            from gradientmail_core.protocol.records import TensorSpec

            return [TensorSpec(name=n, dtype="F32", shape=list(a.shape), layout=peer_layouts.get(n, ""))
                    for n, a in peer_params.items()]  # fmt: skip

        def read(self, names):
            return {n: peer_params[n].copy() for n in names}

        def write(self, values, mixing=0.0):
            for n, v in values.items():
                peer_params[n][...] = v

    errors: list[BaseException] = []

    def peer() -> None:
        try:
            with gm.Session(Peer(), algorithm=algo, mailbox=box, learner_id="peer", poll_interval=0.01,
                            callbacks=()) as s:  # fmt: skip
                s.wait_for(2, timeout=60)
                for _ in range(STEPS):
                    for a in peer_params.values():
                        a += np.float32(0.01)
                    s.step(samples=BATCH)
        except BaseException as e:
            errors.append(e)

    written: dict[int, list[np.ndarray]] = {}
    held: dict[int, list[np.ndarray]] = {}

    class Before(keras.callbacks.Callback):  # what the trainer holds, before the session steps
        def on_train_batch_end(self, batch, logs=None):
            # The jax trainer's own state after this batch, read without syncing it (a sync here
            # would take up an alignment the callback wrote without one); other backends train
            # the variables themselves.
            state = getattr(self.model, "_jax_state", None)
            values = state["trainable_variables"] if state else [v.value for v in self.model.trainable_variables]
            held[batch] = [np.array(keras.ops.convert_to_numpy(v)) for v in values]

    class After(keras.callbacks.Callback):  # what the variables hold after the session stepped (no sync)
        def on_train_batch_end(self, batch, logs=None):
            written[batch] = [keras.ops.convert_to_numpy(v.value).copy() for v in self.model.trainable_variables]

    thread = threading.Thread(target=peer)
    thread.start()
    cb = GradientMailKerasCallback(algorithm=algo, mailbox=box, samples_per_batch=BATCH, learner_id="keras",
                                   poll_interval=0.01, wait_for_learners=2, wait_timeout=60, callbacks=())  # fmt: skip
    x = np.random.default_rng(0).standard_normal((STEPS * BATCH, 4)).astype("float32")
    history = model.fit(x, x[:, :1], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[Before(), cb, After()])  # fmt: skip
    thread.join(60)
    assert not errors, errors
    took_up = [all(np.array_equal(a, b) for a, b in zip(written[k], held[k + 1])) for k in range(STEPS - 1)]
    moved = [not all(np.array_equal(a, b) for a, b in zip(held[k], written[k])) for k in range(STEPS)]
    final = {n: keras.ops.convert_to_numpy(v.value) for n, v in zip(["l0.kernel", "l0.bias", "l1.kernel", "l1.bias"],
                                                                    model.trainable_variables)}  # fmt: skip
    return {
        "took_up": took_up,
        "alignments": sum(moved),
        "history": {k: float(v[-1]) for k, v in history.history.items()},
        "closed": cb.session is None,
        "final_equal_peer": all(np.array_equal(final[n], peer_params[n]) for n in final),
    }


def _auto_names_case() -> dict:
    import keras

    import gradientmail_core as gm
    from gradientmail_lightning import GradientMailKerasCallback

    box = gm.MemoryMailbox()
    algo = gm.DiLoCo(sync_every=2, fragments=1)
    x = np.zeros((8, 4), "float32")
    first = None
    for i in range(2):  # the second model is built after the first: its layers are dense_2, dense_3
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        cb = GradientMailKerasCallback(algorithm=algo, mailbox=box, learner_id=f"k{i}", callbacks=())
        try:
            model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[cb])
        except gm.SchemaMismatch as e:
            return {"first": first, "error": str(e)}
        first = [v.path for v in model.trainable_variables]
    return {"first": first, "error": None}


def main(backend: str) -> None:
    os.environ["KERAS_BACKEND"] = backend
    print(json.dumps({"fit": _fit_case(), "auto_names": _auto_names_case()}))


# ---- the tests ----------------------------------------------------------------------------


def _run(backend: str) -> dict:
    for module in ("keras", backend):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, backend], capture_output=True, env=env, cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    return json.loads(proc.stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_keras_fit_trains_as_a_node_and_the_trainer_takes_up_every_alignment(backend):
    out = _run(backend)
    fit = out["fit"]
    assert fit["alignments"] >= 4, fit  # commits moved the Keras weights mid-fit (its own lr is 0)
    assert all(fit["took_up"]), fit  # ... and each next batch trained from the aligned weights
    h = fit["history"]
    assert h["gm/samples"] == STEPS * BATCH and h["gm/local_step"] == STEPS, h
    assert h["gm/round"] >= 6 and h["gm/participants"] == 2, h
    assert fit["closed"] and fit["final_equal_peer"], fit  # after fit: the newest commit, the peer's too

    auto = out["auto_names"]
    first = [p.split("/", 1)[1] for p in auto["first"]]  # less the model's own name, also automatic
    assert first == ["dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"], auto
    assert auto["error"] is not None and "dense_2" in auto["error"], auto
    assert "name every layer" in auto["error"] and "name='l0'" in auto["error"], auto


if __name__ == "__main__":
    main(sys.argv[1])
