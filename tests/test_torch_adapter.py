"""The torch adapter's host copies: plain copies on the CPU, and, for CUDA parameters, copies
still in flight that are waited for on first read (not on the training thread at ``read``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradientmail_core.adapters.torch import TorchAdapter, _HostCopies  # noqa: E402


def test_read_gives_float32_copies_the_caller_may_keep() -> None:
    m = torch.nn.Linear(3, 2)
    m.bias.data = m.bias.data.to(torch.bfloat16)
    a = TorchAdapter(m)
    got = a.read(["weight", "bias"])
    assert got["weight"].dtype == np.float32 and got["bias"].dtype == np.float32
    np.testing.assert_array_equal(got["bias"], m.bias.detach().float().numpy())
    before = got["weight"].copy()
    with torch.no_grad():
        m.weight.add_(1.0)
    np.testing.assert_array_equal(got["weight"], before)  # a copy, not a view of the parameter


def test_write_casts_into_the_parameter_in_place() -> None:
    m = torch.nn.Linear(2, 1, bias=False).to(torch.bfloat16)
    a = TorchAdapter(m)
    p = m.weight
    a.write({"weight": np.array([[1.00390625, -2.0]], dtype=np.float32)})  # 1 + 2**-8 rounds to even: 1.0
    assert m.weight is p
    assert m.weight.dtype == torch.bfloat16
    assert m.weight.float().tolist() == [[1.0, -2.0]]


class FakeEvent:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def record(self) -> None:
        self.calls.append("record")

    def synchronize(self) -> None:
        self.calls.append("synchronize")


def test_device_copies_are_waited_for_on_first_read_only() -> None:
    event = FakeEvent()
    pinned = {"b": torch.tensor([1.0, 2.0])}
    copies = _HostCopies({"a": np.zeros(2, np.float32)}, pinned, event)
    assert event.calls == ["record"]  # read() returns without waiting
    assert list(copies) == ["a", "b"] and len(copies) == 2
    assert copies["a"].tolist() == [0.0, 0.0]
    assert event.calls == ["record"]  # a value that was never on the device needs no wait
    assert copies["b"].tolist() == [1.0, 2.0]
    assert copies["b"].dtype == np.float32
    assert dict(copies)["b"].tolist() == [1.0, 2.0]
    assert event.calls == ["record", "synchronize"]  # waited once
