"""Training methods behind one interface (`autosp.harness.strategy`). Each adapter module registers its Strategy on
import; `autosp.harness.strategy.get_strategy` imports the module of a built-in method (`BUILTIN_MODULES` there) the
first time that method is asked for, so a rank loads only its own method (FSDP's DTensor and DeepSpeed cost seconds
of import each)."""
