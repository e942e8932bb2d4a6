# AutoSP experiments. Main target: `snakemake --cores all figure_trainability`.
#
# Thin on purpose: every rule calls the `autosp` CLI, all logic lives in the package. The defaults below
# run the CPU version of the paper's trainability experiment in minutes on a laptop-class machine; override
# any of them on the command line, e.g. for a GPU node:
#   snakemake --cores all figure_trainability --config device=cuda world_size=8 \
#       'models=[llama-3.2-1b,llama-3.1-8b]' memory_budget=none dtype=bfloat16 compile_backend=inductor
# and `--resources gpu=8` so that searches holding all GPUs run one at a time (see README).
# (memory_budget=none: search up to the GPU's real memory; a real CUDA OOM ends a probe as `oom`).

DEFAULTS = {
    "autosp": "autosp",  # the CLI to call (e.g. "python -m autosp.cli" without an installed console script)
    "device": "cpu",
    "models": ["tiny", "small"],
    # methods compared; each must be registered in baselines (`autosp run --help` lists them)
    "methods": ["autosp", "ulysses", "ds-autosp", "zero3", "fsdp", "ring"],
    "world_size": 2,
    # per rank, per model (or one value for all); on CPU an emulated device of this size, sized so the
    # longest lengths are a few thousand tokens: long enough to separate methods, short enough to be quick
    "memory_budget": {"tiny": "48MiB", "small": "96MiB"},
    "granularity": "auto",  # auto: 2 * world_size * 128, the default of `autosp search`
    "min_len": "auto",  # auto: the granularity
    "max_len": 1048576,
    "dtype": "float32",
    "compile_backend": "aot_eager",  # CPU: compiles in seconds; use inductor on GPUs
    "probe_timeout_s": 600,
    # throughput sweep (figure_throughput)
    "bench_seq_lens": [1024, 4096],
    "bench_repeats": 3,
    "bench_reference": "ulysses",
}
for _key, _value in DEFAULTS.items():
    config.setdefault(_key, _value)


rule all:
    input:
        "figures/trainability.png",


include: "workflows/trainability.smk"
include: "workflows/throughput.smk"
include: "workflows/history.smk"
