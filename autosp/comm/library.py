"""The project's own torch.library namespace: every AutoSP custom op is `autosp_sp::<name>`, defined through here.

One namespace, named in this one place, that nothing else registers: DeepSpeed (0.19) registers its own
`autosp::all_to_all` (another signature) when its compile passes are imported, so ops in `autosp::` could not be
defined, or were redefined, in a process that had imported DeepSpeed's AutoSP.
"""
from __future__ import annotations

from typing import Any

import torch

NAMESPACE = "autosp_sp"


def qualified(name: str) -> str:
    """`autosp_sp::<name>`, the schema name of one of the project's ops."""
    return f"{NAMESPACE}::{name}"


def custom_op(name: str, **kwargs: Any):
    """`torch.library.custom_op` in the project's namespace."""
    return torch.library.custom_op(qualified(name), **kwargs)


def fragment() -> torch.library.Library:
    """A library fragment of the namespace, for ops defined by schema string."""
    return torch.library.Library(NAMESPACE, "FRAGMENT")


def op(name: str) -> Any:
    """`torch.ops.autosp_sp.<name>` (the overload packet)."""
    return getattr(getattr(torch.ops, NAMESPACE), name)


def op_name(target: Any) -> str | None:
    """`name` when `target` (an op, overload or packet) is `autosp_sp::<name>`, else None."""
    namespace, _, name = getattr(getattr(target, "overloadpacket", target), "_qualified_op_name", "").partition("::")
    return name if namespace == NAMESPACE else None


def registered_names() -> set[str]:
    """The names of every op registered in the namespace so far."""
    prefix = f"{NAMESPACE}::"
    return {n.removeprefix(prefix) for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)}
