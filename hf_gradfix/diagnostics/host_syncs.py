"""Counting device-to-host synchronizations: the reads that stall a GPU's pipeline, per micro-batch and per window.

On a GPU every ``.item()``, ``bool(tensor)``, ``.tolist()``, ``.cpu()``, boolean-mask index or ``torch.nonzero``
of a device tensor waits for the device to drain its queue. :class:`HostSyncCounter` counts them in two ways:

- **structurally** (any device, CPU included): a :class:`~torch.overrides.TorchFunctionMode` sees every tensor
  operation and counts those that force a device-to-host sync on CUDA when their tensor is device-resident. On a CPU
  run nothing is device-resident, so residence is inferred the way a GPU run would have it: a tensor made inside the
  counter without a ``device`` (a collator's ``torch.tensor(list)``, the optimizer's ``step`` counter) or brought
  to the host (``.cpu()``, ``.to("cpu")``, ``.numpy()``) is host-resident, as is whatever is computed from
  host-resident tensors only; a host-resident tensor sent ``.to(device)`` is device-resident again (on a CPU run
  ``.to(args.device)`` is that upload). Only the literal ``"cpu"`` names the host: a ``torch.device`` (``args.device``,
  ``x.device``) stands for the device a GPU run would have there. What runs inside a DataLoader's fetch (the
  dataset, the collator) runs on the host in a GPU run too and is not counted. Tensors made before the counter (the model's parameters) are device-resident.
  Reading a host-resident tensor is free and not counted;
- **on CUDA** (``cuda=True``): ``torch.cuda.set_sync_debug_mode("warn")``, each of its warnings one sync.

Each sync is attributed to the innermost calling frame outside torch (``owner``: ``hf_gradfix``, ``transformers``,
``trl``, ``accelerate``, ``peft`` or ``user``), so a patched run's own syncs are told from stock's.

>>> import torch
>>> x = torch.ones(3)  # made before the counter: device-resident
>>> with HostSyncCounter() as counter:
...     a = float(x.sum())  # 1 sync
...     b = x[x > 0]  # 1 sync (a boolean mask)
...     host = torch.tensor([1.0, 2.0])  # made without a device: host-resident
...     c = host.tolist()  # free
>>> counter.total, counter.ops()
(2, {'__float__': 1, '__getitem__[bool]': 1})
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HostSyncCounter", "SyncEvent", "owner_of_frame"]

# Tensor methods that read a value back to the host
_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy",
                    "__array__", "equal", "allclose"})
# operations whose output size depends on the values (the host must learn it)
_DATA_DEPENDENT = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
                             "histc", "_unique2"})
_FACTORIES = frozenset({"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand",
                        "randn", "randint", "randperm", "eye", "scalar_tensor", "from_numpy", "asarray"})

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_OWNERS = ("hf_gradfix", "transformers", "trl", "accelerate", "peft")


@dataclass(frozen=True)
class SyncEvent:
    """One device-to-host sync: the operation, the owner of the innermost calling frame outside torch, and that
    frame's ``file:line``."""

    op: str
    owner: str
    where: str


def owner_of_frame(filename: str) -> str:
    """The package a source file belongs to (``user`` for anything else).

    >>> owner_of_frame("/x/site-packages/transformers/trainer.py"), owner_of_frame("/repo/tests/test_x.py")
    ('transformers', 'user')
    """
    parts = os.path.abspath(filename).split(os.sep)
    for name in reversed(parts[:-1]):
        if name in _OWNERS:
            return name
    return "user"


_LOADER_DIR = os.path.join(_TORCH_DIR, "utils", "data") + os.sep


def _caller() -> tuple[str, str] | None:
    """(owner, ``file:line``) of the innermost frame outside torch; None inside a DataLoader's fetch (the dataset
    and the collator run on the host in a GPU run too)."""
    frame = sys._getframe(2)
    found = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_LOADER_DIR):
            return None
        if found is None:
            path = os.path.abspath(name)
            if not (path.startswith(_TORCH_DIR) or path == _THIS or path.startswith(_STDLIB) or name.startswith("<")):
                found = owner_of_frame(path), f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return found or ("torch", "?")


def _tensors(value: Any, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


def _is_cpu(device: Any) -> bool:
    # only the literal "cpu" is the host: on a CPU run a torch.device (``args.device``, ``x.device``) stands for the
    # device a GPU run would have there
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _has_bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in items)


