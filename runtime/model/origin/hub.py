"""Models named `org/repo[:quant-or-file]` on the Hugging Face Hub: which files of a repo make the model, and where a
pulled model lies in the hub's own cache (`$HF_HOME/hub`), found with no network.

`oval-edge pull` (tools/pull/) downloads; `serve --model org/repo` only reads the cache, so a server never starts a
multi-gigabyte download that `pull` has not checked against the device. The tag follows llama.cpp's
`-hf org/repo:quant`: a quant name (Q4_K_M, q8_0, IQ4_XS ...) matched against the GGUF file names, or a file name.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass

# A Hub repo id (owner/name) with an optional ":tag"; a local path that exists always wins over this reading.
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95})(?::(?P<tag>[\w.+-]+))?$")
# A quant name as GGUF repos spell it in file names: Q4_K_M, IQ4_XS, Q4_0_4_4, F16, BF16 ...
QUANT_NAME = re.compile(r"^(?:I?Q\d+(?:_[A-Z0-9]+)*|B?F16|F32|FP16|FP32)$", re.IGNORECASE)
SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"  # the 4-bit K-quant most GGUF repos publish and llama.cpp picks by default
# What a safetensors folder needs to load (config, tokenizer, chat template, weights); other weight formats (*.bin,
# *.pth, ONNX, GGUF) and subfolders such as original/ are left on the Hub.
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                "chat_template.json", "*.safetensors", "*.safetensors.index.json")


@dataclass(frozen=True)
class HubId:
    repo: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo

    def with_tag(self, tag: str | None) -> HubId:
        return HubId(self.repo, tag)


@dataclass(frozen=True)
class ModelFiles:
    """The files of one repo that make the model: one GGUF file, or a safetensors folder's files."""

    hub_id: HubId
    kind: str  # "gguf" | "folder"
    files: tuple[str, ...]  # repo paths
    sizes: tuple[int | None, ...]  # bytes, None where the listing did not say

    @property
    def total_bytes(self) -> int:
        return sum(s or 0 for s in self.sizes)

    @property
    def gguf_file(self) -> str | None:
        return self.files[0] if self.kind == "gguf" else None


def parse_hub_id(text: str | None) -> HubId | None:
    """`org/repo` or `org/repo:tag` -> HubId; anything else (a path, 'default') -> None."""
    match = HUB_ID.match(text or "")
    if match is None or text.startswith((".", "/", "~")):
        return None
    return HubId(match["repo"], match["tag"])


def quant_label(path: str) -> str | None:
    """The quant named in a GGUF file name (upper case), e.g. 'model-q4_k_m.gguf' -> 'Q4_K_M'; None if none is."""
    stem = SPLIT_GGUF.sub("", os.path.basename(path))
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    labels = [token.upper() for token in re.split(r"[-.]", stem) if QUANT_NAME.match(token)]
    return labels[-1] if labels else None


def _loadable_ggufs(listing: dict[str, int | None]) -> list[str]:
    # mmproj files are vision projectors that ride along in multimodal GGUF repos, not language models
    return sorted(p for p in listing if p.lower().endswith(".gguf") and "mmproj" not in os.path.basename(p).lower())


def _choices(repo: str, ggufs: list[str]) -> str:
    names = [f"{repo}:{quant_label(p) or os.path.basename(p)}" for p in ggufs if not SPLIT_GGUF.search(p)]
    return ", ".join(dict.fromkeys(names)) or "none (only split files)"


def _match_gguf(hub_id: HubId, ggufs: list[str]) -> str:
    tag = hub_id.tag
    if tag is None:
        found = [p for p in ggufs if quant_label(p) == DEFAULT_QUANT and not SPLIT_GGUF.search(p)]
        if not found and len(ggufs) == 1:
            found = ggufs
        if len(found) != 1:
            raise ValueError(f"{hub_id.repo} has {len(ggufs)} GGUF files and no single {DEFAULT_QUANT} one; name one, "
                             f"e.g.: {_choices(hub_id.repo, ggufs)}")
        return found[0]
    if tag.lower().endswith(".gguf"):
        found = [p for p in ggufs if p == tag or os.path.basename(p) == tag]
    else:
        found = [p for p in ggufs if quant_label(p) == tag.upper()]
        if not found:  # a partial name such as 'instruct-q4' still picks a single file
            found = [p for p in ggufs if tag.lower() in os.path.basename(p).lower()]
    if len(found) > 1 and all(SPLIT_GGUF.search(p) for p in found):
        raise ValueError(f"{hub_id} is split into {len(found)} files ({os.path.basename(found[0])} ...); oval-edge "
                         f"loads one-file GGUFs: merge them with llama.cpp's `llama-gguf-split --merge` and serve the "
                         f"file, or pick a one-file quant: {_choices(hub_id.repo, ggufs)}")
    if len(found) != 1:
        what = "matches several files" if found else "matches no GGUF file"
        raise ValueError(f"{hub_id}: '{tag}' {what} in {hub_id.repo}; available: {_choices(hub_id.repo, ggufs)}")
    return found[0]


