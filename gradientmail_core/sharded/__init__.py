"""Sharded nodes: a ``gm.Session`` over a model whose parameters are FSDP2 DTensors (issue 13,
``docs/sharding.md``). Every rank of the node opens the session under one learner id; rank 0 runs
the protocol, and every rank publishes and aligns only its own part of each fragment, chunk by
chunk (``runtime.py``: the session's host on this rank, ``lead_rank.py`` or ``peer_rank.py``;
``rank_io.py``: one rank's shards and chunks; ``wire.py``: how the ranks talk). ``gm.Session`` picks this up by itself (``adapters.adapter_for``)."""
