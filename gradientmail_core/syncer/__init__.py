"""The background node (following the tape, election, closing, GC), the closer, the learner, the bridge."""
