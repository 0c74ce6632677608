"""The integrations' options are ``gm.Session``'s, defined once: they cannot drift apart."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import gradientmail_core as gm
from gradientmail_lightning.options import SessionOptions

_OWN = {"wait_for_learners", "wait_timeout", "module"}  # the integrations' own, not the session's


def test_every_session_option_is_an_integration_option_with_the_same_default():
    session = {n: p.default for n, p in inspect.signature(gm.Session).parameters.items() if n not in ("self", "model")}
    ours = {f.name: f.default for f in dataclasses.fields(SessionOptions) if f.name not in _OWN}
    assert set(ours) == set(session)
    for name, default in session.items():
        if default is inspect.Parameter.empty:
            assert ours[name] is dataclasses.MISSING, name
        else:
            assert ours[name] == default, name


def test_a_misspelt_option_names_the_valid_ones():
    with pytest.raises(TypeError, match="poll_interval"):
        SessionOptions.from_kwargs(
            "GradientMailCallback",
            {"algorithm": gm.DiLoCo(sync_every=4, fragments=1), "mailbox": gm.MemoryMailbox(), "pol": 1},
        )
