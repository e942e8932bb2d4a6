"""The harness: what runs one measured job (config and run flags, launch, runner, measure, records, check,
the parallel layout)."""
