"""Four frameworks against four torch nodes: the held-out loss of one run trained by a torch, an MLX,
a Flax NNX and a Keras (jax backend) node, each with the same small transformer LM written natively in
its framework and joined through the layout rules, over a run of the same config with four torch
nodes (the nodes of ``tests/test_four_frameworks.py``, lockstep, over a file mailbox).

    python bench/frameworks.py --steps 96 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_four_frameworks as four  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=96, help="optimizer steps per node")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    arms = {"mixed": four.FOUR, "torch": [("torch", learner) for _, learner in four.FOUR]}
    losses: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for arm, nodes in arms.items():
                d = Path(tmp) / f"{arm}-{i}"
                d.mkdir()
                t0 = time.monotonic()
                results = four.run_nodes(d, nodes, ["--steps", str(args.steps)], timeout=900)
                by_node = {f"{r['learner']}:{r['framework']}": r["held_out_loss"] for r in results}
                losses[arm].append(statistics.fmean(by_node.values()))
                print(f"{arm} #{i}: {time.monotonic() - t0:.0f} s, held-out loss per node {json.dumps(by_node)}")
    mixed, torch_only = statistics.fmean(losses["mixed"]), statistics.fmean(losses["torch"])
    ratio = mixed / torch_only
    print(f"held-out loss: four frameworks {mixed:.5f}, four torch nodes {torch_only:.5f}, ratio {ratio:.4f}")
    print(json.dumps({"steps": args.steps, "mixed": mixed, "torch": torch_only, "ratio": ratio}))


if __name__ == "__main__":
    main()
