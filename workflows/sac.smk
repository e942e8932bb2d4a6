# SAC's price and payoff per policy: its max trainable length (a search cell) and its step time at one
# length (a bench), both against policy `off` (the SP pass alone), as the paper's ~7% / 1.66x. Each policy in the
# paper's setting (`autosp[paper]`: nothing offloaded) with the loss and MLPs tiled, as these cells always ran.
SAC = config["sac"]
SAC_FLAGS = "--tiling auto --offload off"


rule sac_search:
    output:
        "results/sac/{device_type}/P{world_size}/{model}/search-{policy}.jsonl",
    log:
        "results/logs/sac/{device_type}/P{world_size}/{model}/search-{policy}.log",
    benchmark:
        "results/benchmarks/sac/{device_type}/P{world_size}/{model}/search-{policy}.tsv"
    message:
        "cell autosp sac={wildcards.policy} {wildcards.model}: searching [{threads} cores, {resources.gpu} GPUs x {resources.nodes} nodes] (log: {log})"
    threads: RANK_THREADS
    resources:
        gpu=GPUS,
        nodes=NODES,
    params:
        command=lambda w, output: search_command("autosp", w.model, output[0],
                                                 f"--sac {w.policy} {SAC_FLAGS} --no-fail-on-error"),
        record_failure=lambda w, output: search_command("autosp", w.model, output[0], f"--sac {w.policy} {SAC_FLAGS}"),
    shell:
        "{params.command} > {log} 2>&1"
        " || {{ " + INTERRUPTED_FAILS + " reason=\"search exited with status $rc: $(grep -v '^USDT' {log} | tail -n 1 || true)\";"
        " {params.record_failure} --record-failure \"$reason\" >> {log} 2>&1; }}"


rule sac_bench:
    output:
        "results/sac/{device_type}/P{world_size}/{model}/bench-{policy}.jsonl",
    log:
        "results/logs/sac/{device_type}/P{world_size}/{model}/bench-{policy}.log",
    benchmark:
        "results/benchmarks/sac/{device_type}/P{world_size}/{model}/bench-{policy}.tsv"
    message:
        "autosp sac={wildcards.policy} {wildcards.model}: step time at S={SAC[seq_len]} [{threads} cores, {resources.gpu} GPUs x {resources.nodes} nodes] (log: {log})"
    threads: RANK_THREADS
    resources:
        gpu=GPUS,
        nodes=NODES,
    params:
        flags=common_flags("autosp"),
    shell:
        "{config[autosp]} bench --methods autosp --sac {wildcards.policy} {SAC_FLAGS} --model {wildcards.model}"
        " --seq-lens {SAC[seq_len]} --repeats {SAC[repeats]} {params.flags} --timeout {config[probe_timeout_s]}"
        " --out {output} > {log} 2>&1" + KEEP_WRITTEN_RESULT


SAC_RESULTS = [setting(f"results/sac/{{device_type}}/P{{world_size}}/{SAC['model']}/search-{policy}.jsonl")
               for policy in SAC["policies"]] + [
    setting(f"results/sac/{{device_type}}/P{{world_size}}/{SAC['model']}/bench-{policy}.jsonl")
    for policy in SAC["policies"]
]


rule sac_table:
    input:
        SAC_RESULTS,
    output:
        csv="results/tables/sac.csv",
        md="results/tables/sac.md",
        tex="results/tables/sac.tex",
    shell:
        "{config[autosp]} table sac --in {input} --out {output.csv}"


rule figure_sac:
    input:
        records=SAC_RESULTS,
        table=rules.sac_table.output,
    output:
        png="figures/sac.png",
        pdf="figures/sac.pdf",
    shell:
        "{config[autosp]} plot sac --in {input.records} --out {output.png} {output.pdf}"

