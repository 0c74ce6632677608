"""Loading data from a gm.WorkQueue: the index iterators (MLX), the torch Sampler in a DataLoader,
under Lightning and Accelerate. Every index is read once across the nodes of a run."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gradientmail_core as gm
from gradientmail_core.data import index_batches, iter_indices, unit_indices, unit_range


def queue(mb, holder, units, clock=None, **kw):
    return gm.WorkQueue(
        mb, units=units, holder=holder, clock=clock or gm.FakeClock(), lease_timeout=10.0, poll_interval=1.0, **kw
    )


@pytest.mark.parametrize("units,length", [(1, 0), (1, 5), (4, 10), (7, 3), (10, 1000), (3, 3)])
def test_units_cut_the_dataset_into_contiguous_shards(units, length):
    covered = [i for u in range(units) for i in unit_range(u, units, length)]
    assert covered == list(range(length))
    sizes = {len(unit_range(u, units, length)) for u in range(units)}
    assert max(sizes) - min(sizes) <= 1
    shuffled = unit_indices(units - 1, units, length, shuffle=True, seed=3)
    assert sorted(shuffled) == list(unit_range(units - 1, units, length))
    assert shuffled == unit_indices(units - 1, units, length, shuffle=True, seed=3)  # same order when re-read


def in_threads(*iterables) -> list[list]:
    """Drain each iterable in its own thread, as nodes run side by side. (In one thread, a node
    waiting for the others' units would block them, and take their units once their holds
    lapsed: their holders cannot renew while it waits.)"""
    out: list[list] = [[] for _ in iterables]
    errors: list[BaseException] = []

    def drain(i, it):
        try:
            out[i].extend(it)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=drain, args=(i, it)) for i, it in enumerate(iterables)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out


def live_queue(mb, holder, units):
    return gm.WorkQueue(mb, units=units, holder=holder, lease_timeout=60.0, poll_interval=0.01)


def test_two_nodes_side_by_side_read_every_index_once():
    mb = gm.MemoryMailbox()
    a, b = in_threads(
        iter_indices(live_queue(mb, "a", 8), 100, shuffle=True, seed=1),
        iter_indices(live_queue(mb, "b", 8), 100, shuffle=True, seed=1),
    )
    assert sorted(a + b) == list(range(100))


def test_stopping_early_gives_the_unit_back():
    mb = gm.MemoryMailbox()
    qa, qb = queue(mb, "a", 2), queue(mb, "b", 2)
    it = iter_indices(qa, 10)
    first = [next(it) for _ in range(3)]  # in the middle of a unit
    it.close()
    assert qa.held == []
    rest = list(iter_indices(qb, 10))  # b takes a's unit at once, without waiting for a lease
    assert sorted(rest) == list(range(10))
    assert set(first) <= set(rest)
    assert qb.progress().reissued == 1


def test_index_batches_for_mlx():
    mx = pytest.importorskip("mlx.core")
    mb = gm.MemoryMailbox()
    data = mx.arange(50) * 2
    seen = []
    for batch in index_batches(queue(mb, "a", 5), 50, batch_size=8, shuffle=True, seed=0):
        assert batch.dtype == np.int64 and 1 <= len(batch) <= 8
        seen += np.array(data[mx.array(batch)]).tolist()
    assert sorted(seen) == [2 * i for i in range(50)]
    assert gm.WorkQueue(mb, units=5, holder="z").finished()


def test_index_batches_drop_last_and_batch_size():
    mb = gm.MemoryMailbox()
    sizes = [len(b) for b in index_batches(queue(mb, "a", 3), 10, batch_size=4, drop_last=True)]
    assert sizes == [4, 4]
    with pytest.raises(ValueError):
        next(index_batches(queue(mb, "b", 3), 10, batch_size=0))


# ---- torch --------------------------------------------------------------------------------


class _Indexed:
    """A map-style dataset whose items are their own index (as a float tensor)."""

    def __init__(self, n):
        import torch

        self.x = torch.arange(n, dtype=torch.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_dataloaders_of_two_nodes_read_every_sample_once(num_workers):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from gradientmail_core.data import WorkSampler

    mb = gm.MemoryMailbox()
    ds = _Indexed(64)
    loaders = [
        DataLoader(
            ds, batch_size=5, sampler=WorkSampler(live_queue(mb, h, 8), ds, shuffle=True), num_workers=num_workers
        )
        for h in ("a", "b")
    ]
    assert isinstance(loaders[0].sampler, torch.utils.data.Sampler)
    batches = in_threads(*loaders)
    got = [i for node in batches for batch in node for i in batch.long().tolist()]
    assert sorted(got) == list(range(64))
    # The next epoch of a finished queue is empty: one queue is one pass over the data.
    assert list(loaders[0]) == []


def test_accelerate_keeps_the_sampler():
    pytest.importorskip("torch")
    accelerate = pytest.importorskip("accelerate")
    from torch.utils.data import DataLoader

    from gradientmail_core.data import WorkSampler

    mb = gm.MemoryMailbox()
    ds = _Indexed(40)
    accelerator = accelerate.Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(ds, batch_size=4, sampler=WorkSampler(queue(mb, "a", 5), ds)))
    got = [int(v) for batch in loader for v in batch.tolist()]
    assert sorted(got) == list(range(40))


def test_lightning_trains_on_the_units_it_gets(tmp_path):
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from gradientmail_core.data import WorkSampler

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[int] = []

        def training_step(self, batch, _):
            self.seen += batch.long().tolist()
            return ((batch * self.w) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    mb = gm.MemoryMailbox()
    ds = _Indexed(30)
    other = queue(mb, "other", 6)
    taken = other.claim()  # another node consumed one unit
    assert taken is not None
    loader = DataLoader(ds, batch_size=4, sampler=WorkSampler(queue(mb, "a", 6, clock=gm.FakeClock()), ds))
    model = Module()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        default_root_dir=tmp_path,
    )
    assert other.complete(taken)
    trainer.fit(model, loader)
    theirs = set(unit_range(taken.unit, 6, 30))
    assert sorted(model.seen) == sorted(set(range(30)) - theirs)
