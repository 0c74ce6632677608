"""Turning a round's contributions into a commit: which enter, how they merge, the outer step.

- ``acceptance``: whether a snapshot enters a round (``judge``) and which accepted contributions
  are outliers (``outlier_mask``).
- ``merge``: the formulas of a merge (weighted mean, RDA, clipping, contribution weights, the
  mean pairwise cosine), as definitions.
- ``fused``: how they are computed: one chunked pass over the contributions, on a few threads,
  bit for bit the definitions.
- ``outer``: the outer optimizer (Nesterov momentum) that applies the merged delta.
"""
