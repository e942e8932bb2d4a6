# Max trainable sequence length per (method, model): one search per job, one JSONL per search.


def _optional(flag, key, absent, model=None):
    """`flag value`, or nothing when the config says `absent` (let the CLI choose its default).

    A value may be a mapping model -> value (e.g. a memory budget per model)."""
    value = config[key]
    if isinstance(value, dict):
        value = value[model]
    value = str(value)
    return "" if value.lower() == absent else f"{flag} {value}"


rule search:
    output:
        "results/trainability/{model}/{method}.jsonl",
    log:
        "results/logs/search/{model}/{method}.log",
    threads: int(config["world_size"])  # one process per rank: keeps snakemake from oversubscribing cores
    resources:
        gpu=int(config["world_size"]) if config["device"] == "cuda" else 0,  # `--resources gpu=8` on a node
    params:
        budget=lambda w: _optional("--memory-budget", "memory_budget", absent="none", model=w.model),
        granularity=_optional("--granularity", "granularity", absent="auto"),
        min_len=_optional("--min-len", "min_len", absent="auto"),
    shell:
        "{config[autosp]} search --method {wildcards.method} --model {wildcards.model}"
        " --world-size {config[world_size]} {params.budget} {params.granularity}"
        " {params.min_len} --max-len {config[max_len]} --device {config[device]}"
        " --dtype {config[dtype]} --compile-backend {config[compile_backend]} --timeout {config[probe_timeout_s]}"
        " --no-fail-on-error --out {output} > {log} 2>&1"


TRAINABILITY_RESULTS = expand(
    "results/trainability/{model}/{method}.jsonl", model=config["models"], method=config["methods"]
)


rule trainability_table:
    input:
        TRAINABILITY_RESULTS,
    output:
        "results/tables/trainability.csv",
    shell:
        "{config[autosp]} table trainability --in {input} --out {output}"


rule figure_trainability:
    input:
        records=TRAINABILITY_RESULTS,
        table="results/tables/trainability.csv",
    output:
        "figures/trainability.png",
    shell:
        "{config[autosp]} plot trainability --in {input.records} --out {output}"
