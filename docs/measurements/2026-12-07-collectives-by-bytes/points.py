"""One-off (not part of the package): each rank's (work, all-reduce after it) points as `autosp calibrate` measures
them, and the latency and wait fitted to them, for several runs: `python points.py REPEATS RUNS`."""
import sys

from autosp.experiments.calibrate import fit_latency_and_wait, measure_rank
from autosp.harness.launch import launch_local

if __name__ == "__main__":
    repeats = int(sys.argv[1])
    for _ in range(int(sys.argv[2])):
        result = launch_local(measure_rank, (repeats,), world_size=2, device="cpu", timeout_s=600)
        for r in result.results:
            pts = r["collective_points"]
            lat, wait = fit_latency_and_wait(pts)
            print(" ".join(f"{w*1e3:.2f}ms:{s*1e6:.0f}us" for w, s in pts), f"fit {lat*1e6:.0f} {wait*1e6:.0f}")
        print()
