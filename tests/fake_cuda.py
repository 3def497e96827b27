"""A fake `cuda` device for a CPU-only torch: the engine's static decode step traced without a GPU.

torch's FakeTensorMode gives every tensor a real shape, dtype and device and no data, so the engine loads and its
step runs on "cuda" exactly as far as device placement, shapes and dispatched ops go; no kernel runs. Three
stand-ins make that possible on a torch built without CUDA:

- `answer_like_an_orin` makes torch.cuda answer as one sm_87 device (an Orin) would.
- `CudaBindings` (a TorchFunctionMode): a CPU-only torch opens a CUDA DeviceGuard in the Python bindings of
  indexing, copy_, contiguous and a few operators, and fails there. Such a call is run again with its fake CUDA
  tensors marked as CPU ones for the duration of the call (the same aten ops dispatch, on the same shapes), and its
  results are marked CUDA again. It also records what would cross between host and device in those bindings.
- `stub_triton_launches` replaces every Triton kernel of oval_edge.kernels with a recorder of its launches (grid,
  argument devices), so the Triton wrappers' Python runs and each launch counts.

`StepAudit` (a TorchDispatchMode) then counts what a step dispatches: kernel launches (ops that compute: views,
metadata and bare allocations excluded, a `.to()` that converts included; a composite op counts once), ops whose
tensors span devices, copies across devices, host reads (item, tolist, nonzero, bool(), synchronize), and the peak
of the bytes its temporaries hold.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
# Ops that launch nothing: metadata, aliasing and allocations without a fill (torch.empty runs no kernel).
NO_LAUNCH = frozenset({"aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
                       "aten.empty_like.default", "aten._unsafe_view.default", "aten.lift_fresh.default",
                       "aten.detach.default", "prim.device.default", "aten.to.dtype", "aten.to.device",
                       "aten.to.dtype_layout", "aten.reshape.default", "aten.flatten.using_ints",
                       "aten.view_as.default", "aten.movedim.int", "aten.numpy_T.default", "aten.chunk.default",
                       "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default"})
# Ops that make the host wait for a device value.
HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
                        "aten.nonzero.default", "aten.equal.default", "aten.unique.default", "aten._unique2.default",
                        "aten.masked_select.default", "aten.tolist.default"})
COPIES = frozenset({"aten._to_copy.default", "aten.copy_.default", "aten.to.device", "aten.to.dtype_layout"})
# .to() overloads: no kernel when they return their input (same dtype and device), a copy kernel otherwise.
CONVERSIONS = frozenset({"aten.to.dtype", "aten.to.device", "aten.to.dtype_layout"})


def tensors_in(value):
    """Every tensor in a (nested) argument list."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def placed(values) -> set[str]:
    """Device types of the tensors in `values`, 0-dim CPU tensors left out (CUDA ops take those as scalars)."""
    return {t.device.type for t in tensors_in(values) if not (t.dim() == 0 and t.device.type == "cpu")}


