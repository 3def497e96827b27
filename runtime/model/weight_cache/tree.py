"""A loaded decoder as JSON plus a list of tensor storages, and back: no pickle, classes from an allowlist.

Why generic: the module tree (runtime/model/decoder.py) grows per model family (more norms, per-layer flags), and a
copy of build_decoder's structure here would silently drop what a new family adds. So the tree is walked as it is:
every module, parameter and plain object (bitsandbytes' QuantState, the Int8Table) is recorded with its class, its
own attributes (`__dict__`: ints, floats, flags, dtypes, sizes, tuples, dicts, other recorded objects, tensors) and,
for modules, its parameters, buffers and children. Rebuilding creates each object with its class's allocator
(`cls.__new__`, plus `nn.Module.__init__` for modules, `Parameter.__new__(cls, data, requires_grad)` for
parameters) and restores that state; no class's __init__ runs, so no weights are read or quantized. An attribute
of a type not listed below, a class outside the allowlist or a module with hooks raises UncacheableTree: the
loader then loads uncached (and tests/test_weight_cache.py fails), never caches a tree it cannot rebuild.

Tensors are recorded as views (dtype, shape, stride, offset) of storages, each storage stored once: tied weights
and the embedding/head's shared int8 table come back shared, and every view lies in the same bytes it did.

Allowlist: classes defined in this package's model code (`oval_edge.runtime.model.*`: nn.Modules, plain holders
and dataclasses such as DecoderConfig), the torch and bitsandbytes classes in TRUSTED_CLASSES, and functions of
torch.nn.functional (an MLP's act_fn). A hostile description can only name those, so it cannot run code; wrong
numbers are caught by the storages' checksums (entry.py).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

OWN_PACKAGE = "oval_edge.runtime.model."
TRUSTED_CLASSES = frozenset({
    "torch.nn.modules.container:ModuleList",
    "torch.nn.modules.linear:Linear",
    "torch.nn.parameter:Parameter",
    "bitsandbytes.nn.modules:Linear4bit",
    "bitsandbytes.nn.modules:LinearNF4",
    "bitsandbytes.nn.modules:LinearFP4",
    "bitsandbytes.nn.modules:Params4bit",
    "bitsandbytes.functional:QuantState",
})
# nn.Module's own bookkeeping in __dict__: registries restored separately, hook tables that must be empty.
_REGISTRIES = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}


class UncacheableTree(ValueError):
    """The tree holds something the cache cannot record or rebuild exactly; the message names it."""


def class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_class(name: str) -> type:
    """The class `module:qualname` if the allowlist admits it, else UncacheableTree (a foreign or hostile name)."""
    module_name, _, qualname = name.partition(":")
    if not (name in TRUSTED_CLASSES or module_name.startswith(OWN_PACKAGE)) or "<" in qualname or not qualname:
        raise UncacheableTree(f"class {name!r} is not in the weight cache's allowlist (runtime/model/weight_cache/"
                              "tree.py TRUSTED_CLASSES); add it there if it only holds tensors and plain values")
    target = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if not isinstance(target, type):
        raise UncacheableTree(f"class {name!r} does not exist in this version of the code")
    return target


class TreeWriter:
    """Records a module tree: `describe(root)` -> JSON-able dict; `storages` the untyped storages it points into."""

    def __init__(self) -> None:
        self.objects: list[dict] = []
        self.storages: list[torch.UntypedStorage] = []
        self._object_index: dict[int, int] = {}
        self._storage_index: dict[tuple, int] = {}
        self._keep_alive: list[object] = []  # ids are only unique while the objects live

    def describe(self, root: nn.Module) -> dict:
        return {"root": self._ref(root, "model"), "objects": self.objects,
                "storages": [{"nbytes": s.nbytes(), "device": s.device.type} for s in self.storages]}

    def _ref(self, obj, where: str) -> dict:
        index = self._object_index.get(id(obj))
        if index is not None:
            return {"ref": index}
        cls = type(obj)
        resolve_class(class_name(cls))  # refuse at write time what could not be read back
        index = len(self.objects)
        self._object_index[id(obj)] = index
        self._keep_alive.append(obj)
        entry: dict = {"class": class_name(cls)}
        self.objects.append(entry)
        if isinstance(obj, nn.Module):
            entry.update(self._module(obj, where))
        elif isinstance(obj, nn.Parameter):
            entry.update(kind="parameter", tensor=self._tensor(obj.data, where), requires_grad=obj.requires_grad,
                         attrs=self._attrs(vars(obj), where))
        else:
            entry.update(kind="object", attrs=self._attrs(vars(obj), where))
        return {"ref": index}

    def _module(self, module: nn.Module, where: str) -> dict:
        state = vars(module)
        for name in _MODULE_INTERNALS - set(_REGISTRIES):
            if state.get(name):  # a hook or state-dict callback: code, which the cache does not record
                raise UncacheableTree(f"{where}: module {type(module).__name__} has {name} set; hooks cannot be cached")
        plain = {k: v for k, v in state.items() if k not in _MODULE_INTERNALS}
        return {
            "kind": "module",
            "attrs": self._attrs(plain, where),
            "parameters": {k: None if p is None else self._ref(p, f"{where}.{k}") for k, p in module._parameters.items()},
            "buffers": {k: None if b is None else self._tensor(b, f"{where}.{k}") for k, b in module._buffers.items()},
            "non_persistent": sorted(module._non_persistent_buffers_set),
            "modules": {k: None if m is None else self._ref(m, f"{where}.{k}") for k, m in module._modules.items()},
        }

    def _attrs(self, values: dict, where: str) -> dict:
        return {k: self._value(v, f"{where}.{k}") for k, v in values.items()}

    def _value(self, value, where: str):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.Size):
            return {"size": list(value)}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, nn.Parameter) or isinstance(value, nn.Module):
            return self._ref(value, where)
        if isinstance(value, torch.Tensor):
            return {"tensor": self._tensor(value, where)}
        if isinstance(value, tuple):
            return {"tuple": [self._value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return {"list": [self._value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"dict": {k: self._value(v, f"{where}.{k}") for k, v in value.items()}}
        if isinstance(value, SimpleNamespace):
            return {"namespace": self._attrs(vars(value), where)}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            resolve_class(class_name(type(value)))
            fields = {f.name: self._value(getattr(value, f.name), f"{where}.{f.name}")
                      for f in dataclasses.fields(value) if f.init}
            return {"dataclass": {"class": class_name(type(value)), "fields": fields}}
        if callable(value) and getattr(value, "__module__", None) == F.__name__ \
                and getattr(F, getattr(value, "__name__", ""), None) is value:
            return {"function": value.__name__}
        if type(value).__module__.startswith(OWN_PACKAGE) or class_name(type(value)) in TRUSTED_CLASSES:
            return self._ref(value, where)
        raise UncacheableTree(f"{where}: a {type(value).__module__}.{type(value).__qualname__} cannot be cached "
                              "(runtime/model/weight_cache/tree.py records plain values, tensors and allowlisted "
                              "objects)")

    def _tensor(self, tensor: torch.Tensor, where: str) -> dict:
        tensor = tensor.detach()
        if tensor.device.type == "meta" or tensor.layout != torch.strided:
            raise UncacheableTree(f"{where}: a {tensor.device.type}/{tensor.layout} tensor cannot be cached")
        storage = tensor.untyped_storage()
        key = (storage.device.type, storage.device.index, storage.data_ptr(), storage.nbytes())
        index = self._storage_index.get(key)
        if index is None:
            index = self._storage_index[key] = len(self.storages)
            self.storages.append(storage)
        return {"storage": index, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                "stride": list(tensor.stride()), "offset": tensor.storage_offset()}


class TreeReader:
    """Rebuilds a tree from `describe`'s dict and its storages (uint8 tensors [nbytes], already on the device)."""

    def __init__(self, description: dict, storages: list[torch.Tensor]) -> None:
        self.description, self.storages = description, storages
        self.objects: list[object] = []

    def build(self) -> nn.Module:
        entries = self.description["objects"]
        for entry in entries:  # pass 1: every object exists, so references (cycles included) resolve in pass 2
            self.objects.append(self._shell(entry))
        for obj, entry in zip(self.objects, entries):
            attrs = {k: self._value(v) for k, v in entry["attrs"].items()}
            vars(obj).update(attrs)
            if entry["kind"] == "module":
                obj._parameters.update({k: self._ref(v) for k, v in entry["parameters"].items()})
                obj._buffers.update({k: None if v is None else self._tensor(v) for k, v in entry["buffers"].items()})
                obj._non_persistent_buffers_set.update(entry["non_persistent"])
                obj._modules.update({k: self._ref(v) for k, v in entry["modules"].items()})
        root = self._ref(self.description["root"])
        if not isinstance(root, nn.Module):
            raise UncacheableTree("the cached tree's root is not a module")
        return root

    def _shell(self, entry: dict):
        cls, kind = resolve_class(entry["class"]), entry["kind"]
        if kind == "module" and issubclass(cls, nn.Module):
            module = cls.__new__(cls)
            nn.Module.__init__(module)
            return module
        if kind == "parameter" and issubclass(cls, nn.Parameter):
            return cls.__new__(cls, self._tensor(entry["tensor"]), requires_grad=bool(entry["requires_grad"]))
        if kind == "object" and not issubclass(cls, (nn.Module, torch.Tensor)):
            return cls.__new__(cls)
        raise UncacheableTree(f"class {entry['class']} cannot be rebuilt as a {kind}")

    def _ref(self, value):
        return None if value is None else self.objects[value["ref"]]

    def _value(self, value):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        (tag, body), = value.items()
        if tag == "ref":
            return self.objects[body]
        if tag == "tensor":
            return self._tensor(body)
        if tag == "dtype":
            return _dtype(body)
        if tag == "size":
            return torch.Size(body)
        if tag == "device":
            return torch.device(body)
        if tag == "tuple":
            return tuple(self._value(v) for v in body)
        if tag == "list":
            return [self._value(v) for v in body]
        if tag == "dict":
            return {k: self._value(v) for k, v in body.items()}
        if tag == "namespace":
            return SimpleNamespace(**{k: self._value(v) for k, v in body.items()})
        if tag == "dataclass":
            cls = resolve_class(body["class"])
            if not dataclasses.is_dataclass(cls):
                raise UncacheableTree(f"{body['class']!r} is not a dataclass")
            return cls(**{k: self._value(v) for k, v in body["fields"].items()})
        if tag == "function":
            fn = getattr(F, body, None)
            if not callable(fn) or getattr(fn, "__module__", None) != F.__name__:
                raise UncacheableTree(f"function {body!r} is not in torch.nn.functional")
            return fn
        raise UncacheableTree(f"unknown value tag {tag!r} in the cached tree")

    def _tensor(self, ref: dict) -> torch.Tensor:
        flat = self.storages[ref["storage"]]  # uint8 [nbytes]
        dtype = _dtype(ref["dtype"])
        usable = flat.numel() // dtype.itemsize * dtype.itemsize  # a storage viewed at a wider dtype than its size
        return flat[:usable].view(dtype).as_strided(ref["shape"], ref["stride"], ref["offset"])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise UncacheableTree(f"dtype {name!r} is not a torch dtype")
    return dtype
