"""Issue 31: N consecutive runs of the previously flaky checks, each run fresh (new launches, nothing cached):
the hybrid two-head exactness cases (hybrid-4 on 4 ranks, hybrid-2-ring on 2, as test_coverage.CASES defines them)
and test_simulate's compiled-method peak test. Stops at the first failure and prints it.

    PYTHONPATH=<clone> python -m tests.harness.repeat_flaky N
"""
import os
import sys
import time
import traceback

from tests.compiler.exactness import ExactnessRuns
from tests.compiler.test_coverage import CASES
from tests.experiments import test_simulate

n = int(sys.argv[1])
for i in range(n):
    t0, c0 = time.time(), time.process_time()
    load = os.getloadavg()[0]
    try:
        runs = ExactnessRuns({k: CASES[k] for k in ("hybrid-4", "hybrid-2-ring")})
        worst = {k: runs.assert_exact(k) for k in ("hybrid-4", "hybrid-2-ring")}
        test_simulate.test_simulated_peak_matches_the_measured_one_for_a_compiled_method()
    except BaseException:
        print(f"run {i}: FAILED after {time.time() - t0:.0f} s, load {load:.1f}", flush=True)
        traceback.print_exc()
        sys.exit(1)
    errs = {k: max(v for kk, v in w.items() if kk != "choice") for k, w in worst.items()}
    print(f"run {i}: passed in {time.time() - t0:.0f} s wall, load at start {load:.1f}, worst errors {errs}",
          flush=True)
print(f"{n} consecutive runs, 0 failures")
