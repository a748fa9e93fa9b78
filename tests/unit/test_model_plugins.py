"""Models that live outside this repository: `package.module:factory` names and the `ddiloco.models`
entry-point group (ddiloco.models.get_model), and the two worked examples under examples/."""

from __future__ import annotations

import pathlib
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ddiloco import models
from ddiloco.algo.inner import InnerOptConfig
from ddiloco.models.pytree import PytreeModel

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

_PLUGIN = textwrap.dedent('''
    from ddiloco import models

    def build(config=None):
        model = models.get_model("transformer", {"preset": "tiny", **dict(config or {})})
        model.name = NAME
        return model

    NAME = "demo_plugin:build"

    def not_a_model(config=None):
        return object()

    def misnamed(config=None):
        return models.get_model("transformer", {"preset": "tiny"})
''')


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    (tmp_path / "demo_plugin.py").write_text(_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("demo_plugin", None)


def test_a_module_factory_name_builds_the_plugin_model(plugin_path):
    model = models.get_model("demo_plugin:build", {"n_layers": 1})
    assert model.name == "demo_plugin:build" and model.config["n_layers"] == 1


@pytest.mark.parametrize("name, message", [
    ("no_such_module_xyz:build", "cannot import 'no_such_module_xyz'"),
    ("demo_plugin:missing", "has no callable 'missing'"),
    ("demo_plugin:not_a_model", "lacks name, config, init, loss, tensor_specs, vocab_size, seq_len"),
    ("demo_plugin:misnamed", "set it to 'demo_plugin:misnamed'"),
    ("no-such-model", "is unknown"),
])
def test_a_bad_plugin_name_fails_with_a_clear_error(plugin_path, name, message):
    with pytest.raises(ValueError, match=message):
        models.get_model(name)


def test_an_installed_entry_point_names_a_model(plugin_path):
    # A real (if minimal) installed distribution: dist-info metadata with an entry point.
    (plugin_path / "demo_plugin.py").write_text(_PLUGIN.replace('NAME = "demo_plugin:build"', 'NAME = "demo"'))
    info = plugin_path / "demo_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: demo-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{models.ENTRY_POINT_GROUP}]\ndemo = demo_plugin:build\n")
    model = models.get_model("demo")
    assert model.name == "demo" and models.model_fingerprint(model)


@pytest.mark.parametrize("name", ["flax_lm:build", "equinox_lm:build"])
def test_the_examples_satisfy_the_model_interface(name, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    model = models.get_model(name)
    params = model.init(jax.random.PRNGKey(0))
    specs = model.tensor_specs()
    assert [s.name for s in specs] == list(params) and len(set(params)) == len(params)
    assert all(tuple(params[s.name].shape) == s.shape and params[s.name].dtype == np.float32 for s in specs)
    assert {s.name for s in specs if s.is_embedding} >= {n for n in params if n.startswith("embed.")}
    # Same config -> same model (what every process relies on); a config round-trips.
    assert models.model_fingerprint(models.get_model(name, model.config)) == models.model_fingerprint(model)
    batch = jax.random.randint(jax.random.PRNGKey(1), (2, model.seq_len + 1), 0, model.vocab_size)
    loss = float(jax.jit(model.loss)(params, batch))
    assert abs(loss - np.log(model.vocab_size)) < 1.0  # near uniform at initialization
    grads = jax.grad(model.loss)(params, batch)  # differentiable in the flat layout
    assert set(grads) == set(params) and all(np.isfinite(np.asarray(g)).all() for g in grads.values())
    with pytest.raises(ValueError, match="unknown config keys"):
        models.get_model(name, {"widht": 3})


class _Bigram(PytreeModel):
    """A plugin over a plain nested dict: logits = embed[token] + bias (no network library)."""

    name = "bigram"
    defaults = {"vocab_size": 5, "seq_len": 3}
    embedding_prefixes = ("embed.",)

    def __init__(self, config=None):
        super().__init__(config)
        self.set_layout(self._tree(0.0), lambda path: ".".join(str(key.key) for key in path))

    def _tree(self, fill):
        v = self.vocab_size
        return {"head": {"bias": jnp.full((v,), fill)}, "embed": {"weight": jnp.full((v, v), fill)}}

    def init(self, rng):
        return self.flatten(self._tree(0.0))

    def logits(self, params, tokens):
        tree = self.unflatten(params)
        return tree["embed"]["weight"][tokens] + tree["head"]["bias"]


def test_a_pytree_model_names_its_tensors_by_path_and_scores_next_tokens():
    model = _Bigram({"vocab_size": 4})
    assert [(s.name, s.shape, s.is_embedding) for s in model.tensor_specs()] == [
        ("embed.weight", (4, 4), True), ("head.bias", (4,), False)]  # flattening order: sorted dict keys
    assert (model.vocab_size, model.seq_len, model.config) == (4, 3, {"vocab_size": 4, "seq_len": 3})
    params = model.init(jax.random.PRNGKey(0))
    assert list(params) == ["embed.weight", "head.bias"] and all(v.dtype == np.float32 for v in params.values())
    batch = jnp.array([[0, 1, 2, 3]], jnp.int32)
    assert np.isclose(float(jax.jit(model.loss)(params, batch)), np.log(4))  # uniform logits
    # The bias favours token 3, which no target is: the loss grows; token 3 is no input, so its row gets no gradient.
    params["head.bias"] = jnp.array([0.0, 0.0, 0.0, 2.0])
    grads = jax.grad(model.loss)(params, batch)
    assert float(model.loss(params, batch)) > np.log(4) and np.asarray(grads["embed.weight"])[3].tolist() == [0.0] * 4
    assert np.allclose(np.asarray(model.unflatten(params)["head"]["bias"]), [0, 0, 0, 2])
    with pytest.raises(ValueError, match=r"bigram: unknown config keys \['vocab'\]"):
        _Bigram({"vocab": 3})


def test_a_model_may_bring_its_own_inner_optimizer(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    model = models.get_model("equinox_lm:build")
    optimizer = model.inner_optimizer(InnerOptConfig(decay_steps=100))
    params = model.init(jax.random.PRNGKey(0))
    updates, _ = optimizer.update(jax.tree.map(np.ones_like, params), optimizer.init(params), params)
    # AdamW without weight decay: the first update is -lr * sign(grad) for every tensor (Adam's
    # normalized step is 1 for a constant gradient), lr = the warm-up's first value.
    first_lr = 2e-3 / 21
    assert all(np.allclose(np.asarray(u), -first_lr, rtol=1e-3) for u in updates.values())
    assert isinstance(optimizer, optax.GradientTransformation)


def test_up_refuses_a_model_it_cannot_build_before_starting_anything(tmp_path):
    import subprocess

    result = subprocess.run([sys.executable, "-m", "ddiloco.cli.main", "up", "--model", "no_such_module_xyz:build",
                             "--workdir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "cannot import 'no_such_module_xyz'" in result.stdout and not (tmp_path / "run").exists()
