"""The simulator's engine model against the paper's Table 3 (one H100 instance, one WebShop step, CTB off/on).

Prints a table and, with `--json PATH`, writes the numbers (`benchmarks/results/sim_table3.json`). The model is
checked against the measurement, not fitted to it: see `verl_tide/sim/calibration.py`.
"""

from __future__ import annotations

import argparse
import json

from verl_tide.sim.calibration import check_table3, format_table3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: must be >= 1")
    report = check_table3(seeds=range(args.seeds))
    print(format_table3(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
