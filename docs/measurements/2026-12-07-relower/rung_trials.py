"""Each rung a ladder's search partitions (its k, estimated peak and saved bytes) logged, around an `autosp` command:
a one-off diagnostic. python rung_trials.py simulate ... (from the repository's root, PYTHONPATH set)."""
import sys
import time

from autosp.cli import main
from autosp.compiler.memory import planner, rungs

search = rungs.smallest_fitting_rung


def logged(make, count, fits, budget):
    def made(k):
        start = time.process_time()
        t = make(k)
        print(f"    k={k} peak={t.peak} saved={t.saved} fits={fits(t)} budget={budget} "
              f"{time.process_time() - start:.1f}s", flush=True)
        return t

    print(f"  line count={count}", flush=True)
    return search(made, count, fits, budget)


planner.smallest_fitting_rung = logged
sys.exit(main(sys.argv[1:]))