class StepAudit(TorchDispatchMode):
    """While active: launches per op, mixed-device ops, cross-device copies, host reads, and the peak bytes held by
    the tensors the traced code allocated (each storage counted from its first op output until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter = Counter()
        self.mixed: list[str] = []
        self.copies: list[str] = []
        self.host_reads: list[str] = []
        self.live = self.peak = 0
        self._held: set[int] = set()

    @property
    def total(self) -> int:
        return sum(self.launches.values())

    def _hold(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._held:
            return
        size = storage.nbytes()
        self._held.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._held.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        devices = placed((args, kwargs))
        if name in HOST_READS:
            self.host_reads.append(name)
        target = kwargs.get("device")
        if name in COPIES and (len(devices) > 1 or (target is not None and torch.device(target).type not in devices)):
            self.copies.append(f"{name} {sorted(devices)} -> {target}")
        elif len(devices) > 1:
            self.mixed.append(f"{name} {sorted(devices)}")
        out = func(*args, **kwargs)
        if not (func.is_view or name in NO_LAUNCH) or (name in CONVERSIONS and out is not args[0]):
            self.launches[name] += 1
        # A fresh allocation is an output the schema does not alias to an input (views, in-place and out= ops
        # return their inputs' storage: the pool's, the weights'), or a .to() that converted (its schema may alias)
        fresh = [r.alias_info is None or (name in CONVERSIONS and out is not args[0]) for r in func._schema.returns]
        for tensor, is_fresh in zip(out if isinstance(out, (tuple, list)) else (out,), fresh):
            for part in tensors_in(tensor) if is_fresh else ():
                self._hold(part)
        return out

    def triton_launch(self, name: str) -> None:
        self.launches[f"triton.{name}"] += 1


class CudaBindings(TorchFunctionMode):
    """Runs the Python bindings that open a CUDA DeviceGuard on fake CUDA tensors (see the module docstring), and
    records host reads and host/device moves made through bindings: .item/.tolist/.cpu/.numpy of a CUDA tensor,
    .to/.cuda between devices, torch.tensor(host data, device=cuda), and a CPU tensor written into a CUDA one."""

    HOST_METHODS = (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy)
    MAY_COPY = (torch.Tensor.contiguous, torch.Tensor.reshape)

    def __init__(self) -> None:
        super().__init__()
        self.audits: list[StepAudit] = []  # the running audits (a copy made inside a binding counts in them)
        self.host_reads: list[str] = []
        self.copies: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.HOST_METHODS and args[0].device.type == "cuda":
            self.host_reads.append(f"Tensor.{func.__name__}")
        elif func in (torch.tensor, torch.as_tensor) and "device" in kwargs and \
                torch.device(kwargs["device"]).type == "cuda" and not isinstance(args[0], torch.Tensor):
            self.copies.append(f"torch.{func.__name__}(host data, device=cuda)")
            host = func(*args, **{k: v for k, v in kwargs.items() if k != "device"})
            return torch.empty(host.shape, dtype=host.dtype, device=CUDA)
        elif func in (torch.Tensor.copy_, torch.Tensor.__setitem__) and len(placed(args)) > 1:
            self.copies.append(f"Tensor.{func.__name__} {sorted(placed(args))}")
        if func in self.MAY_COPY and isinstance(args[0], torch.Tensor) and self._copies_under_inference(func, args):
            for audit in self.audits:  # the copy dispatches no op the audit sees (see _copies_under_inference)
                audit.launches[f"{func.__name__} (a copy)"] += 1
        if func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(args[0], torch.Tensor):
            moved = self._move(func, args, kwargs)
            if moved is not None:
                return moved
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if "not linked with support for cuda" not in str(exc):
                raise
        on_cuda = [t for t in tensors_in((args, kwargs)) if isinstance(t, FakeTensor) and t.fake_device.type == "cuda"]
        for tensor in on_cuda:
            tensor.fake_device = CPU
        try:
            out = func(*args, **kwargs)
        finally:
            for tensor in on_cuda:
                tensor.fake_device = CUDA
        for tensor in tensors_in(out):
            if isinstance(tensor, FakeTensor) and tensor.fake_device.type == "cpu":
                tensor.fake_device = CUDA
        return out

    @staticmethod
    def _copies_under_inference(func, args) -> bool:
        """Whether .contiguous()/.reshape()/.flatten() copies here. Under torch.inference_mode (where the engine
        runs its step) the clone they make inside the binding reaches no TorchDispatchMode, yet it is a kernel."""
        tensor = args[0]
        if not torch.is_inference_mode_enabled():
            return False  # the audit sees the clone itself
        if func is torch.Tensor.contiguous:
            return not tensor.is_contiguous()
        shape = args[1:] if func is not torch.Tensor.flatten else None
        try:
            tensor.view(*shape) if shape is not None else tensor.view(-1)
            return False
        except (RuntimeError, ValueError):  # no view of these strides: reshape copies
            return True

    def _move(self, func, args, kwargs) -> torch.Tensor | None:
        """A .to()/.cuda() across devices as the aten copy it dispatches (the binding would open a CUDA guard);
        None when the tensor stays on its device."""
        tensor = args[0]
        if func is torch.Tensor.cuda:
            device, dtype = CUDA, None
        else:
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                         if k not in ("copy", "non_blocking")})
        if device is None or torch.device(device).type == tensor.device.type:
            return None
        self.copies.append(f"Tensor.{func.__name__} {tensor.device.type} -> {torch.device(device).type}")
        # A fresh tensor on the target (fake tensors hold no data to copy; FakeTensorMode would run a copy of a
        # small real tensor for real, and fail on the missing CUDA)
        return torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=torch.device(device))


def answer_like_an_orin(monkeypatch, syncs: list) -> None:
    """torch.cuda answers as one sm_87 device; synchronize() appends to `syncs` (a host wait)."""
    cuda = torch.cuda
    for name, value in (("is_available", lambda: True), ("get_device_capability", lambda *a, **k: (8, 7)),
                        ("is_bf16_supported", lambda *a, **k: True), ("device_count", lambda: 1),
                        ("current_device", lambda: 0), ("memory_reserved", lambda *a, **k: 0),
                        ("synchronize", lambda *a, **k: syncs.append("torch.cuda.synchronize"))):
        monkeypatch.setattr(cuda, name, value)


class LaunchRecorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **meta)` records one launch and its tensors' devices."""

    def __init__(self, name: str, audits: list, devices: list) -> None:
        self.name, self.audits, self.devices = name, audits, devices

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.devices.append((self.name, tuple(sorted(placed(args)))))
            for audit in self.audits:
                audit.triton_launch(self.name)
        return launch


