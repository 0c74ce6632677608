"""``log_events``: the message is ``describe()``, and the event's fields ride on the LogRecord
as structured data (``record.gm_event``, ``record.gm``) for handlers and JSON formatters."""

from __future__ import annotations

import json
import logging

import pytest

from gradientmail_core import events as ev

LOGGER = "gradientmail.events"


def logged(caplog: pytest.LogCaptureFixture, event: ev.Event) -> logging.LogRecord:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ev.log_events(event)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1
    return records[0]


def test_round_closed_carries_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    event = ev.RoundClosed(
        learner="a",
        round=3,
        fragment=1,
        participants=("a", "b"),
        rejected=(("c", "stale"),),
        cosine=0.5,
        grace_seconds=2.0,
    )
    record = logged(caplog, event)
    assert record.getMessage() == event.describe()
    assert record.levelno == logging.INFO
    assert record.gm_event == "RoundClosed"
    assert record.gm == {
        "learner": "a",
        "round": 3,
        "fragment": 1,
        "participants": ("a", "b"),
        "rejected": (("c", "stale"),),
        "cosine": 0.5,
        "grace_seconds": 2.0,
    }


def test_warnings_carry_their_fields_too(caplog: pytest.LogCaptureFixture) -> None:
    event = ev.StoreFailure(learner="b", error="timed out")
    record = logged(caplog, event)
    assert record.levelno == logging.WARNING
    assert record.getMessage() == event.describe()
    assert record.gm_event == "StoreFailure"
    assert record.gm == {"learner": "b", "error": "timed out"}


def test_defaults_and_none_are_kept_and_the_fields_serialize(caplog: pytest.LogCaptureFixture) -> None:
    event = ev.Aligned(learner="c", round=7, fragment=0, version=7, bytes=1024)
    record = logged(caplog, event)
    assert record.getMessage() == event.describe()
    assert record.gm_event == "Aligned"
    assert record.gm == {
        "learner": "c",
        "round": 7,
        "fragment": 0,
        "version": 7,
        "bytes": 1024,
        "participants": (),
        "cosine": None,
        "dropped": 0,
        "carried": 0,
    }
    assert json.loads(json.dumps(record.gm))["bytes"] == 1024  # what a JSON formatter would write


def test_nothing_is_logged_below_the_logger_level(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ev.log_events(ev.Left(learner="a", round=1))
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_the_message_text_is_one_line_naming_the_learner_the_event_and_its_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = logged(caplog, ev.Committed(learner="a", round=2, fragment=0, version=1, bytes_written=10))
    assert record.getMessage() == "[a] Committed round=2 fragment=0 version=1 bytes_written=10"
    assert record.levelno == logging.INFO
    record = logged(caplog, ev.TookOver(learner="b", round=5, previous="a", reason="lease_lost"))
    assert record.getMessage() == "[b] TookOver round=5 previous='a' reason='lease_lost'"
    assert record.levelno == logging.INFO


@pytest.mark.parametrize(
    "event",
    [
        ev.GaveUp(learner="a", round=3, reason="no round committed for 30 s while waiting to close"),
        ev.BackgroundFailed(learner="a", error="RuntimeError: boom"),
        ev.Superseded(learner="a", round=4, by="b"),
        ev.StoreFailure(learner="a", error="timed out"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_failures_and_lost_work_are_logged_at_warning(caplog: pytest.LogCaptureFixture, event: ev.Event) -> None:
    record = logged(caplog, event)
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(f"[a] {type(event).__name__} ")


def test_gave_up_message_text(caplog: pytest.LogCaptureFixture) -> None:
    record = logged(caplog, ev.GaveUp(learner="a", round=3, reason="stalled"))
    assert record.getMessage() == "[a] GaveUp round=3 reason='stalled'"
