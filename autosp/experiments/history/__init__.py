"""`autosp history`: the regression history (a store of raw samples per commit and machine, the fixed suites, the
comparisons, figures and dashboard)."""
