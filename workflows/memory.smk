# Activation memory by operator category (attention, MLP, norm, other): one run per method at one length,
# bytes saved for backward per rank. `method:policy` names an AutoSP run with that SAC policy.
AM = config["activation_memory"]


def run_flags(label):
    """`--method M [--sac P]`, and one rank for `single` (the one-device reference)."""
    method, _, policy = label.partition(":")
    flags = f"--method {method} {common_flags(method)}" + (f" --sac {policy}" if policy else "")
    return flags.replace(f"--world-size {config['world_size']}", "--world-size 1") if method == "single" else flags


rule activations:
    output:
        "results/memory/{device_type}/P{world_size}/{model}/{label}.jsonl",
    log:
        "results/logs/memory/{device_type}/P{world_size}/{model}/{label}.log",
    benchmark:
        "results/benchmarks/memory/{device_type}/P{world_size}/{model}/{label}.tsv"
    message:
        "activation memory {wildcards.label} {wildcards.model} S={AM[seq_len]} [{threads} cores, {resources.gpu} GPUs x {resources.nodes} nodes] (log: {log})"
    wildcard_constraints:
        label=r"[a-z0-9][a-z0-9_-]*(:[a-z0-9=.]+)?",
    threads: RANK_THREADS
    resources:
        gpu=GPUS,
        nodes=NODES,
    params:
        flags=lambda w: run_flags(w.label),
    shell:
        "{config[autosp]} activations {params.flags} --model {wildcards.model} --seq-len {AM[seq_len]}"
        " --timeout {config[probe_timeout_s]} --out {output} > {log} 2>&1" + KEEP_WRITTEN_RESULT


MEMORY_RESULTS = [setting(f"results/memory/{{device_type}}/P{{world_size}}/{AM['model']}/{label}.jsonl")
                  for label in AM["methods"]]


rule memory_table:
    input:
        MEMORY_RESULTS,
    output:
        csv="results/tables/memory.csv",
        md="results/tables/memory.md",
        tex="results/tables/memory.tex",
    shell:
        "{config[autosp]} table memory --in {input} --baseline {AM[baseline]} --out {output.csv}"


rule figure_memory:
    input:
        records=MEMORY_RESULTS,
        table=rules.memory_table.output,
    output:
        png="figures/memory.png",
        pdf="figures/memory.pdf",
    shell:
        "{config[autosp]} plot memory --in {input.records} --baseline {AM[baseline]} --out {output.png} {output.pdf}"
