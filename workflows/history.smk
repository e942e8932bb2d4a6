# Regression history (issue 14): `snakemake --cores all regression` runs the fixed suite at HEAD, records it
# and compares it with the last commit recorded on the same machine; the job fails (exit 1 of
# `autosp history compare`) when anything regressed, so CI can gate on it. `figure_history` draws the store.
# Self-contained: only config keys below, each with a default (override with --config history_suite=cuda ...).
# The store is never a rule output: Snakemake deletes the outputs of a failed job, and the history must survive.

HISTORY_CLI = config.get("autosp", "autosp")
HISTORY_STORE = config.get("history_store", "results/history/history.sqlite")
HISTORY_SUITE = config.get("history_suite", "cpu")
HISTORY_THRESHOLD = config.get("history_threshold", "5%")


rule regression:
    output:
        "results/history/regression-report.txt",
    log:
        "results/logs/history/regression.log",
    shell:  # the report is the output only when nothing regressed; otherwise it is in the log and the job fails
        "{HISTORY_CLI} history run --suite {HISTORY_SUITE} --store {HISTORY_STORE} > {log} 2>&1;"
        " if {HISTORY_CLI} history compare --store {HISTORY_STORE} --threshold {HISTORY_THRESHOLD}"
        " > {output}.tmp 2>> {log}; then cat {output}.tmp >> {log}; mv {output}.tmp {output};"
        " else cat {output}.tmp >> {log}; rm -f {output}.tmp; exit 1; fi"


rule figure_history:
    output:
        png="figures/history.png",
        pdf="figures/history.pdf",
        html="results/history/index.html",
    shell:
        "{HISTORY_CLI} history plot --store {HISTORY_STORE} --threshold {HISTORY_THRESHOLD}"
        " --out {output.png} --html {output.html}"
