"""The storage protocol: keys, records, the schedule, the run and its tape, leases, the typed store."""
