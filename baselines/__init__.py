"""Training methods behind one interface (`baselines.base`). Importing this package registers every method:
each adapter module below registers its Strategy on import; `baselines.base.get_strategy` finds them by name."""
from baselines import alst, autosp_method, ds_autosp, fsdp, ring, single, ulysses, zero3  # noqa: F401
