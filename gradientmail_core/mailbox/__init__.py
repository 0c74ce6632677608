"""Mailboxes: the contract a shared store meets, the backends that meet it, the wrappers around them.

``contract`` (``Mailbox``, the optional ranged read ``RangedMailbox`` and streams ``StreamingMailbox``,
``read_prefix``, ``write_stream``, ``read_stream``), ``retry``,
``create`` (``create_once``), ``forwarding`` (the base of every wrapper), ``counting``, ``urls``
(``open_mailbox``); the backends ``memory``, ``file``, ``s3``.
The fault injector lives outside the wheel, beside the simulation (``gradientmail_sim.faults``).
The key checks live with the keys (``protocol.keys``). See ``docs/backends.md``.
"""

from .contract import (
    Chunk,
    Mailbox,
    RangedMailbox,
    StreamingMailbox,
    check_list_args,
    check_object_key,
    check_object_keys,
    read_many,
    read_prefix,
    read_stream,
    write_stream,
)
from .counting import CountingMailbox
from .create import CreateOutcome, create_once
from .forwarding import ForwardingMailbox
from .retry import RetryPolicy, call_with_retries
from .urls import open_mailbox

__all__ = [
    "Chunk",
    "CountingMailbox",
    "CreateOutcome",
    "ForwardingMailbox",
    "Mailbox",
    "RangedMailbox",
    "RetryPolicy",
    "StreamingMailbox",
    "call_with_retries",
    "check_list_args",
    "check_object_key",
    "check_object_keys",
    "read_many",
    "create_once",
    "open_mailbox",
    "read_prefix",
    "read_stream",
    "write_stream",
]
