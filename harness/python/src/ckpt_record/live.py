"""Bytes of training state still alive in the process, by category: the tensors of every live
`torch.nn.Parameter` (`params`), their gradients (`grads`) and the state of every live
optimizer (`optimizer`), found among the objects Python's garbage collector tracks after a
collection, each storage counted once. What the trainer left behind once it was released shows
here whatever the allocator caches; tensors held only outside Python (no object) are not seen."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import torch

CATEGORIES = ("params", "grads", "optimizer")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an optimizer's state value: a tensor, or containers of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def by_category() -> dict[str, int]:
    """Bytes of live parameters, gradients and optimizer state, after a garbage collection; a
    storage shared by several tensors (tied weights, an optimizer wrapped by another) counts
    once, in the first category that holds it."""
    gc.collect()
    seen: set[int] = set()
    out = dict.fromkeys(CATEGORIES, 0)

    def add(category: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            return
        seen.add(storage.data_ptr())
        out[category] += int(storage.nbytes())

    # By the objects' types, each type asked once: `isinstance` would be slow over every object
    # and would ask lazy modules' proxies for their class.
    objects = gc.get_objects()
    kinds = {type(o) for o in objects}
    param_kinds = {k for k in kinds if issubclass(k, torch.nn.Parameter)}
    optimizer_kinds = {k for k in kinds if issubclass(k, torch.optim.Optimizer)}
    params = [o for o in objects if type(o) in param_kinds]
    optimizers = [o for o in objects if type(o) in optimizer_kinds]
    del objects
    for p in params:
        add("params", p)
    for p in params:
        if p.grad is not None:
            add("grads", p.grad)
    for o in optimizers:
        for state in o.state.values():
            for t in _tensors(state):
                add("optimizer", t)
    return out


__all__ = ["CATEGORIES", "by_category"]
