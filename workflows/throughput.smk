# Iteration time and tokens/s at fixed lengths: all methods of one model in one bench job, so every
# ratio is taken against a reference measured in the same run.


rule bench:
    output:
        "results/throughput/{model}.jsonl",
    log:
        "results/logs/bench/{model}.log",
    threads: int(config["world_size"])
    resources:
        gpu=int(config["world_size"]) if config["device"] == "cuda" else 0,  # `--resources gpu=8` on a node
    params:
        methods=",".join(config["methods"]),
        seq_lens=",".join(str(n) for n in config["bench_seq_lens"]),
    shell:
        "{config[autosp]} bench --methods {params.methods} --model {wildcards.model}"
        " --seq-lens {params.seq_lens} --world-size {config[world_size]} --repeats {config[bench_repeats]}"
        " --device {config[device]} --dtype {config[dtype]} --compile-backend {config[compile_backend]}"
        " --ratio-to {config[bench_reference]} --out {output} > {log} 2>&1"


THROUGHPUT_RESULTS = expand("results/throughput/{model}.jsonl", model=config["models"])


rule throughput_table:
    input:
        THROUGHPUT_RESULTS,
    output:
        "results/tables/throughput.csv",
    shell:
        "{config[autosp]} table throughput --in {input} --ratio-to {config[bench_reference]} --out {output}"


rule figure_throughput:
    input:
        records=THROUGHPUT_RESULTS,
        table="results/tables/throughput.csv",
    output:
        "figures/throughput.png",
    shell:
        "{config[autosp]} plot throughput --in {input.records} --ratio-to {config[bench_reference]} --out {output}"
