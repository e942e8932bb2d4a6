# Max trainable sequence length: one search job per cell (method, model, world size, device type).
# A search whose probes fail records the failure as its result (--no-fail-on-error); a search that itself
# dies (crash, killed) is recorded as a failed cell by the fallback, so the table and figure still appear. An
# interruption (exit 130) is no result: the job fails and a rerun redoes the cell (INTERRUPTED_FAILS).


def search_command(method, model, out, extra=""):
    cmd = (f"{config['autosp']} search --method {method} --model {model} {common_flags(method)} "
           f"{budget_flag(model)} {auto_flag('--granularity', 'granularity')} {auto_flag('--min-len', 'min_len')} "
           f"--max-len {config['max_len']} --timeout {config['probe_timeout_s']} "
           f"--guide {per_key(config.get('search_guide', {'default': 'simulate'}), method)} {extra} --out {out}")
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
        " || {{ " + INTERRUPTED_FAILS + " reason=\"search exited with status $rc: $(grep -v '^USDT' {log} | tail -n 1 || true)\";"
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
        " --json-out {output} > {log} 2>&1" + KEEP_WRITTEN_RESULT


PEER = config["peer"]
PEER_METHODS = [PEER["method"], *PEER["compare"]]
# Scope "" is the quick start's table and figure (`models`, the peer on `peer.models`); scope "-all" (the `all`
# target) adds `all_models` and `peer.all_models`, cells too slow for the quick start.
TRAINABILITY_SCOPES = [""] + (["-all"] if config["all_models"] or PEER.get("all_models") else [])
wildcard_constraints:
    scope="(-all)?",


def peer_models(scope):
    """hf:<preset> for each preset the peer runs on in this scope."""
    return [f"hf:{preset}" for preset in PEER["models"] + (PEER.get("all_models", []) if scope else [])]


def peer_checks(scope):
    return [setting(f"results/checks/{{device_type}}/P{{world_size}}/{model}/{method}.json")
            for model in peer_models(scope) for method in PEER["check"]]


def trainability_results(scope):
    models = config["models"] + (config["all_models"] if scope else [])
    cells = [(model, method) for model in models for method in config["methods"]]
    cells += [(model, method) for model in peer_models(scope) for method in PEER_METHODS]
    return [setting(f"results/trainability/{{device_type}}/P{{world_size}}/{model}/{method}.jsonl")
            for model, method in cells]


def trainability_outputs(pattern):
    """`pattern` (with {scope}) for every scope the settings have."""
    return [pattern.format(scope=scope) for scope in TRAINABILITY_SCOPES]


rule trainability_table:
    input:
        records=lambda w: trainability_results(w.scope),
        checks=lambda w: peer_checks(w.scope),
    output:
        csv="results/tables/trainability{scope}.csv",
        md="results/tables/trainability{scope}.md",
        tex="results/tables/trainability{scope}.tex",
    shell:
        "{config[autosp]} table trainability --in {input.records} --checks {input.checks} --out {output.csv}"


rule figure_trainability_scope:
    input:
        records=lambda w: trainability_results(w.scope),
        checks=lambda w: peer_checks(w.scope),
        table="results/tables/trainability{scope}.csv",
    output:
        png="figures/trainability{scope}.png",
        pdf="figures/trainability{scope}.pdf",
    shell:
        "{config[autosp]} plot trainability --in {input.records} --checks {input.checks}"
        " --out {output.png} {output.pdf}"


rule figure_trainability:  # the quick start's target
    input:
        "figures/trainability.png",
        "figures/trainability.pdf",
