"""The syncer core is a facade (issue 22): the servicer, the service's entry point, the wire views,
the history and metrics observers and the checkpoint benchmark call the core's methods, never its
parts; the core holds no protobuf; and it is built from plain settings that carry every knob of the
SyncerConfig.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

from google.protobuf import message

from services.syncer import config as config_lib
from services.syncer import core as core_lib
from tests import fakes

ROOT = pathlib.Path(__file__).resolve().parents[2]
CALLERS = ("services/syncer/servicer.py", "services/syncer/__main__.py", "services/syncer/wire_views.py",
           "services/syncer/history.py", "services/syncer/metrics.py", "ddiloco/bench/checkpoint_cost.py")
# The core's parts and their state: reached through the facade only.
PARTS = frozenset({"slots", "owned_slots", "members", "membership", "admission", "intake", "rounds", "publisher", "downloads",
                   "watchers", "observers", "uploads", "influence", "evals", "snapshots", "directions", "config"})


def _is_core(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("core", "_core")
    return isinstance(node, ast.Attribute) and node.attr == "_core"


def reaches_into_parts(source: str) -> list[str]:
    """`core.<part>` (or `self._core.<part>`) in `source`, by line."""
    return [f"{node.lineno}: core.{node.attr}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in PARTS and _is_core(node.value)]


def test_the_callers_of_the_core_use_its_facade_only():
    found = {path: hits for path in CALLERS if (hits := reaches_into_parts((ROOT / path).read_text()))}
    assert found == {}, "give SyncerCore a method for it instead"


def test_the_check_sees_each_way_of_reaching_a_part():
    # The negative case: each of these reaches past the facade.
    for source in ("core.slots[0].version\n", "self._core.uploads['x'] += 1\n", "x = core.membership.members\n"):
        assert reaches_into_parts(source), source
    assert reaches_into_parts("core.versions()\nself._core.run.chunk_size_bytes\n") == []


def test_the_core_holds_no_protobuf(clock):
    core = fakes.make_core(clock)
    held = {name: type(value).__name__ for name, value in vars(core).items() if isinstance(value, message.Message)}
    assert held == {}
    assert core.run.max_staleness_versions == fakes.CONFIG_DEFAULTS["max_staleness_versions"]


def test_the_core_settings_take_each_knob_from_the_syncer_config():
    cfg = config_lib.SyncerConfig(outer_lr=0.3, outer_momentum=0.5, grace_gamma=0.25, max_grace_s=7.0,
                                  liveness_timeout_s=9.0, merge_history=5, quarantine_after=2,
                                  quarantine_window_s=60.0, quarantine_s=0.0, round_trigger="upload",
                                  outer_step_fraction="steps", token_budget=1000, norm_bound_factor=4.0)
    settings = core_lib.CoreSettings.of(cfg)
    renamed = {"direction": "direction_policy"}
    for field in dataclasses.fields(settings):
        if field.name != "max_decoding":  # the core's own bound unless a test sets one
            assert getattr(settings, field.name) == getattr(cfg, renamed.get(field.name, field.name)), field.name
    assert settings.norm_bound.factor == 4.0 and settings.shard_layout == cfg.shard_layout
