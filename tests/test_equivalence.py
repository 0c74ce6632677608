"""Standard DiLoCo through gradientmail equals a plain reference DiLoCo loop.

With fragments=1, in_flight=1, overlap_steps=0 (a barrier), WeightedMean, a quorum of all
nodes and equal batches, N sessions must produce the parameters of the textbook
algorithm: every worker trains H steps from theta, the outer gradient is the mean of
theta - local, and Nesterov momentum updates theta.
"""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402

import gradientmail_core as gm  # noqa: E402

N, H, ROUNDS, BATCH = 3, 5, 4, 16


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, 6, generator=gen)
    return x, torch.sin(x.sum(dim=1, keepdim=True))


def inner_step(model, opt, gen) -> None:
    x, y = batch(gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def reference(outer_lr: float, outer_momentum: float) -> list[torch.Tensor]:
    theta = [p.detach().clone() for p in make_model().parameters()]
    momentum = [torch.zeros_like(t) for t in theta]
    workers = [make_model() for _ in range(N)]
    opts = [torch.optim.Adam(w.parameters(), lr=1e-2) for w in workers]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(N)]
    for _ in range(ROUNDS):
        locals_ = []
        for w, opt, gen in zip(workers, opts, gens):
            with torch.no_grad():
                for p, t in zip(w.parameters(), theta):
                    p.copy_(t)
            for _ in range(H):
                inner_step(w, opt, gen)
            locals_.append([p.detach().clone() for p in w.parameters()])
        for k in range(len(theta)):
            delta = sum(theta[k] - loc[k] for loc in locals_) / N
            momentum[k] = outer_momentum * momentum[k] + delta
            theta[k] = theta[k] - outer_lr * (delta + outer_momentum * momentum[k])
    return theta


def with_sessions(outer_lr: float, outer_momentum: float) -> list[list[torch.Tensor]]:
    cfg = gm.DiLoCo(
        sync_every=H,
        fragments=1,
        in_flight=1,
        overlap_steps=0,
        merge=gm.WeightedMean(),
        quorum_size=N,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
    )
    mailbox = gm.MemoryMailbox()
    out: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    # torch.manual_seed is process-global: build the models before the threads start, or two
    # threads seeding and drawing at once interleave the stream and the run's init differs.
    models = [make_model() for _ in range(N)]

    def worker(i: int) -> None:
        try:
            model = models[i]
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(10 + i)
            with gm.Session(
                model,
                algorithm=cfg,
                mailbox=mailbox,
                learner_id=f"w{i}",
                poll_interval=0.01,
                lease_timeout=10.0,
                callbacks=(),
            ) as s:
                s.wait_for(learners=N, timeout=30)
                for _ in range(H * ROUNDS):
                    inner_step(model, opt, gen)
                    s.step(samples=BATCH)
            out[i] = [p.detach().clone() for p in model.parameters()]
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return [out[i] for i in range(N)]


@pytest.mark.parametrize(("outer_lr", "outer_momentum"), [(1.0, 0.0), (0.7, 0.9)], ids=["local-sgd", "nesterov"])
def test_sessions_match_a_reference_diloco_loop(outer_lr, outer_momentum):
    expected = reference(outer_lr, outer_momentum)
    results = with_sessions(outer_lr, outer_momentum)
    for params in results:
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # and the reference moved: the comparison is not between two untouched models
    init = [p.detach() for p in make_model().parameters()]
    assert any(not torch.allclose(a, b) for a, b in zip(expected, init))
