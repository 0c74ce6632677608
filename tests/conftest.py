"""Shared fixtures: a real S3 HTTP endpoint on loopback (moto), fresh buckets, and mailboxes.

The ``mailbox`` fixture runs a test once per backend (memory, file, s3); S3 tests talk to a
``moto`` server over HTTP, exactly as they would to MinIO or AWS, never to moto's in-process
mock. The server starts only when a test asks for it.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import secrets
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from gradientmail_core.mailbox import Mailbox, open_mailbox

# Dummy credentials, set at import so that subprocesses started by tests inherit them too;
# the config-file and metadata settings keep boto3 from reading ~/.aws or probing EC2.
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}
os.environ.update(_AWS_ENV)
# pytest-xdist's workers set COLUMNS=80 and LINES=24, which a serial run never has: the CLI would
# squeeze its tables to 80 columns there (and in the processes a test starts) and cut long paths.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)


# The files that take longest (about a minute or more each on two cores: scripts/test.sh prints the
# slowest tests), run first: with the suite spread over workers (pytest-xdist, ``--dist loadscope``,
# scripts/test.sh) a long file that starts last would leave the other worker idle at the end.
# Order is only a schedule: no test depends on another having run.
_LONG_FIRST = (
    "test_goodput_chaos.py",
    "test_sim.py",
    "test_engine_processes.py",
    "test_sim_mutants.py",
    "test_sharded_closer.py",
    "test_sharded_lightning.py",
    "test_sharded_session.py",
    "test_chaos.py",
    "test_examples.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Every process a test started and left running is killed when the test ends, passed or failed:
    a failed assertion in a multi-process test otherwise leaves its learners waiting for a closer
    forever, loading the machine under every test after it. (Only the call: a module's fixture may
    start a cluster its tests share.)"""
    started: list[subprocess.Popen[Any]] = []
    init = subprocess.Popen.__init__

    def tracked(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        started.append(self)

    subprocess.Popen.__init__ = tracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = init  # type: ignore[method-assign]
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 and a free port, for the whole session."""
    if importlib.util.find_spec("moto") is None:
        pytest.skip("moto[server] is not installed")
    import moto.server as server_mod  # (installed: an import that fails is an error, never a skip)

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_client(s3_server: str) -> Any:
    """A plain boto3 client of the moto server, to look at what a test left there (one per
    session: building a client costs a few hundred ms)."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server)


_bucket_ids = itertools.count()


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh, empty bucket on the moto server; its name."""
    import boto3

    name = f"gm-test-{next(_bucket_ids)}-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@dataclass
class MailboxTarget:
    """Where a fresh mailbox lives: its URL plus the options ``open_mailbox`` needs.

    Tests that start other processes hand them ``url`` and ``options`` (JSON-safe).
    """

    kind: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)

    def open(self, **overrides: Any) -> Mailbox:
        return open_mailbox(self.url, **{**self.options, **overrides})


@pytest.fixture(params=["memory", "file", "s3"])
def mailbox_target(request: pytest.FixtureRequest, tmp_path: Any) -> MailboxTarget:
    kind = request.param
    if kind == "memory":
        return MailboxTarget(kind, f"memory://test-{secrets.token_hex(8)}")
    if kind == "file":
        return MailboxTarget(kind, f"file://{tmp_path / 'mailbox'}")
    bucket = request.getfixturevalue("s3_bucket")
    endpoint = request.getfixturevalue("s3_server")
    return MailboxTarget(kind, f"s3://{bucket}/runs/run-1", {"endpoint_url": endpoint})


@pytest.fixture
def mailbox(mailbox_target: MailboxTarget) -> Mailbox:
    """A fresh, empty mailbox; the test runs once per backend."""
    return mailbox_target.open()


@pytest.fixture
def mailbox_factory(mailbox_target: MailboxTarget) -> Callable[..., Mailbox]:
    """Opens more handles on the same fresh mailbox (e.g. with other options), once per backend."""
    return mailbox_target.open
