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


# What a bare `snakemake` plans: the quick start's figure (a rule of an included file is never the default target,
# and without this the first rule here, `tables`, would be).
rule quick_start:
    default_target: True
    input:
        rules.figure_trainability.input,


rule tables:  # CSV + Markdown + LaTeX (booktabs), one per figure
    input:
        trainability_outputs("results/tables/trainability{scope}.csv"),
        trainability_outputs("results/tables/trainability{scope}.md"),
        trainability_outputs("results/tables/trainability{scope}.tex"),
        rules.throughput_table.output,
        rules.memory_table.output,
        rules.sac_table.output,


rule all:
    input:
        trainability_outputs("figures/trainability{scope}.png"),
        trainability_outputs("figures/trainability{scope}.pdf"),
        rules.figure_throughput.output,
        rules.figure_memory.output,
        rules.figure_sac.output,
        rules.tables.output,


localrules:
    all,
    quick_start,
    tables,
    figure_trainability,


include: "workflows/history.smk"
