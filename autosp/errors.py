"""Errors meant for the user: each message names what is wrong and what to do. The CLI prints them as one line."""


class AutoSPError(ValueError):
    """Base of every user-facing AutoSP error."""


class ConfigError(AutoSPError):
    """A bad run configuration (unknown model or method, impossible sizes, missing GPU...)."""


class SequenceParallelError(AutoSPError):
    """The SP pass cannot make this graph sequence parallel (and says why, naming the node or layer)."""
