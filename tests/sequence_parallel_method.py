"""Test double: a sequence-parallel method that is only ever validated (the CLI tests use it through --import)."""
from autosp.harness.strategy import Strategy, register


@register
class SequenceParallelDouble(Strategy):
    name = "sp-double"
    description = "test double: validation of a sequence-parallel method"
    sequence_parallel = True

    def setup(self, model, ctx, cfg):
        raise AssertionError("the CLI tests never run this method")
