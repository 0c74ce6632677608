"""The work queue (``gm.WorkQueue``, ``docs/protocol.md`` section 7): dataset units handed out by
create-once claims, kept by heartbeats, finished by done markers, in the run's ``work/`` folder.

``queue`` (``WorkQueue``, ``Hold``), ``keys`` (every key of a queue, formatted and parsed),
``records`` (the five records), ``scan`` (a queue's state from one listing), ``auth`` (a queue's
records in an authenticated run).
"""