def _folder_files(listing: dict[str, int | None]) -> list[str]:
    return sorted(p for p in listing if "/" not in p and any(fnmatch.fnmatch(p, pat) for pat in FOLDER_FILES))


def choose_files(hub_id: HubId, listing: dict[str, int | None]) -> ModelFiles:
    """The files to fetch from a repo whose files (path -> bytes) are `listing`.

    A tag picks a GGUF file; no tag picks the safetensors folder when the repo has one, else its Q4_K_M GGUF (or
    its only GGUF). ValueError, listing what is there, when nothing or more than one thing matches.
    """
    ggufs = _loadable_ggufs(listing)
    folder = _folder_files(listing)
    has_folder = "config.json" in folder and any(p.endswith(".safetensors") for p in folder)
    if hub_id.tag is None and has_folder:
        return ModelFiles(hub_id, "folder", tuple(folder), tuple(listing[p] for p in folder))
    if ggufs:
        path = _match_gguf(hub_id, ggufs)
        return ModelFiles(hub_id.with_tag(hub_id.tag or quant_label(path)), "gguf", (path,), (listing[path],))
    if hub_id.tag is not None and has_folder:
        raise ValueError(f"{hub_id.repo} has no GGUF files, so ':{hub_id.tag}' names nothing; it is a safetensors "
                         f"folder: use {hub_id.repo} with no tag (quantized to 4 bits at load)")
    others = [p for p in listing if p.endswith((".bin", ".pth", ".pt", ".onnx", ".h5", ".msgpack"))]
    if "config.json" in listing and others:
        kinds = ", ".join(sorted({os.path.splitext(p)[1] for p in others}))
        raise ValueError(f"{hub_id.repo} has weights only as {kinds}; oval-edge reads *.safetensors or GGUF files: "
                         f"pick a repo that has them")
    raise ValueError(f"{hub_id.repo} has neither GGUF files nor a config.json with *.safetensors weights "
                     f"({len(listing)} files); pick a model repo with one of those")


def hub_cache_dir() -> str:
    """The hub's cache of downloaded repos: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def snapshot_folder(repo: str, revision: str = "main") -> str | None:
    """The local snapshot of `repo` at `revision` (a branch's last pulled commit), or None if never pulled."""
    storage = os.path.join(hub_cache_dir(), "models--" + repo.replace("/", "--"))
    ref = os.path.join(storage, "refs", revision)
    commit = revision
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as handle:
            commit = handle.read().strip()
    folder = os.path.join(storage, "snapshots", commit)
    return folder if os.path.isdir(folder) else None


def cached_files(folder: str) -> dict[str, int | None]:
    """Repo path -> bytes of the complete files in a snapshot (a snapshot holds links to finished blobs only)."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if os.path.exists(path):  # a link whose blob was deleted is not a file we have
                found[os.path.relpath(path, folder).replace(os.sep, "/")] = os.path.getsize(path)
    return found


def _missing_shards(folder: str) -> list[str]:
    """Weight shards a pulled folder's index names that are not in the snapshot (a pull cut short)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return []
    try:
        with open(index, encoding="utf-8") as handle:
            shards = set(json.load(handle)["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"a readable {os.path.basename(index)} ({exc})"]
    return sorted(s for s in shards if not os.path.exists(os.path.join(folder, s)))


def pulled_model_path(hub_id: HubId) -> tuple[str, ModelFiles]:
    """The local path (GGUF file or folder) of a pulled model, read from the cache with no network. ValueError
    saying which `oval-edge pull` to run when it has not been pulled."""
    folder = snapshot_folder(hub_id.repo)
    if folder is None:
        offline = (" (HF_HUB_OFFLINE is set, so nothing can be downloaded now)" if os.environ.get("HF_HUB_OFFLINE")
                   else "")
        raise ValueError(f"model {hub_id} has not been pulled into {hub_cache_dir()}{offline}; run "
                         f"`oval-edge pull {hub_id}` first (it checks the model fits this device), or pass a local "
                         f"path (there is no file or folder ./{hub_id.repo})")
    try:
        chosen = choose_files(hub_id, cached_files(folder))
    except ValueError as exc:
        raise ValueError(f"{exc} (among the files pulled into {folder}; `oval-edge pull {hub_id}` fetches "
                         f"others)") from exc
    missing = _missing_shards(folder) if chosen.kind == "folder" else []
    if missing:
        raise ValueError(f"model {hub_id} is only partly pulled ({missing[0]} is missing); run "
                         f"`oval-edge pull {hub_id}`")
    path = os.path.join(folder, chosen.gguf_file) if chosen.gguf_file else folder
    return path, chosen
