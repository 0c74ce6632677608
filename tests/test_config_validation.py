"""``gm.DiLoCo`` and its parts refuse every bad value at construction, with a ValueError
that names the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

import gradientmail_core as gm

BASE = {"sync_every": 8, "fragments": 2}

BAD = [
    ("sync_every", {"sync_every": 0}),
    ("sync_every", {"sync_every": -3}),
    ("sync_every", {"sync_every": 2.5}),
    ("sync_every", {"sync_every": True}),
    ("fragments", {"fragments": 0}),
    ("fragments", {"fragments": "2"}),
    ("quorum_size", {"quorum_size": 0}),
    ("quorum_size", {"quorum_size": False}),
    ("in_flight", {"in_flight": 0}),
    ("in_flight", {"in_flight": 3}),  # more than fragments
    ("in_flight", {"in_flight": 1.0}),
    ("in_flight", {"in_flight": True}),
    ("fragments", {"fragments": 9}),  # more fragments than sync_every steps
    ("overlap_steps", {"overlap_steps": -1}),
    ("overlap_steps", {"overlap_steps": 1.5}),
    ("overlap_steps", {"overlap_steps": True}),
    ("mixing", {"mixing": 1.0}),
    ("mixing", {"mixing": -0.1}),
    ("mixing", {"mixing": "0.5"}),
    ("outer_lr", {"outer_lr": 0}),
    ("outer_lr", {"outer_lr": -0.7}),
    ("outer_lr", {"outer_lr": None}),
    ("outer_momentum", {"outer_momentum": 1.0}),
    ("outer_momentum", {"outer_momentum": -0.1}),
    ("merge", {"merge": "rda"}),
    ("merge", {"merge": gm.Balanced()}),
    ("partition", {"partition": "balanced"}),
    ("partition", {"partition": gm.RDA()}),
    ("global_batch_size", {"global_batch_size": 0}),
    ("global_batch_size", {"global_batch_size": 2.0}),
    ("delta_dtype", {"delta_dtype": "F64"}),
    ("delta_dtype", {"delta_dtype": "bf16"}),
    ("commit_dtype", {"commit_dtype": "int8"}),
    ("outlier_factor", {"outlier_factor": 1.0}),
    ("outlier_factor", {"outlier_factor": math.inf}),
    ("outlier_factor", {"outlier_factor": math.nan}),
    ("outlier_factor", {"outlier_factor": True}),
    ("clip_norm", {"clip_norm": 0}),
    ("clip_norm", {"clip_norm": -1.0}),
    ("clip_norm", {"clip_norm": math.inf}),
    ("clip_norm", {"clip_norm": "1"}),
]


@pytest.mark.parametrize(("field", "change"), BAD, ids=[f"{f}={v!r}" for f, c in BAD for v in c.values()])
def test_a_bad_value_is_a_value_error_naming_the_field(field: str, change: dict) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        gm.DiLoCo(**{**BASE, **change})


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"in_flight": 1, "overlap_steps": 0, "quorum_size": 3},
        {"mixing": 0.5, "outer_lr": 1, "outer_momentum": 0},
        {"merge": gm.WeightedMean(), "partition": gm.Strided()},
        {"global_batch_size": 64, "delta_dtype": "F4", "commit_dtype": "BF16"},
        {"delta_dtype": "I2", "commit_dtype": "I2"},
        {"outlier_factor": 3, "clip_norm": 1},
        {"sync_every": 2, "fragments": 2, "in_flight": 2},
    ],
)
def test_good_values_are_accepted(change: dict) -> None:
    cfg = gm.DiLoCo(**{**BASE, **change})
    assert gm.DiLoCo.from_dict(cfg.to_dict()) == cfg


def test_in_flight_defaults_to_at_most_two() -> None:
    assert gm.DiLoCo(sync_every=8, fragments=1).in_flight == 1
    assert gm.DiLoCo(sync_every=8, fragments=4).in_flight == 2


@pytest.mark.parametrize("pattern", ["(", r"\.\d+\.", "[unclosed"])
def test_strided_refuses_a_pattern_without_a_block_group(pattern: str) -> None:
    with pytest.raises(ValueError, match="block_pattern"):
        gm.Strided(block_pattern=pattern)


@pytest.mark.parametrize(
    "data",
    [
        {"merge": {"kind": "median"}},
        {"merge": "rda"},
        {"partition": {"kind": "random"}},
        {"partition": ["balanced"]},
    ],
)
def test_a_run_config_with_an_unknown_part_is_refused(data: dict) -> None:
    d = {**gm.DiLoCo(**BASE).to_dict(), **data}
    with pytest.raises(ValueError, match="merge|partition"):
        gm.DiLoCo.from_dict(d)


def test_a_run_config_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(ValueError, match="surprise"):
        gm.DiLoCo.from_dict({**gm.DiLoCo(**BASE).to_dict(), "surprise": 1})


def test_the_frugal_preset_is_i2_deltas_with_feedback_f4_commits_and_sparse_checkpoints() -> None:
    cfg = gm.DiLoCo.frugal(sync_every=20)
    assert (cfg.delta_dtype, cfg.error_feedback, cfg.commit_dtype, cfg.checkpoint_every) == ("I2", True, "F4", 10)
    # the rest is the plain config's, and survives the manifest
    assert dataclasses.replace(cfg, delta_dtype=None, error_feedback=False, commit_dtype=None, checkpoint_every=1) == (
        gm.DiLoCo(sync_every=20, fragments=1)
    )
    assert gm.DiLoCo.from_dict(cfg.to_dict()) == cfg


def test_an_option_given_to_the_frugal_preset_wins_over_the_presets_own() -> None:
    cfg = gm.DiLoCo.frugal(sync_every=40, fragments=4, commit_dtype="I2", quorum_size=4)
    assert (cfg.fragments, cfg.commit_dtype, cfg.quorum_size, cfg.delta_dtype) == (4, "I2", 4, "I2")
    with pytest.raises(ValueError, match="checkpoint_every"):
        gm.DiLoCo.frugal(sync_every=20, commit_dtype=None)


def test_gap_projection_needs_quantized_commits_and_a_manifest_keeps_it() -> None:
    with pytest.raises(ValueError, match="gap_projection=True, commit_dtype=None"):
        gm.DiLoCo(sync_every=20, fragments=1, gap_projection=True)
    with pytest.raises(ValueError, match="expected True or False"):
        gm.DiLoCo(sync_every=20, fragments=1, commit_dtype="I2", gap_projection=1)  # type: ignore[arg-type]
    cfg = gm.DiLoCo(sync_every=20, fragments=1, commit_dtype="I2", gap_projection=True)
    assert cfg.to_dict()["gap_projection"] is True and gm.DiLoCo.from_dict(cfg.to_dict()) == cfg
    # off, the default: a manifest without the field (every run before it) reads as off and agrees
    plain = gm.DiLoCo(sync_every=20, fragments=1, commit_dtype="I2")
    assert "gap_projection" not in plain.to_dict() and gm.DiLoCo.from_dict(plain.to_dict()) == plain


def test_the_frontier_preset_is_frugal_with_i2_commits_and_the_gap_projection() -> None:
    cfg = gm.DiLoCo.frontier(sync_every=20, fragments=2)
    assert (cfg.delta_dtype, cfg.error_feedback, cfg.commit_dtype, cfg.checkpoint_every, cfg.gap_projection) == (
        "I2",
        True,
        "I2",
        10,
        True,
    )
    assert dataclasses.replace(cfg, commit_dtype="F4", gap_projection=False) == gm.DiLoCo.frugal(
        sync_every=20, fragments=2
    )
    assert gm.DiLoCo.from_dict(cfg.to_dict()) == cfg
    assert gm.DiLoCo.frontier(sync_every=20, commit_dtype="F4").commit_dtype == "F4"  # an option given wins
