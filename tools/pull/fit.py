"""Will a Hub model fit the device? Asked of `oval-edge plan`'s own functions before the weights are downloaded.

The plan needs the model's shape. A safetensors folder's shape is its config.json (a few KB, fetched into the cache
first). A GGUF file's shape is in its header (metadata and tensor table, a few MB at the file's start): those bytes
are fetched with a Range request and written at the start of a sparse file of the full size, which the GGUF reader
then reads as the whole file (the tensor data it never reads are holes, no disk used).
"""

from __future__ import annotations

import os
import tempfile

from oval_edge.runtime.model.origin.hub import HubId, ModelFiles, quant_label
from oval_edge.units import format_bytes

from ..plan.compute import DevicePlan, PlanRequest, plan_device
from ..plan.model import ModelShape, read_model_shape
from .download import fetch_bytes

FIRST_HEADER_READ = 4 << 20  # bytes; a Llama-3 vocabulary's GGUF header is ~8 MB, a small model's < 1 MB
LARGEST_HEADER = 256 << 20  # a header past this is not one a GGUF writer makes


def gguf_header_complete(path: str, have: int) -> bool:
    """Whether the first `have` bytes of the (sparse) file at `path` hold its whole GGUF header: parsing reads past
    them into the zero-filled holes exactly when they do not."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r").data_offset <= have
    except Exception:  # zeros parsed as a header: a broken count or type; read more and try again
        return False


def gguf_shape(files: ModelFiles, revision: str) -> ModelShape:
    path, size = files.files[0], files.sizes[0]
    if not size:
        raise ValueError(f"the Hub did not say the size of {path} in {files.hub_id.repo}; pull with --force to skip "
                         "the fit check")
    count = min(FIRST_HEADER_READ, size)
    with tempfile.TemporaryDirectory(prefix="oval-edge-pull-") as folder:
        local = os.path.join(folder, os.path.basename(path))
        while True:
            head = fetch_bytes(files.hub_id, path, revision, count)
            with open(local, "wb") as handle:
                handle.write(head)
                handle.truncate(size)  # the rest of the file as a hole: same size, no bytes
            if gguf_header_complete(local, len(head)):
                return read_model_shape(local)
            if len(head) < count or count >= min(size, LARGEST_HEADER):
                raise ValueError(f"{path} in {files.hub_id.repo} has no readable GGUF header in its first "
                                 f"{len(head)} bytes; pull with --force to skip the fit check")
            count = min(count * 4, size, LARGEST_HEADER)


def folder_shape(files: ModelFiles, revision: str) -> ModelShape:
    from huggingface_hub import hf_hub_download

    return read_model_shape(hf_hub_download(files.hub_id.repo, "config.json", revision=revision))


def target_device(name: str, root: str = "/"):
    """(device spec, budget bytes or None) for an Orin module name, or this machine for 'auto' (as `plan` does)."""
    from oval_edge.jetson.modules import get_module

    if name.strip().lower() != "auto":
        return get_module(name, root), None
    from oval_edge.jetson.probe import probe

    found = probe(root)
    if found.module is None:
        raise ValueError(f"this machine ({found.title}) is not in the device table; pass --device NAME "
                         "(oval-edge plan --help lists them) or --force to skip the fit check")
    return found.module, found.budget_bytes


def plan_for(files: ModelFiles, revision: str, device: str, request: PlanRequest) -> DevicePlan:
    shape = gguf_shape(files, revision) if files.kind == "gguf" else folder_shape(files, revision)
    spec, budget = target_device(device)
    return plan_device(shape, spec, request, budget, "this machine's available memory" if budget else None)


def smaller_ggufs(files: ModelFiles, listing: dict[str, int | None], room: int) -> list[str]:
    """`repo:QUANT (size)` for the repo's other GGUF files whose bytes fit in `room`, largest first."""
    others = [(size, p) for p, size in listing.items() if p.lower().endswith(".gguf") and p not in files.files
              and size and size <= room and "mmproj" not in p.lower()]
    return [f"{files.hub_id.repo}:{quant_label(p) or os.path.basename(p)} ({format_bytes(size)})"
            for size, p in sorted(others, reverse=True)]


def refusal(files: ModelFiles, plan: DevicePlan, listing: dict[str, int | None]) -> str:
    """Why `files` cannot be served on the planned device, and what could be instead."""
    lines = [f"{files.hub_id} ({format_bytes(files.total_bytes)} to download) does not fit {plan.device.title}: "
             f"{plan.does_not_fit_message()}"]
    if files.kind == "gguf":
        room = plan.budget_bytes - plan.runtime_overhead
        smaller = smaller_ggufs(files, listing, room)
        lines.append("smaller files in this repo whose weights fit the budget: " + ", ".join(smaller) if smaller
                     else f"no GGUF file in {files.hub_id.repo} is smaller than the {format_bytes(room)} the budget "
                          "leaves for weights; pick a smaller model")
    tokens, _ = plan.longest_context
    if tokens > 0:
        lines.append(f"or pull for a shorter context: --context {tokens}")
    lines.append("--device NAME plans for another module; --force downloads anyway")
    return "\n".join(lines)
