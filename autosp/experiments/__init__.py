"""The experiments: what asks for many jobs or reads records (search, bench, floor, flops, activations, tables,
plots)."""
