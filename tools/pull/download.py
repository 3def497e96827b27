"""Listing a Hub repo's files and downloading the chosen ones into the hub's cache, resumable across runs.

huggingface_hub retries a dropped connection inside one download with a Range request, but (since its 1.x cache
rewrite) deletes the partial file when the process ends, so a pull stopped by Ctrl-C, a reboot or a lost Wi-Fi
restarts a multi-gigabyte file from zero. Weight files are therefore fetched first into `blobs/<etag>.part` next to
the blob the hub would write, appended to on the next run, and moved to `blobs/<etag>` when complete; the hub's own
`hf_hub_download` then finds the blob and only links it into the snapshot. Files the hub serves through Xet (with
`hf_xet` installed) are left to the hub: Xet keeps its own chunk cache, which is what resumes those.
"""

from __future__ import annotations

import fcntl
import os
from urllib.parse import urlparse

from oval_edge.runtime.model.origin.hub import HubId, ModelFiles, hub_cache_dir

PART_SUFFIX = ".part"  # the hub names its own temporary files *.incomplete and deletes them; ours are kept
WEIGHT_SUFFIXES = (".gguf", ".safetensors")  # the files large enough to be worth resuming


def is_unreachable(exc: BaseException) -> bool:
    """True for a connection refused / DNS / timeout error from whichever HTTP client this huggingface_hub uses
    (requests before 1.0, httpx or httpx2 after): their transport errors share these class names."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"TransportError", "ConnectionError", "Timeout", "TimeoutException"})


def remote_listing(hub_id: HubId, revision: str) -> dict[str, int | None]:
    """Repo path -> bytes for every file of the repo at `revision` (one API call)."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(hub_id.repo, revision=revision, files_metadata=True)
    return {s.rfilename: s.size for s in info.siblings or ()}


def fetch_bytes(hub_id: HubId, path: str, revision: str, count: int) -> bytes:
    """The first `count` bytes of a repo file (one Range request; the stream is closed after them, so a server that
    ignores the Range costs no more than `count` bytes)."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    headers = {**build_hf_headers(), "Range": f"bytes=0-{count - 1}"}
    chunks, got = [], 0
    with get_session().stream("GET", hf_hub_url(hub_id.repo, path, revision=revision), headers=headers,
                              follow_redirects=True) as response:
        hf_raise_for_status(response)
        for chunk in response.iter_bytes():
            chunks.append(chunk)
            got += len(chunk)
            if got >= count:
                break
    return b"".join(chunks)[:count]


def _xet_downloads() -> bool:
    """Whether the hub downloads Xet-backed files through hf_xet (installed and not switched off)."""
    import importlib.util

    from huggingface_hub import constants

    return importlib.util.find_spec("hf_xet") is not None and not constants.HF_HUB_DISABLE_XET


def _storage_folder(repo: str) -> str:
    return os.path.join(hub_cache_dir(), "models--" + repo.replace("/", "--"))


def resumable_blob(hub_id: HubId, path: str, revision: str) -> None:
    """Download one weight file into `blobs/<etag>` through a `.part` file that a later run continues."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(hub_id.repo, path, revision=revision)
    meta = get_hf_file_metadata(url)
    if meta.etag is None or meta.size is None or (meta.xet_file_data is not None and _xet_downloads()):
        return  # the hub's own path: no etag or size to name a partial file by, or Xet's chunk cache resumes it
    blob = os.path.join(_storage_folder(hub_id.repo), "blobs", meta.etag)
    if os.path.exists(blob):
        return
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    headers = build_hf_headers()
    if urlparse(meta.location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed CDN address: the token is for the Hub, not for the CDN
    with open(blob + PART_SUFFIX, "ab") as part:
        try:
            fcntl.flock(part, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another `oval-edge pull` is downloading {path} into {blob}{PART_SUFFIX}; wait for "
                             f"it to finish") from None
        have = part.tell()
        if have > meta.size:  # not this file's bytes: start again
            part.truncate(0)
            have = 0
        if have:
            print(f"resuming {path} at {have} of {meta.size} bytes", flush=True)
        http_get(meta.location, part, resume_size=have, headers=headers, expected_size=meta.size,
                 displayed_filename=os.path.basename(path))
    os.replace(blob + PART_SUFFIX, blob)


def partial_bytes(hub_id: HubId) -> int:
    """Bytes kept in `.part` files of this repo (what a rerun resumes from)."""
    blobs = os.path.join(_storage_folder(hub_id.repo), "blobs")
    if not os.path.isdir(blobs):
        return 0
    return sum(os.path.getsize(os.path.join(blobs, n)) for n in os.listdir(blobs) if n.endswith(PART_SUFFIX))


def download(files: ModelFiles, revision: str) -> str:
    """Fetch `files` into the hub's cache; the local path of the GGUF file or of the snapshot folder."""
    from huggingface_hub import hf_hub_download

    local = ""
    for path in files.files:
        if path.endswith(WEIGHT_SUFFIXES):
            resumable_blob(files.hub_id, path, revision)
        local = hf_hub_download(files.hub_id.repo, path, revision=revision)
        if files.kind == "folder":
            local = local[: -len(path)].rstrip("/")  # the snapshot folder holding every file of the model
    return local
