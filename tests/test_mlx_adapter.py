"""The MLX adapter (SPEC 6): schema, in-place writes, dtypes, and its errors."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")
optim = pytest.importorskip("mlx.optimizers")

from mlx.utils import tree_flatten  # noqa: E402

from gradientmail_core.adapters import adapter_for  # noqa: E402
from gradientmail_core.adapters.mlx import MLXAdapter  # noqa: E402
from gradientmail_core.codec import quant  # noqa: E402
from gradientmail_core.codec.header import schema_digest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class MLP(nn.Module):
    """Named like a torch module holding ``self.layers = nn.Sequential(...)``: layers.0.weight, ..."""

    def __init__(self, dims=(3, 4, 2)) -> None:
        super().__init__()
        self.layers = [nn.Linear(dims[0], dims[1]), nn.ReLU(), nn.Linear(dims[1], dims[2])]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class TorchSequentialNames(nn.Module):
    """Named like a bare ``torch.nn.Sequential``: 0.weight, 0.bias, 2.weight, ..."""

    def __init__(self, *layers) -> None:
        super().__init__()
        for i, layer in enumerate(layers):
            self[str(i)] = layer
        self.n = len(layers)

    def __call__(self, x):
        for i in range(self.n):
            x = self[str(i)](x)
        return x


class Params(nn.Module):
    """A module holding bare arrays under the given attribute names."""

    def __init__(self, **arrays) -> None:
        super().__init__()
        for name, a in arrays.items():
            setattr(self, name, a)


def test_schema_names_are_tree_flatten_paths():
    spec = MLXAdapter(MLP()).schema()
    assert [(s.name, s.dtype, s.shape) for s in spec] == [
        ("layers.0.weight", "F32", [4, 3]),
        ("layers.0.bias", "F32", [4]),
        ("layers.2.weight", "F32", [2, 4]),
        ("layers.2.bias", "F32", [2]),
    ]
    assert [s.name for s in spec] == [n for n, _ in tree_flatten(MLP().trainable_parameters())]


class OwnAfterChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 3)
        self.blocks = [nn.Linear(3, 3), {"gain": mx.ones(3)}]
        self.scale = mx.ones(3)


def test_schema_lists_own_arrays_before_children_like_torch():
    # tree_flatten would give lin.*, blocks.*, scale; torch lists a module's own parameters first.
    names = [s.name for s in MLXAdapter(OwnAfterChild()).schema()]
    assert names == ["scale", "lin.weight", "lin.bias", "blocks.0.weight", "blocks.0.bias", "blocks.1.gain"]
    assert sorted(names) == sorted(n for n, _ in tree_flatten(OwnAfterChild().trainable_parameters()))
    torch = pytest.importorskip("torch")
    from gradientmail_core.adapters.torch import TorchAdapter

    class Torch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 3)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.ParameterDict({"gain": torch.ones(3)})])
            self.scale = torch.nn.Parameter(torch.ones(3))

    assert TorchAdapter(Torch()).schema() == MLXAdapter(OwnAfterChild()).schema()


def test_schema_matches_structurally_equal_torch_models():
    torch = pytest.importorskip("torch")
    from gradientmail_core.adapters.torch import TorchAdapter

    class TorchMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    seq = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    for t_model, m_model in [
        (TorchMLP(), MLP()),
        (seq, TorchSequentialNames(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))),
    ]:
        t_schema, m_schema = TorchAdapter(t_model).schema(), MLXAdapter(m_model).schema()
        assert t_schema == m_schema
        assert schema_digest(t_schema) == schema_digest(m_schema)
    assert [s.name for s in MLXAdapter(TorchSequentialNames(nn.Linear(3, 4), nn.ReLU())).schema()] == [
        "0.weight",
        "0.bias",
    ]


def test_adapter_for_detects_mlx_modules():
    assert isinstance(adapter_for(MLP()), MLXAdapter)  # a user subclass (its module is not mlx.*)
    assert isinstance(adapter_for(nn.Linear(2, 2)), MLXAdapter)


def test_read_returns_float32_copies():
    model = MLP()
    ad = MLXAdapter(model)
    got = ad.read(["layers.0.weight", "layers.2.bias"])
    assert set(got) == {"layers.0.weight", "layers.2.bias"}
    w = got["layers.0.weight"]
    assert w.dtype == np.float32 and w.shape == (4, 3)
    np.testing.assert_array_equal(w, np.array(model.layers[0].weight))
    w[...] = 7.0  # the caller may keep and mutate what it read
    assert not np.any(np.array(model.layers[0].weight) == 7.0)


def test_write_replaces_only_the_named_parameters():
    model = MLP()
    before = {n: np.array(a) for n, a in tree_flatten(model.parameters())}
    new = np.arange(8, dtype=np.float32).reshape(2, 4)
    MLXAdapter(model).write({"layers.2.weight": new})
    np.testing.assert_array_equal(np.array(model.layers[2].weight), new)
    for n, a in tree_flatten(model.parameters()):
        if n != "layers.2.weight":
            np.testing.assert_array_equal(np.array(a), before[n])


def test_write_keeps_optimizer_state_and_training_continues():
    mx.random.seed(0)
    model = MLP()
    opt = optim.Adam(learning_rate=0.01)
    x, y = mx.ones((5, 3)), mx.zeros((5, 2))
    loss_and_grad = nn.value_and_grad(model, lambda m, a, b: ((m(a) - b) ** 2).mean())

    def train_step():
        _, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)

    train_step()
    m_before = np.array(opt.state["layers"][0]["weight"]["m"])
    ad = MLXAdapter(model)
    theta = {n: np.full(s.shape, 0.5, np.float32) for n, s in ((s.name, s) for s in ad.schema())}
    ad.write(theta)
    # The optimizer's state is keyed by tree path, not by array identity: still there, untouched.
    np.testing.assert_array_equal(np.array(opt.state["layers"][0]["weight"]["m"]), m_before)
    assert int(opt.state["step"]) == 1
    train_step()
    assert int(opt.state["step"]) == 2
    w = np.array(model.layers[0].weight)
    assert not np.array_equal(w, theta["layers.0.weight"])  # trained from the written values...
    assert np.abs(w - 0.5).max() < 0.05  # ...by one small Adam step


def test_write_with_mixing_blends_in_float32():
    model = Params(w=mx.array(np.array([1.0, 2.0, -3.0], np.float32)))
    v = np.array([3.0, 0.0, 1.0], np.float32)
    MLXAdapter(model).write({"w": v}, mixing=0.25)
    want = np.float32(0.25) * np.array([1.0, 2.0, -3.0], np.float32) + np.float32(0.75) * v
    np.testing.assert_array_equal(np.array(model.w), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mixing", [0.0, 0.5])
def test_scalar_and_transposed_parameters_round_trip(dtype, mixing):
    mdt = getattr(mx, dtype)
    model = Params(s=mx.array(1.5).astype(mdt), t=mx.ones((3, 2)).astype(mdt).T)
    ad = MLXAdapter(model)
    assert [(s.name, s.shape) for s in ad.schema()] == [("s", []), ("t", [2, 3])]
    assert ad.read(["s"])["s"].shape == ()
    new = {"s": np.array(-2.0, np.float32), "t": np.arange(6, dtype=np.float32).reshape(3, 2).T}
    ad.write(new, mixing=mixing)
    got = ad.read(["s", "t"])
    assert got["s"].shape == () and model.s.shape == () and model.s.dtype == mdt
    np.testing.assert_array_equal(got["s"], np.float32(mixing * 1.5 + (1 - mixing) * -2.0))
    np.testing.assert_array_equal(got["t"], np.float32(mixing) + np.float32(1 - mixing) * new["t"])


def test_frozen_parameters_are_not_in_the_schema():
    model = MLP()
    model.layers[0].freeze()
    assert [s.name for s in MLXAdapter(model).schema()] == ["layers.2.weight", "layers.2.bias"]


@pytest.mark.parametrize("dtype,name", [("bfloat16", "BF16"), ("float16", "F16")])
def test_half_precision_parameters_read_exactly_and_write_round_to_nearest_even(dtype, name):
    mdt = getattr(mx, dtype)
    src = np.random.default_rng(0).standard_normal(40).astype(np.float32)
    model = Params(w=mx.array(src).astype(mdt))
    ad = MLXAdapter(model)
    assert ad.schema()[0].dtype == name
    exact = (
        quant.from_bf16_bits(quant.to_bf16_bits(src)) if dtype == "bfloat16" else quant.to_f16(src).astype(np.float32)
    )
    np.testing.assert_array_equal(ad.read(["w"])["w"], exact)
    # Values between two representable ones, including exact ties, round to nearest even.
    ties = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -2.5e-3, 70000.0], np.float32)
    ad.write({"w": np.resize(ties, 40)})
    assert model.w.dtype == mdt
    if dtype == "bfloat16":
        assert np.array_equal(np.array(model.w.view(mx.uint16)), quant.to_bf16_bits(np.resize(ties, 40)))
    else:
        assert np.array_equal(np.array(model.w), quant.to_f16(np.resize(ties, 40)), equal_nan=True)


@pytest.mark.parametrize("dtype", ["int32", "uint8", "float64", "complex64", "bool_"])
def test_unsupported_parameter_dtype_is_a_type_error_naming_it(dtype):
    bad = mx.zeros((2,), dtype=getattr(mx, dtype))
    model = MLP()
    model.layers[2].scale = bad
    with pytest.raises(TypeError) as e:
        MLXAdapter(model)
    msg = str(e.value)
    assert "'layers.2.scale'" in msg and dtype.rstrip("_") in msg
    assert "float32, bfloat16 and float16" in msg


def test_one_array_under_two_names_is_refused():
    model = MLP((3, 3, 3))
    model.layers[2].weight = model.layers[0].weight
    with pytest.raises(ValueError, match=r"'layers\.0\.weight' and 'layers\.2\.weight' are the same array.*as_linear"):
        MLXAdapter(model)


@pytest.mark.parametrize("key", ["a.b", "a#b", ""])
def test_keys_that_cannot_be_dotted_names_are_refused(key):
    model = MLP()
    model.extra = {key: mx.zeros((2,))}
    with pytest.raises(ValueError, match=r"keys must be non-empty strings without '\.' or '#'") as e:
        MLXAdapter(model)
    assert repr(key) in str(e.value)


def test_model_without_trainable_parameters_is_refused():
    model = MLP()
    model.freeze()
    with pytest.raises(ValueError, match="MLP has no trainable parameters"):
        MLXAdapter(model)


def test_non_module_is_a_type_error():
    with pytest.raises(TypeError, match=r"needs an mlx\.nn\.Module, found builtins\.list"):
        MLXAdapter([mx.zeros(2)])


def test_importing_gradientmail_core_does_not_import_mlx():
    code = "import sys, gradientmail_core; assert 'mlx' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_missing_mlx_is_a_missing_extra_error():
    code = (
        "import sys; sys.modules['mlx'] = None\n"  # makes `import mlx...` raise ImportError
        "import gradientmail_core as gm\n"
        "try:\n"
        "    import gradientmail_core.adapters.mlx\n"
        "except gm.MissingExtra as e:\n"
        "    assert e.extra == 'mlx' and \"pip install 'gradientmail[mlx]'\" in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no MissingExtra')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_mlx_extra_needs_the_cpu_backend_on_linux_only():
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["mlx"]
    reqs = [Requirement(r) for r in extra]

    def picked(platform: str) -> list[Requirement]:
        env = {**default_environment(), "sys_platform": platform}
        return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]

    (linux,) = picked("linux")
    (mac,) = picked("darwin")
    assert (linux.name, linux.extras) == ("mlx", {"cpu"})  # plain mlx installs on Linux but cannot import
    assert (mac.name, mac.extras) == ("mlx", set())
    assert picked("win32") == []  # no MLX wheels for Windows
    # The installed mlx really offers the extra, and satisfies the requirement.
    from importlib.metadata import metadata, version

    assert "cpu" in (metadata("mlx").get_all("Provides-Extra") or [])
    assert linux.specifier.contains(version("mlx"))


def test_mlx_model_joins_a_run_created_by_a_torch_model():
    torch = pytest.importorskip("torch")
    import gradientmail_core as gm

    class Torch(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 3)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.ParameterDict({"gain": torch.ones(3)})])
            self.scale = torch.nn.Parameter(torch.full((3,), 2.0))

    box, algo = gm.MemoryMailbox(), gm.DiLoCo(sync_every=2, fragments=2)
    t_model, m_model = Torch(), OwnAfterChild()
    with gm.Session(t_model, algorithm=algo, mailbox=box, learner_id="t", callbacks=(), poll_interval=0.05):
        with gm.Session(m_model, algorithm=algo, mailbox=box, learner_id="m", callbacks=(), poll_interval=0.05):
            # Joining loaded the run's parameters (the torch model's) into the MLX model.
            np.testing.assert_array_equal(np.array(m_model.scale), np.full(3, 2.0, np.float32))
            np.testing.assert_array_equal(np.array(m_model.lin.weight), t_model.lin.weight.detach().numpy())


def test_permuting_adapter_from_the_docs_gives_mlx_convolutions_torchs_layout():
    torch = pytest.importorskip("torch")
    from gradientmail_core.adapters.torch import TorchAdapter

    doc = (ROOT / "docs" / "adapters.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "class Permuted" in b]
    ns: dict = {}
    exec(block, ns)

    class MLXNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 5)

    class TorchNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 5)

    m_model, t_model = MLXNet(), TorchNet()
    m_ad, t_ad = ns["Permuted"](MLXAdapter(m_model), {"conv.weight": (0, 3, 1, 2)}), TorchAdapter(t_model)
    assert m_ad.schema() == t_ad.schema()
    assert MLXAdapter(m_model).schema() != t_ad.schema()
    m_ad.write(t_ad.read(["conv.weight", "conv.bias"]))  # torch's weights, into the MLX model
    x = np.random.default_rng(0).standard_normal((2, 3, 9, 9)).astype(np.float32)  # NCHW
    with torch.no_grad():
        want = t_model.conv(torch.from_numpy(x)).numpy()
    got = np.array(m_model.conv(mx.array(x.transpose(0, 2, 3, 1)))).transpose(0, 3, 1, 2)  # NHWC
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(m_ad.read(["conv.weight"])["conv.weight"], t_ad.read(["conv.weight"])["conv.weight"])
