# AutoSP experiments: the paper's four figures and their tables.
#
#   snakemake --cores all figure_trainability                 # local default (CPU, 2 gloo ranks, tiny + small)
#   snakemake --profile profiles/a100 all                     # a GPU type: a100, gh200, mi250
#   snakemake --profile profiles/slurm --profile ... all      # through SLURM (see README)
#
# Thin on purpose: every rule calls the `autosp` CLI, all logic lives in the package. Settings are in
# config/config.yaml (overridden by a profile's settings or --config key=value), validated against
# workflows/schemas/config.schema.yaml before anything runs.

import os

from snakemake.utils import validate


configfile: os.path.join(workflow.basedir, "config/config.yaml")  # the defaults; a profile or --configfile overrides


validate(config, "workflows/schemas/config.schema.yaml")


include: "workflows/common.smk"
include: "workflows/trainability.smk"
include: "workflows/throughput.smk"
include: "workflows/memory.smk"
include: "workflows/sac.smk"


rule tables:  # CSV + Markdown + LaTeX (booktabs), one per figure
    input:
        rules.trainability_table.output,
        rules.throughput_table.output,
        rules.memory_table.output,
        rules.sac_table.output,


rule all:
    input:
        rules.figure_trainability.output,
        rules.figure_throughput.output,
        rules.figure_memory.output,
        rules.figure_sac.output,
        rules.tables.output,


localrules:
    all,
    tables,


include: "workflows/history.smk"
