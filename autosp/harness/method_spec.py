"""Method specs: a method with some of its own options set, e.g. ``autosp[tiling=off]`` or
``autosp[sac=auto,tiling=loss]``, so that one interleaved bench can time two settings of one method side by side
(`autosp bench --methods autosp,autosp[tiling=off]`): ratios are only honest within one run.

A spec may set only the options its method honours (`strategy.Strategy.honoured_options`); the shared flags
still apply to every spec that honours them, and a spec's own value wins. Its label is the text as written, which
names its rows in the bench's table and what `--ratio-to` may refer to. A value that is itself a comma-separated
list is written with `+` inside the brackets: ``autosp[offload=auto+optimizer]`` is ``--offload auto,optimizer``.
A bare word inside the brackets names one of the method's presets (`strategy.Strategy.presets`): ``autosp[paper]``
is the paper's setting (``autosp[sac=sac,tiling=off,offload=off]``); options after it override it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from autosp.harness.config import METHOD_OPTIONS, ConfigError, RunConfig, flag_name

#: options whose values are integers (the others are strings, parsed by the method's own validation)
_INTEGER_OPTIONS = ("zero", "ulysses_size", "attention_chunks")
_SPEC = re.compile(r"^(?P<method>[^\[\]=,]+)(?:\[(?P<options>[^\[\]]*)\])?$")


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str
    options: dict[str, object] = field(default_factory=dict)

    def config(self, cfg: RunConfig) -> RunConfig:
        """`cfg` for this spec: its method, its options over the shared ones, and only what the method honours."""
        from autosp.harness.strategy import get_strategy

        strategy = get_strategy(self.method)
        foreign = sorted(set(self.options) - strategy.honoured_options())
        if foreign:
            valid = ", ".join(sorted(strategy.honoured_options())) or "none"
            raise ConfigError(f"--methods {self.label}: {self.method} does not take {', '.join(foreign)} "
                              f"(its options: {valid}); drop it from the brackets")
        return strategy.own_config(cfg.replace(method=self.method, **self.options))


def split_methods(text: str) -> list[str]:
    """`a,b[x=1,y=2],c` -> ['a', 'b[x=1,y=2]', 'c']: commas inside brackets belong to a spec."""
    return [part.strip() for part in re.split(r",(?![^\[]*\])", text) if part.strip()]


def parse_method_spec(text: str) -> MethodSpec:
    """`method` or `method[option=value,...]` (option names as RunConfig fields or flags: compile-backend)."""
    match = _SPEC.match(text.strip())
    if match is None:
        raise ConfigError(f"--methods: cannot read {text!r}; write a method or method[option=value,...], "
                          "e.g. autosp[tiling=off]")
    options: dict[str, object] = {}
    method = match["method"].strip()
    for item in (match["options"] or "").split(","):
        if not item.strip():
            continue
        name, sep, value = (part.strip() for part in item.partition("="))
        name = name.replace("-", "_")
        if not sep and name:
            options.update(_preset(text, method, name))
            continue
        if not sep or not name or not value:
            raise ConfigError(f"--methods {text}: {item.strip()!r} is not option=value, e.g. tiling=off")
        if name in _INTEGER_OPTIONS:
            try:
                options[name] = int(value)
            except ValueError:
                raise ConfigError(f"--methods {text}: {flag_name(name)} takes an integer, got {value!r}") from None
        else:
            options[name] = value.replace("+", ",")  # a list value (`offload=auto+optimizer`): commas end an option
    return MethodSpec(label=text.strip(), method=method, options=options)


def _preset(text: str, method: str, name: str) -> dict[str, object]:
    """The options of `method`'s preset `name`, or a one-line error naming its presets."""
    from autosp.harness.strategy import get_strategy

    presets = get_strategy(method).presets
    if name not in presets:
        raise ConfigError(f"--method {text}: {method} has no preset {name!r} (its presets: "
                          f"{', '.join(sorted(presets)) or 'none'}); write option=value, e.g. tiling=off")
    return dict(presets[name])


def spec_label(config: dict[str, object]) -> str:
    """The spec a recorded configuration (a record's `config`) was run as: its method, with the method options
    that differ from their defaults in brackets (`autosp[offload=auto+optimizer]`; a preset's options as its name,
    `autosp[paper]`; options a method does not read are left out; the ZeRO stage stays outside, as in
    `method:stage`), so that a single run's record takes its spec's column."""
    from autosp.harness.strategy import get_strategy

    method = str(config["method"])
    defaults = RunConfig(method="-", model="-", seq_len=1)
    try:
        strategy = get_strategy(method)
        honoured, presets = strategy.honoured_options(), strategy.presets
    except ConfigError:  # a method no longer registered: every option it recorded
        honoured, presets = frozenset(METHOD_OPTIONS), {}
    changed = {name: config[name] for name in METHOD_OPTIONS
               if name != "zero" and name in honoured and name in config and config[name] != getattr(defaults, name)}
    words = []
    for preset, values in presets.items():
        if all(changed.get(name, getattr(defaults, name)) == value for name, value in values.items()):
            words.append(preset)
            changed = {name: value for name, value in changed.items() if name not in values}
            break
    options = words + [f"{name}={str(value).replace(',', '+')}" for name, value in changed.items()]
    return f"{method}[{','.join(options)}]" if options else method
