"""The `oval-edge` command: a table of subcommands, each imported only when it runs.

Importing lazily keeps `oval-edge serve` free of the tools ([R-layout]) and `--help` fast. Each subcommand module
exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("oval_edge.runtime.server.serve", "serve a model over the OpenAI-compatible HTTP API"),
    "chat": ("oval_edge.runtime.chat", "chat with a model in the terminal"),
    "pull": ("oval_edge.tools.pull.command", "download org/repo[:quant] from the Hugging Face Hub, if it fits"),
    "plan": ("oval_edge.tools.plan.command", "plan a memory budget for a Jetson Orin module (or this host)"),
    "profile": ("oval_edge.tools.profile.command", "measure page_size / top-k on this device and pick one"),
    "bench": ("oval_edge.tools.bench.command", "decode/prefill speed and memory: OVAL vs dense and peers"),
    "eval": ("oval_edge.tools.eval.command", "fidelity (KL, top-1) and passkey retrieval of OVAL vs others"),
    "store-check": ("oval_edge.tools.store_check.command", "the KV page store against the same runs in memory"),
    "calibrate": ("oval_edge.tools.calibrate.command", "fit the output-aware window module on dense attention"),
    "export-onnx": ("oval_edge.tools.export_onnx", "export the output-aware module to ONNX"),
}


# Commands whose process only runs the runtime (never torch.compile): see prepare_runtime_process.
RUNTIME_COMMANDS = ("serve", "chat")


def prepare_runtime_process() -> None:
    """Call before bitsandbytes is imported, in a process that only runs the runtime.

    bitsandbytes wraps its pure-PyTorch fallback ops in torch.compile when it is imported, which loads TorchDynamo
    and Inductor (~120 MB of RSS on this CPU build, measured) though the runtime calls its fused kernels, never
    those fallbacks, and compiles nothing. TORCHDYNAMO_DISABLE turns torch.compile into a no-op and keeps Inductor
    unloaded (45 MB less RSS, measured); a value the user set wins.
    """
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oval-edge",
        description="Serve language models inside a fixed memory budget with OVAL sparse decoding.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {name:<12} {text}" for name, (_, text) in COMMANDS.items())
        + "\n\nRun 'oval-edge COMMAND --help' for the options of one command.",
    )
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of the commands below")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] not in COMMANDS:
        parser.error(f"unknown command {argv[0]!r}; choose from: {', '.join(COMMANDS)}")
    name = argv[0]
    module_name, text = COMMANDS[name]
    if name in RUNTIME_COMMANDS:
        prepare_runtime_process()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"oval-edge {name}: not available in this build yet ({text}).", file=sys.stderr)
        return 2
    sub = argparse.ArgumentParser(prog=f"oval-edge {name}", description=text)
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except ValueError as exc:  # configuration errors name the offending value; no traceback for those
        print(f"oval-edge {name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
