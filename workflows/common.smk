# What every rule shares: settings looked up per model / method, the cell paths, the compile cache, resources.
import os
import re


def per_key(mapping, key):
    """mapping[key], else mapping[preset] for key hf:<preset>, else mapping["default"] (the schema requires it)."""
    preset = key.removeprefix("hf:")
    return mapping.get(key, mapping.get(preset, mapping["default"]))


def budget_flag(model, budget=None):
    """`--memory-budget B` for this model, or nothing for "none" (search up to the device's own memory)."""
    value = budget if budget is not None else per_key(config["memory_budget"], model)
    return "" if value == "none" else f"--memory-budget {value}"


def backend_flag(method):
    return f"--compile-backend {per_key(config['compile_backend'], method)}"


def zero_flag(method):
    """`--zero Z` for `method` (setting `zero`), or nothing: the method's own stage (`autosp methods`)."""
    stage = per_key(config.get("zero", {"default": "method"}), method)
    return "" if stage == "method" else f"--zero {stage}"


def tiling_flag(method):
    """`--tiling T` where `tiling` sets one for `method` (autosp: auto, as users train), else nothing."""
    value = per_key(config.get("tiling", {"default": "off"}), method)
    return "" if value == "off" else f"--tiling {value}"


def auto_flag(flag, key):
    return "" if config[key] == "auto" else f"{flag} {config[key]}"


def import_flags():
    return " ".join(f"--import {module}" for module in config["imports"])


def common_flags(method):
    """Flags every run of `method` takes: ranks, device, precision, backend, ZeRO stage, out-of-tree imports."""
    return (f"--world-size {config['world_size']} --device {config['device']} --dtype {config['dtype']} "
            f"{backend_flag(method)} {zero_flag(method)} {tiling_flag(method)} {import_flags()}")


# One cell = one (method, model, world size, device type): its own job, its own file. The device type and
# world size come from the settings; the wildcard constraints keep a path from naming any other.
SETTING = "{device_type}/P{world_size}"

# How a cell's shell ends when its command fails. Exit 130 is an interruption (Ctrl-C, or SIGTERM from snakemake
# or the scheduler), not the cell's result: the job fails, snakemake deletes its output and a rerun redoes it.
# Any other failure is a result: the record the command wrote (`|| test -s`) or the search's fallback row.
INTERRUPTED_FAILS = "rc=$?; [ $rc -ne 130 ] || exit 130;"
KEEP_WRITTEN_RESULT = " || {{ " + INTERRUPTED_FAILS + " test -s {output}; }}"
wildcard_constraints:
    device_type=re.escape(config["device_type"]),
    world_size=str(config["world_size"]),
    model=r"(hf:)?[a-z0-9][a-z0-9._-]*",
    method=r"[a-z0-9][a-z0-9_-]*",


def setting(path):
    """`path` with this configuration's device type and world size filled in (other wildcards kept)."""
    return path.replace("{device_type}", config["device_type"]).replace("{world_size}", str(config["world_size"]))


# Persistent compile cache: inductor's FX graph and AOTAutograd caches, shared by every job and kept across
# reruns, so a graph compiled once (same model, length and method) is loaded, not compiled, next time.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(config["compile_cache"]))
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
# On CPU a job has one core per rank (below), so inductor's pool of compile workers per rank (a process per
# core, each importing torch) only adds work: each rank compiles its own kernels. A probe whose graphs are
# cached costs 26 CPU-s instead of 34 this way (autosp, tiny; same peak; README, Quick start).
if config["device"] == "cpu":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Resources of a job that launches `world_size` ranks: one core per rank (snakemake never runs more ranks
# than --cores at once); on GPUs also its GPUs per node and its nodes (`--resources gpu=N` locally; the
# SLURM plugin requests them), so no two cells ever share a GPU.
if config["device"] == "cuda" and config["gpus_per_node"] < 1:
    raise ValueError("device: cuda needs gpus_per_node >= 1 (the GPUs of one node)")
# Every job starts its ranks on the node it runs on (`autosp run` spawns one rank per local GPU; a search's
# probes do the same), so a cell must fit in one node: plan nothing that could not start.
if config["device"] == "cuda" and config["world_size"] > config["gpus_per_node"]:
    raise ValueError(
        f"world_size {config['world_size']} > gpus_per_node {config['gpus_per_node']}: every cell launches its ranks "
        f"on one node; set world_size <= {config['gpus_per_node']} (a multi-node run is `srun ... autosp run`, "
        "see docs/harness.md, Clusters)")
GPUS = config["world_size"] if config["device"] == "cuda" else 0
NODES = 1
RANK_THREADS = config["world_size"]
