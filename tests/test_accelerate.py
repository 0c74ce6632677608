"""The Accelerate hook in this process: which optimizer steps count, checkpoint state, refusals.
Multi-process nodes are in test_accelerate_nodes.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from accelerate_node import make_loader, make_model  # noqa: E402

import gradientmail_core as gm  # noqa: E402
import gradientmail_lightning  # noqa: E402, F401
from gradientmail_lightning.accelerate import GradientMailHandle, check_distributed_type  # noqa: E402

ALGO = gm.DiLoCo(sync_every=4, fragments=2)
FAST = {"poll_interval": 0.05, "lease_timeout": 3.0, "callbacks": ()}


@pytest.fixture
def fresh_state() -> Iterator[None]:
    """Accelerate keeps process-wide singletons; give each test its own."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def train(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader) -> None:
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def test_importing_the_package_adds_register_gradientmail_to_accelerator() -> None:
    assert callable(Accelerator.register_gradientmail)


def test_steps_skipped_by_the_grad_scaler_do_not_count(fresh_state: None) -> None:
    accelerator = Accelerator(cpu=True)
    model = make_model()
    # What accelerator.prepare builds under fp16 on a GPU: the scaler skips the inner step on inf/NaN.
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), scaler=torch.amp.GradScaler("cpu"))
    handle = accelerator.register_gradientmail(
        model, optimizer, algorithm=ALGO, mailbox=gm.MemoryMailbox(), samples_per_step=8, **FAST
    )
    with handle:
        for scale in (1.0, float("inf"), 1.0, float("nan"), 1.0):
            optimizer.zero_grad()
            loss = model(torch.full((8, 8), scale)).sum()
            optimizer.scaler.scale(loss).backward()
            optimizer.step()
        assert handle.session is not None and handle.session.progress.local_step == 3
    assert handle.steps == 3
    assert handle.driver.samples == 3 * 8


def test_handle_state_round_trips_through_save_state_and_load_state(tmp_path: Path, fresh_state: None) -> None:
    mailbox = gm.MemoryMailbox()

    def node() -> tuple[Accelerator, torch.nn.Module, torch.optim.Optimizer, GradientMailHandle, object]:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = make_loader(seed=1, n=4 * 16, batch=16)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        handle = accelerator.register_gradientmail(model, optimizer, algorithm=ALGO, mailbox=mailbox, **FAST)
        return accelerator, model, optimizer, handle, loader

    accelerator, model, optimizer, handle, loader = node()
    with handle:
        train(accelerator, model, optimizer, loader)
        learner_id = handle.session.learner_id if handle.session else None
    assert handle.steps == 2
    accelerator.save_state(str(tmp_path / "state"))

    accelerator, model, optimizer, handle, loader = node()
    accelerator.load_state(str(tmp_path / "state"))
    assert (handle.driver.learner_id, handle.steps) == (learner_id, 2)
    with handle:  # rejoins under the same id, from the newest committed parameters
        assert handle.session is not None and handle.session.learner_id == learner_id
        train(accelerator, model, optimizer, loader)
    assert handle.steps == 4
    assert mailbox.list("rounds/") == ["rounds/0000000000.json", "rounds/0000000001.json"]
    fresh = make_model()
    gm.align(fresh, mailbox=mailbox)
    for a, b in zip(accelerator.unwrap_model(model).parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_unstarted_handle_joins_before_the_first_real_step(fresh_state: None) -> None:
    accelerator = Accelerator(cpu=True)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    handle = accelerator.register_gradientmail(model, optimizer, algorithm=ALGO, mailbox=gm.MemoryMailbox(), **FAST)
    assert handle.session is None
    loss = model(torch.ones(4, 8)).sum()
    accelerator.backward(loss)
    optimizer.step()
    assert handle.session is not None and handle.steps == 1
    handle.close()
    assert handle.session is None


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM])
def test_sharded_setups_are_refused_naming_the_alternative(kind: DistributedType) -> None:
    with pytest.raises(ValueError, match="torchrun"):
        check_distributed_type(kind)
    check_distributed_type(DistributedType.MULTI_GPU)  # plain data parallel is fine


def test_fsdp_is_accepted_with_the_models_own_parameters_and_refused_with_flat_ones() -> None:
    check_distributed_type(DistributedType.FSDP, 2)  # FSDP2: DTensors
    check_distributed_type(DistributedType.FSDP, 1, True)  # FSDP1, use_orig_params=True
    with pytest.raises(ValueError, match="use_orig_params=True"):
        check_distributed_type(DistributedType.FSDP, 1, False)  # Accelerate's FSDP1 default: flat parameters