class _Mode(TorchFunctionMode):
    def __init__(self, counter: "HostSyncCounter") -> None:
        super().__init__()
        self.counter = counter
        self.host = WeakIdKeyDictionary()

    def _on_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        device_inputs = [t for t in inputs if not self._on_host(t)]
        op, to_host, upload = None, False, False
        if name in _READS:
            if device_inputs:
                op = name
            to_host = True
        elif name in ("cpu",) or (name == "to" and self._to_cpu(args, kwargs)):
            if device_inputs and not kwargs.get("non_blocking", False):
                op = name
            to_host = True
        elif name in ("cuda", "to"):
            upload = name == "cuda" or "device" in kwargs or any(
                isinstance(a, (torch.device, str)) for a in args[1:])
        elif name in _DATA_DEPENDENT and device_inputs:
            op = name
        elif name == "repeat_interleave" and device_inputs and kwargs.get("output_size") is None and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            op = name
        elif name == "__getitem__" and len(args) > 1 and _has_bool_index(args[1]) and device_inputs:
            op = "__getitem__[bool]"
        elif name == "__setitem__" and len(args) > 2 and _has_bool_index(args[1]) and device_inputs \
                and isinstance(args[2], torch.Tensor) and args[2].numel() > 1:
            op = "__setitem__[bool]"
        elif name == "where" and len(args) == 1 and not kwargs and device_inputs:
            op = "where(cond)"
        if op is not None:
            self.counter._record(op)
        result = func(*args, **kwargs)
        if name in _READS:
            return result
        host = to_host or (not upload and (
            (inputs and not device_inputs) or (not inputs and name in _FACTORIES and (kwargs.get("device") is None or _is_cpu(kwargs["device"])))))
        if host:
            for t in _tensors(result, []):
                self.host[t] = True
        elif upload:  # on a CPU run .to(device) may return its own input: the upload a GPU run makes
            for t in _tensors(result, []):
                self.host.pop(t, None)
        return result

    @staticmethod
    def _to_cpu(args, kwargs) -> bool:
        device = kwargs.get("device")
        if device is None:
            device = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
        return device is not None and _is_cpu(device)


class HostSyncCounter:
    """Counts device-to-host syncs while it is entered (see the module docstring).

    ``structural``: the TorchFunctionMode count (any device); ``cuda``: also count
    ``torch.cuda.set_sync_debug_mode("warn")``'s warnings (None: where CUDA is initialized). ``events`` holds the
    structural count's :class:`SyncEvent`s, ``cuda_events`` the CUDA ones.
    """

    def __init__(self, structural: bool = True, cuda: bool | None = None) -> None:
        self.structural = structural
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized() if cuda is None else cuda
        self.events: list[SyncEvent] = []
        self.cuda_events: list[SyncEvent] = []
        self._mode: _Mode | None = None
        self._saved: tuple | None = None

    # ---- recording
    def _record(self, op: str) -> None:
        caller = _caller()
        if caller is not None:
            self.events.append(SyncEvent(op, *caller))

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message).lower():
            caller = _caller() or ("torch", "DataLoader")
            self.cuda_events.append(SyncEvent("cuda", *caller))
            return
        self._saved[1](message, category, filename, lineno, file, line)

    def __enter__(self) -> "HostSyncCounter":
        if self.cuda:
            self._catch = warnings.catch_warnings()
            self._catch.__enter__()
            warnings.simplefilter("always")
            self._saved = (torch.cuda.get_sync_debug_mode(), warnings.showwarning)
            warnings.showwarning = self._showwarning
            torch.cuda.set_sync_debug_mode("warn")
        if self.structural:
            self._mode = _Mode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        if self.cuda and self._saved is not None:
            torch.cuda.set_sync_debug_mode(self._saved[0])
            warnings.showwarning = self._saved[1]
            self._catch.__exit__(*exc)
            self._saved = None

    # ---- reading
    @property
    def total(self) -> int:
        return len(self.events)

    def count(self, owner: str | None = None, cuda: bool = False) -> int:
        events = self.cuda_events if cuda else self.events
        return sum(1 for e in events if owner is None or e.owner == owner)

    def by_owner(self, cuda: bool = False) -> dict[str, int]:
        return dict(Counter(e.owner for e in (self.cuda_events if cuda else self.events)))

    def ops(self, owner: str | None = None) -> dict[str, int]:
        return dict(Counter(e.op for e in self.events if owner is None or e.owner == owner))

    def sites(self, owner: str | None = None) -> dict[str, int]:
        """``file:line`` of each counted sync (``owner``: only that owner's), with how often it synced."""
        return dict(Counter(f"{e.where} ({e.op})" for e in self.events if owner is None or e.owner == owner))
