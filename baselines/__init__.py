"""Training methods behind one interface (`baselines.base`). Each adapter module registers its Strategy on import;
`baselines.base.get_strategy` imports the module of a built-in method the first time that method is asked for, so
a rank loads only its own method (FSDP's DTensor and DeepSpeed cost seconds of import each)."""

#: the module each built-in method registers itself in
BUILTIN_MODULES = {
    "alst": "baselines.alst",
    "autosp": "baselines.autosp_method",
    "ds-autosp": "baselines.ds_autosp",
    "fsdp": "baselines.fsdp",
    "ring": "baselines.ring",
    "single": "baselines.single",
    "ulysses": "baselines.ulysses",
    "ulysses-ac": "baselines.ulysses",
    "ulysses-compile": "baselines.ulysses",
    "zero3": "baselines.zero3",
}
