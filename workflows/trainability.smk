# Max trainable sequence length: one search job per cell (method, model, world size, device type).
# A search whose probes fail records the failure as its result (--no-fail-on-error); a search that itself
# dies (crash, killed) is recorded as a failed cell by the fallback, so the table and figure still appear.


def search_command(method, model, out, extra=""):
    cmd = (f"{config['autosp']} search --method {method} --model {model} {common_flags(method)} "
           f"{budget_flag(model)} {auto_flag('--granularity', 'granularity')} {auto_flag('--min-len', 'min_len')} "
           f"--max-len {config['max_len']} --timeout {config['probe_timeout_s']} {extra} --out {out}")
    return " ".join(cmd.split())


rule search:
    output:
        "results/trainability/{device_type}/P{world_size}/{model}/{method}.jsonl",
    log:
        "results/logs/search/{device_type}/P{world_size}/{model}/{method}.log",
    benchmark:
        "results/benchmarks/search/{device_type}/P{world_size}/{model}/{method}.tsv"
    message:
        "cell {wildcards.method} {wildcards.model} P={wildcards.world_size} {wildcards.device_type}: searching [{threads} cores, {resources.gpu} GPUs x {resources.nodes} nodes] (log: {log})"
    threads: RANK_THREADS
    resources:
        gpu=GPUS,
        nodes=NODES,
    params:
        command=lambda w, output: search_command(w.method, w.model, output[0], "--no-fail-on-error"),
        record_failure=lambda w, output: search_command(w.method, w.model, output[0]),
    shell:
        "{params.command} > {log} 2>&1"
        " || {{ reason=\"search exited with status $?: $(grep -v '^USDT' {log} | tail -n 1)\";"
        " {params.record_failure} --record-failure \"$reason\" >> {log} 2>&1; }}"


rule check:
    output:
        "results/checks/{device_type}/P{world_size}/{model}/{method}.json",
    log:
        "results/logs/check/{device_type}/P{world_size}/{model}/{method}.log",
    benchmark:
        "results/benchmarks/check/{device_type}/P{world_size}/{model}/{method}.tsv"
    message:
        "cell {wildcards.method} {wildcards.model}: gradient check against single-process training [{threads} cores, {resources.gpu} GPUs x {resources.nodes} nodes] (log: {log})"
    threads: RANK_THREADS
    resources:
        gpu=GPUS,
        nodes=NODES,
    params:
        flags=lambda w: common_flags(w.method),
    shell:
        # exit 1 = the check ran and found a difference: a result to report, not a failed job
        "{config[autosp]} check --method {wildcards.method} --model {wildcards.model} {params.flags}"
        " --seq-len {config[peer][check_seq_len]} --timeout {config[probe_timeout_s]}"
        " --json-out {output} > {log} 2>&1 || test -s {output}"


PEER = config["peer"]
PEER_METHODS = [PEER["method"], *PEER["compare"]]
PEER_MODELS = [f"hf:{preset}" for preset in PEER["models"]]
TRAINABILITY_RESULTS = [
    setting(f"results/trainability/{{device_type}}/P{{world_size}}/{model}/{method}.jsonl")
    for model in config["models"] for method in config["methods"]
] + [
    setting(f"results/trainability/{{device_type}}/P{{world_size}}/{model}/{method}.jsonl")
    for model in PEER_MODELS
    for method in PEER_METHODS
]
PEER_CHECKS = [
    setting(f"results/checks/{{device_type}}/P{{world_size}}/{model}/{method}.json")
    for model in PEER_MODELS
    for method in PEER["check"]
]


rule trainability_table:
    input:
        records=TRAINABILITY_RESULTS,
        checks=PEER_CHECKS,
    output:
        csv="results/tables/trainability.csv",
        md="results/tables/trainability.md",
        tex="results/tables/trainability.tex",
    shell:
        "{config[autosp]} table trainability --in {input.records} --checks {input.checks} --out {output.csv}"


rule figure_trainability:
    input:
        records=TRAINABILITY_RESULTS,
        checks=PEER_CHECKS,
        table=rules.trainability_table.output,
    output:
        png="figures/trainability.png",
        pdf="figures/trainability.pdf",
    shell:
        "{config[autosp]} plot trainability --in {input.records} --checks {input.checks}"
        " --out {output.png} {output.pdf}"
