"""``gradientmail members``: who may take part in a members-only run.

    gradientmail members key --identity node.key        this node's public key (creates the key file)
    gradientmail members list URL                        the membership log and the members now
    gradientmail members add URL --owner-key F PUBKEY... admit public keys (an owner-signed entry)
    gradientmail members remove URL --owner-key F PUBKEY...
                                                         revoke them: from the round after the first
                                                         commit that names the entry, nothing they
                                                         sign counts (docs/security.md)

The only commands that write; they write nothing but one create-once entry of the log.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..mailbox import Mailbox
from ..protocol import identity as ids
from ..protocol import keys
from ..protocol.members import change, read_log
from ..protocol.records import Manifest, decode
from .overview import NoRun

ACTIONS = ("key", "list", "add", "remove")

# What ``gradientmail members --help`` says.
DESCRIPTION = """\
Who may take part in a members-only run (docs/security.md). The only commands that write to a run,
and they write nothing but one create-once entry of its membership log.

  gradientmail members key --identity node.key         this node's public key (creates the key file)
  gradientmail members list URL                         the membership log and the members now
  gradientmail members add URL --owner-key F PUBKEY...  admit public keys (an entry the owner signs)
  gradientmail members remove URL --owner-key F PUBKEY...
                                                        revoke them: from the round after the first
                                                        commit that names the entry, nothing they
                                                        sign counts"""


def add_parser(sub: Any) -> None:
    arguments(
        sub.add_parser(
            "members",
            help="who may take part in a members-only run: key, list, add, remove",
            description=DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def arguments(m: argparse.ArgumentParser) -> None:
    m.add_argument("action", choices=ACTIONS)
    m.add_argument("url", nargs="?", help="the run's mailbox (not for 'key')")
    m.add_argument("pubkeys", nargs="*", metavar="PUBKEY", help="public keys, 64 hex characters (add, remove)")
    m.add_argument("--owner-key", metavar="F", help="the run owner's key file (add, remove)")
    m.add_argument("--identity", metavar="F", help="a node's key file, created if missing (key)")
    m.add_argument("--endpoint-url", help="S3-compatible endpoint (R2, MinIO, moto), for s3:// URLs")
    m.add_argument("--region", help="S3 region, for s3:// URLs")
    m.add_argument("--json", action="store_true", help="list: one JSON object per entry")


def _manifest(mailbox: Mailbox) -> Manifest:
    data = mailbox.get(keys.MANIFEST)
    if data is None:
        raise NoRun(f"{keys.MANIFEST} is missing")
    return decode(data, Manifest, key=keys.MANIFEST)


def run(args: argparse.Namespace, open_mailbox: Any) -> int:
    if args.action == "key":
        if not args.identity:
            raise ValueError("members key needs --identity F (the key file; created if missing)")
        me = ids.Identity.load(args.identity)
        print(me.public_hex)
        return 0
    if not args.url:
        raise ValueError(f"members {args.action} needs the run's URL")
    mailbox = open_mailbox(args.url, endpoint_url=args.endpoint_url, region=args.region)
    manifest = _manifest(mailbox)
    if args.action == "list":
        return _list(mailbox, manifest, args.json)
    if not args.owner_key:
        raise ValueError(f"members {args.action} needs --owner-key F (the run owner's key file)")
    if not args.pubkeys:
        raise ValueError(f"members {args.action} needs at least one PUBKEY (see: gradientmail members key)")
    owner = ids.Identity.load(args.owner_key, create=False)
    field = "add" if args.action == "add" else "remove"
    key, log = change(mailbox, manifest, owner, **{field: [k.lower() for k in args.pubkeys]})
    verb = "admitted" if field == "add" else "revoked"
    print(
        f"{key}: {verb} {', '.join(ids.fingerprint(k.lower()) for k in args.pubkeys)}; {len(log.current()[0])} members"
    )
    return 0


def _list(mailbox: Mailbox, manifest: Manifest, as_json: bool) -> int:
    bad: list[tuple[str, str]] = []
    log = read_log(mailbox, manifest, lambda k, why: bad.append((k, why)))
    chain = []
    e = log.head
    while e is not None:
        chain.append(e)
        e = log.entries.get(e.record.prev) if e.seq > 0 else None
    chain.reverse()
    if as_json:
        for e in chain:
            print(json.dumps({"seq": e.seq, "sha256": e.sha, "add": e.record.add, "remove": e.record.remove}))
        return 0
    assert manifest.owner is not None
    print(f"owner {ids.fingerprint(manifest.owner)}  ({manifest.owner})")
    for e in chain:
        parts = [f"+{ids.fingerprint(k)}" for k in e.record.add] + [f"-{ids.fingerprint(k)}" for k in e.record.remove]
        print(f"entry {e.seq:>4}  {e.sha[:12]}  {' '.join(parts) or '(no change)'}  {e.record.note}".rstrip())
    members, removed = log.current()
    print(f"members now ({len(members)}):")
    for k in sorted(members):
        print(f"  {ids.fingerprint(k)}  {k}")
    if removed:
        print(f"revoked ({len(removed)}): {', '.join(sorted(ids.fingerprint(k) for k in removed))}")
    for k, why in bad:
        print(f"ignored {k}: {why}")
    return 0
