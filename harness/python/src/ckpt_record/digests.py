"""Digests of training state: tensors, parameters by name, optimizer state by parameter name,
schedules, random generators and batches, each a lowercase hexadecimal sha256."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements in its own dtype, contiguous, in row-major order."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def update_tensor(h: Any, t: torch.Tensor) -> None:
    """Feeds `t` into the hash `h`: its dtype, its shape, then its bytes."""
    h.update(f"{t.dtype}:{list(t.shape)}:".encode())
    h.update(_tensor_bytes(t))


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of one tensor's dtype, shape and bytes."""
    h = hashlib.sha256()
    update_tensor(h, t)
    return h.hexdigest()


def _value_digest(h: Any, value: object) -> None:
    """Feeds a state value into `h`: tensors by their bytes, containers item by item, anything
    else by its JSON or `repr` text."""
    if isinstance(value, torch.Tensor):
        update_tensor(h, value)
    elif isinstance(value, np.ndarray):
        update_tensor(h, torch.from_numpy(np.ascontiguousarray(value)))
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            h.update(f"{key}=".encode())
            _value_digest(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"[{len(value)}]".encode())
        for item in value:
            _value_digest(h, item)
    else:
        h.update(json.dumps(value, default=repr).encode())
    h.update(b";")


def state_digest(value: object) -> str:
    """sha256 of a state: a tensor, an array, or nested mappings and sequences of them."""
    h = hashlib.sha256()
    _value_digest(h, value)
    return h.hexdigest()


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Groups of parameter names that share storage (tied weights), each in registration order."""
    by_storage: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = (p.untyped_storage().data_ptr(), int(p.storage_offset()), tuple(p.shape))
        by_storage.setdefault(key, []).append(name)
    return [names for names in by_storage.values() if len(names) > 1]


def params_by_name(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's digest by name; tied parameters once, under their first name."""
    return {name: tensor_digest(p) for name, p in model.named_parameters()}


def combined(digests: Mapping[str, str]) -> str:
    """One digest over named digests, in name order."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}:{digests[name]};".encode())
    return h.hexdigest()


def optimizer_by_param(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> dict[str, str]:
    """Each parameter's optimizer state (moments, step counts) by the parameter's name; a
    parameter the optimizer holds no state for yet is left out."""
    names = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, str] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state:
                out[names.get(id(p), f"unnamed:{len(out)}")] = state_digest(dict(state))
    return out


def optimizer_hyper(optimizer: torch.optim.Optimizer) -> str:
    """Digest of the optimizer's parameter groups without their parameters."""
    groups = [
        {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
    ]
    return state_digest(groups)


def rng_states() -> dict[str, str]:
    """Every random generator's state digest: Python's, NumPy's, torch's CPU generator and each
    CUDA device's."""
    states: dict[str, str] = {
        "python": state_digest(list(random.getstate())),
        "numpy": state_digest(list(np.random.get_state())),
        "torch_cpu": tensor_digest(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            states[f"cuda:{i}"] = tensor_digest(torch.cuda.get_rng_state(i))
    return states


def batch_digest(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> str:
    """Digest of a batch: its tensors by name (a mapping, in name order) or in order."""
    items = (
        sorted(tensors.items())
        if isinstance(tensors, Mapping)
        else [(str(i), t) for i, t in enumerate(tensors)]
    )
    h = hashlib.sha256()
    for name, t in items:
        h.update(f"{name}:".encode())
        update_tensor(h, t)
    return h.hexdigest()
