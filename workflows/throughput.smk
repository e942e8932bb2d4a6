# Iteration time and tokens/s vs sequence length: all methods of one model in one bench job, with repeats
# interleaved, so every ratio is taken against a reference measured in the same run on the same machine state.
TP = config["throughput"]


rule bench:
    output:
        "results/throughput/{device_type}/P{world_size}/{model}.jsonl",
    log:
        "results/logs/bench/{device_type}/P{world_size}/{model}.log",
    benchmark:
        "results/benchmarks/bench/{device_type}/P{world_size}/{model}.tsv"
    message:
        "throughput {wildcards.model} P={wildcards.world_size} {wildcards.device_type}: {params.methods} [{threads} cores, {resources.gpu} GPUs x {resources.nodes} nodes] (log: {log})"
    threads: RANK_THREADS
    resources:
        gpu=GPUS,
        nodes=NODES,
    params:
        methods=",".join(TP["methods"]),
        seq_lens=",".join(str(n) for n in TP["seq_lens"]),
        flags=lambda w: common_flags("autosp"),
        budget=lambda w: budget_flag(w.model, TP["memory_budget"]),
    shell:
        "{config[autosp]} bench --methods {params.methods} --model {wildcards.model} --seq-lens {params.seq_lens}"
        " {params.flags} {params.budget} --repeats {TP[repeats]} --ratio-to {TP[reference]}"
        " --timeout {config[probe_timeout_s]} --out {output} > {log} 2>&1"


THROUGHPUT_RESULTS = [setting(f"results/throughput/{{device_type}}/P{{world_size}}/{m}.jsonl") for m in TP["models"]]


rule throughput_table:
    input:
        THROUGHPUT_RESULTS,
    output:
        csv="results/tables/throughput.csv",
        md="results/tables/throughput.md",
        tex="results/tables/throughput.tex",
    shell:
        "{config[autosp]} table throughput --in {input} --ratio-to {TP[reference]} --out {output.csv}"


rule figure_throughput:
    input:
        records=THROUGHPUT_RESULTS,
        table=rules.throughput_table.output,
    output:
        png="figures/throughput.png",
        pdf="figures/throughput.pdf",
    shell:
        "{config[autosp]} plot throughput --in {input.records} --ratio-to {TP[reference]} --out {output.png} {output.pdf}"
