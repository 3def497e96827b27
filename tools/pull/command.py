"""`oval-edge pull org/repo[:quant-or-file]`: download a model from the Hugging Face Hub into its cache, once it is
known to fit the device.

Files go where huggingface_hub keeps them ($HF_HOME/hub, default ~/.cache/huggingface/hub), so `oval-edge serve
--model org/repo[:quant]` finds them with no network. HF_TOKEN (gated or private repos), HF_ENDPOINT (a mirror) and
HF_HUB_OFFLINE (no network: report what is pulled) are the hub's own variables. Exit status: 0 pulled (or already
pulled), 1 the model does not fit the device, 2 bad input or the Hub could not answer, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys

from oval_edge.config import OvalConfig
from oval_edge.runtime.model.origin.hub import HubId, ModelFiles, choose_files, hub_cache_dir, parse_hub_id, pulled_model_path
from oval_edge.runtime.model.origin.source import quant_choices
from oval_edge.units import format_bytes, parse_bytes

from ..plan.compute import PlanRequest
from .download import download, is_unreachable, partial_bytes, remote_listing
from .fit import plan_for, refusal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="org/repo (a safetensors folder, or the repo's Q4_K_M GGUF), org/repo:QUANT "
                                      "(e.g. :Q4_K_M, :q8_0, matched in the GGUF file names) or org/repo:FILE.gguf")
    parser.add_argument("--device", default="auto",
                        help="check the model fits this device before downloading: auto (this machine) or an Orin "
                             "module name (oval-edge plan --help lists them)")
    parser.add_argument("--context", type=int, default=PlanRequest.context,
                        help=f"tokens per sequence it must fit with (default {PlanRequest.context})")
    parser.add_argument("--quant", default="auto", choices=quant_choices("auto"),
                        help="how it will be served (a folder's 4-bit format sets its weight bytes)")
    parser.add_argument("--memory-budget", default=None, help="bytes the server may use, e.g. 6GiB (default: as plan)")
    parser.add_argument("--revision", default="main", help="branch, tag or commit of the repo (default main)")
    parser.add_argument("--force", action="store_true", help="download even if the plan says it does not fit")


def _hub_id(text: str) -> HubId:
    hub_id = parse_hub_id(text)
    if hub_id is None:
        raise ValueError(f"{text!r} is not a Hub model name; write org/repo, org/repo:Q4_K_M or org/repo:file.gguf "
                         "(a local file needs no pull: oval-edge serve --model PATH)")
    return hub_id


def _hub_error(hub_id: HubId, exc: Exception) -> ValueError:
    """A message that says what to change, for what the Hub (or the way to it) answered."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    where = constants.ENDPOINT
    if is_unreachable(exc):
        return ValueError(f"cannot reach the Hugging Face Hub at {where} ({type(exc).__name__}: {exc}); check the "
                          f"network, a proxy, or HF_ENDPOINT; with HF_HUB_OFFLINE=1 serve uses only pulled models")
    if isinstance(exc, GatedRepoError):
        return ValueError(f"{hub_id.repo} is gated: accept its licence at {where}/{hub_id.repo} and set HF_TOKEN to "
                          "a token of that account")
    if isinstance(exc, RepositoryNotFoundError):
        return ValueError(f"no model repo {hub_id.repo} at {where}, or it is private: check the name, or set "
                          "HF_TOKEN to a token that can read it")
    if isinstance(exc, RevisionNotFoundError):
        return ValueError(f"{hub_id.repo} has no revision {exc.response.request.url.path.rsplit('/', 1)[-1]!r}; "
                          "pass an existing --revision (default main)")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return ValueError(f"the Hub at {where} answered HTTP {status} for {hub_id} ({exc}); try again later")
    raise exc


def _already_pulled(hub_id: HubId, why: str) -> int:
    path, files = pulled_model_path(hub_id)
    print(f"{why}; {files.hub_id} is already pulled (not checked for updates):\n{path}")
    print(f"serve it: oval-edge serve --model {files.hub_id}")
    return 0


def run(args: argparse.Namespace) -> int:
    from huggingface_hub import constants, is_offline_mode

    hub_id = _hub_id(args.model)
    request = PlanRequest(quant=args.quant, context=args.context, oval=OvalConfig(),
                          memory_budget=parse_bytes(args.memory_budget, "--memory-budget") if args.memory_budget
                          else None)
    if is_offline_mode():
        try:
            return _already_pulled(hub_id, "HF_HUB_OFFLINE is set")
        except ValueError:
            raise ValueError(f"HF_HUB_OFFLINE is set, so {hub_id} cannot be downloaded, and it is not in "
                             f"{hub_cache_dir()}: unset HF_HUB_OFFLINE on a machine that reaches {constants.ENDPOINT}"
                             f" and run `oval-edge pull {hub_id}` (or copy a pulled {hub_cache_dir()} here)") from None
    try:
        listing = remote_listing(hub_id, args.revision)
    except Exception as exc:  # the Hub's answers and transport errors, each turned into what to change
        error = _hub_error(hub_id, exc)
        if is_unreachable(exc):
            try:
                return _already_pulled(hub_id, f"the Hub at {constants.ENDPOINT} is unreachable")
            except ValueError:
                pass
        raise error from None
    files = choose_files(hub_id, listing)
    _describe(files)
    if not args.force:
        try:
            plan = plan_for(files, args.revision, args.device, request)
        except ValueError:
            raise
        except Exception as exc:
            raise _hub_error(hub_id, exc) from None
        if not plan.fits:
            print(f"oval-edge pull: {refusal(files, plan, listing)}", file=sys.stderr)
            return 1
        best = plan.recommended
        print(f"fits {plan.device.title}: {format_bytes(plan.weights.total)} of weights, {best.pages} KV pages of "
              f"{best.page_size} tokens at context {request.context} (oval-edge plan for details)")
    try:
        path = download(files, args.revision)
    except ValueError:
        raise
    except KeyboardInterrupt:
        print(f"\ninterrupted with {format_bytes(partial_bytes(hub_id))} kept: run `oval-edge pull {files.hub_id}` "
              "again to resume", file=sys.stderr)
        return 130
    except Exception as exc:
        raise _hub_error(hub_id, exc) from None
    print(f"pulled {files.hub_id} into {hub_cache_dir()}:\n{path}")
    print(f"serve it: oval-edge serve --model {files.hub_id}")
    return 0


def _describe(files: ModelFiles) -> None:
    what = (f"GGUF file {files.files[0]}" if files.kind == "gguf"
            else f"safetensors folder ({len(files.files)} files)")
    print(f"{files.hub_id}: {what}, {format_bytes(files.total_bytes)}")