def stub_triton_launches(monkeypatch, audits: list, devices: list) -> None:
    """Every Triton kernel in oval_edge.kernels' triton_* modules records its launches into the audits in `audits`
    (the caller keeps the running StepAudit there) and their argument devices into `devices`; the loaders'
    self-checks pass (they would run kernels). The caller clears the loaders' caches (clear_triton_loaders) before
    loading an engine and after the stubs are undone."""
    import importlib

    from triton.runtime.jit import KernelInterface

    from oval_edge.kernels.triton_kernels import triton_check

    for module_name in ("triton_scoring", "triton_attention", "triton_int8_head", "triton_grouped", "triton_delta"):
        module = importlib.import_module(f"oval_edge.kernels.triton_kernels.{module_name}")
        for name, value in list(vars(module).items()):
            if isinstance(value, KernelInterface):
                monkeypatch.setattr(module, name, LaunchRecorder(name, audits, devices))
    for name in ("self_check", "int8_head_check", "grouped_linear_check", "delta_step_check"):
        monkeypatch.setattr(triton_check, name, lambda *a, **k: None)


def clear_triton_loaders() -> None:
    """Forget which Triton kernels loaded (gpu.py caches it per device type)."""
    from oval_edge.kernels import gpu

    for loader in (gpu._load, gpu.load_int8_head, gpu.load_grouped_linear, gpu.load_delta_step):
        loader.cache_clear()


def fake_linear4bit(weight, bias, quant, compute_dtype, device):
    """bitsandbytes' Params4bit cannot wrap a fake tensor: quantize zeros of the weight's shape for real on the CPU,
    then hand the packed codes and the whole QuantState (nested absmax included) to the fake device."""
    from oval_edge.runtime.model import quantize

    with unset_fake_temporarily():
        real = quantize.linear4bit(torch.zeros(tuple(weight.shape), dtype=compute_dtype), None, quant, compute_dtype,
                                   CPU)
    state = real.weight.quant_state
    state.to(device)
    param = torch.nn.Parameter(real.weight.data.to(device), requires_grad=False)
    param.quant_state = state
    real.weight = param
    if bias is not None:
        real.bias = torch.nn.Parameter(bias.to(device=device, dtype=compute_dtype), requires_grad=False)
    return real


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)
