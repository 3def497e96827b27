"""The model and engine flags `serve` and `chat` share, merged with `--config FILE.toml`: flags win over the file,
the file wins over the defaults. Everything is validated before the model is loaded, so a bad value fails in a
second with a message naming it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from oval_edge.config import DEFAULT_PREFILL_CHUNK, KV_DTYPES, OvalConfig
from oval_edge.runtime.engine.crossover import DEFAULT_OVAL_FROM
from oval_edge.runtime.model.origin.source import QUANT_TYPES
from oval_edge.runtime.model.tokenizer import read_chat_template
from oval_edge.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class EngineSpec:
    model: str
    quant: str
    device: str
    oval: OvalConfig
    max_batch: int
    max_queue: int
    prefill_chunk: int
    max_context: int | None
    attention: str
    server: dict  # the config file's [server] table (host, port, ...), for the command to read
    decode_step: str = "static"
    cuda_graphs: bool = True
    dtype: str = "auto"
    prefix_cache: bool = True
    max_step_tokens: int | None = None
    chat_template: str | None = None  # --chat-template as given (a shipped name or a file), None = the model's
    chat_template_text: str | None = None  # its text, read and parsed when the spec is made
    pool_tokens: int | None = None  # cap on the in-memory pool (tokens), below what the budget allows
    kv_store: str | None = None  # the page store's file or folder (NVMe), None = no store
    kv_store_size: int | None = None  # bytes (None: max_batch requests of the model's context)
    recall_pages: int | None = None  # recall frames per layer (None: the engine's default)
    kv_store_checksums: bool = False
    oval_from: int | None = None  # dense decode below this many tokens (None: the device's default)
    state_snapshots: int | None = None  # layer-state / ring-window copies for prefix caching (None: setup's default)

    def engine_config(self):
        from oval_edge.runtime.engine.setup import EngineConfig

        return EngineConfig(max_batch=self.max_batch, max_queue=self.max_queue, prefill_chunk=self.prefill_chunk,
                            attention=self.attention, oval_from=self.oval_from, max_model_len=self.max_context,
                            decode_step=self.decode_step,
                            cuda_graphs=self.cuda_graphs, prefix_cache=self.prefix_cache,
                            max_step_tokens=self.max_step_tokens, pool_tokens=self.pool_tokens,
                            kv_store=self.kv_store, kv_store_size=self.kv_store_size, recall_pages=self.recall_pages,
                            kv_store_checksums=self.kv_store_checksums, state_snapshots=self.state_snapshots)

    def load(self):
        """Load the model and build the engine (seconds to minutes; call it off the event loop)."""
        from oval_edge.runtime.engine.engine import Engine

        engine = Engine.load(self.model, self.quant, self.device, oval=self.oval, config=self.engine_config(),
                             dtype=self.dtype)
        engine.chat_template = self.chat_template_text
        return engine


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine (flags override --config)")
    group.add_argument("--config", metavar="FILE.toml",
                       help="TOML written by `oval-edge plan --write-config`: [model], [oval], [server] tables")
    group.add_argument("--model", help="'default' (the bundled SmolLM2-135M-Instruct GGUF), a .gguf file, or a "
                       "Hugging Face folder (default: default)")
    group.add_argument("--quant", choices=QUANT_TYPES,
                       help="how the weights are held (default: auto: a GGUF serves its own blocks, a 16-bit folder "
                            "4-bit codes per 32)")
    group.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    group.add_argument("--memory-budget", metavar="BYTES",
                       help="bytes for weights + workspace + KV pool, e.g. 1.5GiB (default: enough for --max-batch "
                       "sequences at full context, within the memory there is)")
    group.add_argument("--page-size", type=int, help="tokens per KV page: 16, 32, 64, 128 or 256 (default: 32)")
    group.add_argument("--top-k", type=int, help="pages selected per KV head at each decode step (default: 4)")
    group.add_argument("--kv-dtype", choices=KV_DTYPES,
                       help="K/V page storage (default: auto = bfloat16 on CPU, the activations' dtype on CUDA); "
                            "int8 = codes + an fp32 scale per token and KV head (~1.9x the tokens of bfloat16)")
    group.add_argument("--max-batch", type=int, help="sequences decoded together in one step (default: 4)")
    group.add_argument("--max-queue", type=int, help="requests that may wait for pages; more get 503 (default: 64)")
    group.add_argument("--max-context", type=int, metavar="TOKENS",
                       help="cap on prompt + max_tokens per request (default: the model's context length)")
    group.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                       help=f"prompt tokens of one request per step ({DEFAULT_PREFILL_CHUNK})")
    group.add_argument("--max-step-tokens", type=int, metavar="TOKENS",
                       help="tokens one step's forward carries: each running row's next token, then prompt chunks of "
                            "one or more requests in the rest (default: --max-batch + --prefill-chunk). Lower: "
                            "shorter pauses in running streams while a prompt is read; higher: faster bursts")
    group.add_argument("--window-module", metavar="FILE.safetensors",
                       help="a window module fitted by `oval-edge calibrate` (sets each head's window; off by default)"
                       "; without a window range in --config, the range it was calibrated with is used")
    group.add_argument("--threads", type=int, metavar="N",
                       help="CPU threads for the model's math (default: torch's, one per core). On a CPU host shared "
                            "with other busy processes, 1 thread avoids threads waiting on each other")
    group.add_argument("--decode-step", choices=("static", "compiled", "eager"),
                       help="static (the default: fixed shapes, no host sync, run eager), compiled (the same step "
                            "through torch.compile: faster steps after a one-time compile per batch bucket, ~50 s each "
                            "on a 2-core CPU), eager (the same static step, never captured into CUDA graphs or compiled)")
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                       help="on CUDA, capture the static decode step per batch bucket at startup and replay it "
                            "(default: on); --no-cuda-graphs runs it eager")
    group.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="share full KV pages between requests whose prompts start alike (default: on); "
                            "--no-prefix-cache prefills every prompt in full")
    group.add_argument("--state-snapshots", type=int, metavar="N", default=None,
                       help="copies kept so a cached prompt prefix can be resumed: a hybrid's (Qwen3.5, LFM2) layer "
                            "states, a sliding-window model's (Gemma) ring windows; one sequence's worth each from "
                            "the budget (default: 2 x max batch for hybrids, 0 for sliding models: prefix caching "
                            "off; 0 turns it off)")
    group.add_argument("--weight-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="keep the quantized weights under $OVAL_EDGE_CACHE/weights and memory-map them at the next "
                            "start (default: on, unless $OVAL_EDGE_WEIGHT_CACHE=0); --no-weight-cache quantizes from "
                            "the model file every time")
    group.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                       help="activations: auto (the default) is bfloat16 on CUDA compute capability 8.0+ (Orin: "
                            "8.7), float16 below, float32 on a CPU; bfloat16 also runs on a CPU (several times "
                            "slower there: to see what a GPU will compute), float16 does not")
    group.add_argument("--chat-template", metavar="FILE.jinja|NAME",
                       help="a Jinja chat template to use instead of the model's own, or a shipped one by name: "
                            "chatml-tools (ChatML with tool calling, for ChatML models whose template lacks tools, "
                            "such as the bundled SmolLM2)")
    group.add_argument("--attention", choices=("oval", "dense"),
                       help="oval (sparse decode, the default) or dense (reads every cached token: the baseline)")
    group.add_argument("--oval-from", type=int, metavar="TOKENS",
                       help="with --attention oval, decode steps whose longest sequence is shorter than this many "
                            "tokens run the dense step, which is faster there (OVAL's page scoring costs more than "
                            "the pages it skips); OVAL from it on; 0 = OVAL at every length (default: the device "
                            f"type's crossover, {DEFAULT_OVAL_FROM['cpu']} tokens on a CPU, measured, and "
                            f"{DEFAULT_OVAL_FROM['cuda']} on CUDA, not yet measured there; `oval-edge profile "
                            "--write-config` measures this device's and writes it to [server] oval_from)")
    add_store_arguments(parser)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV page store on disk (flags override --config)")
    group.add_argument("--kv-store", metavar="PATH",
                       help="a file or folder on an NVMe drive for sealed KV pages beyond the in-memory pool: requests "
                            "longer than the pool are served, nothing dropped (records stay in memory; selection "
                            "reads back the pages it names). Use it on a Jetson with an NVMe drive, where CPU and GPU "
                            "share one DRAM; not on eMMC/SD (too slow), zram or tmpfs (refused: they are RAM). "
                            "Created at full size at startup, removed at exit (default: no store)")
    group.add_argument("--kv-store-size", metavar="SIZE",
                       help="bytes of the store file, e.g. 16GiB; the drive must have them free (default: room for "
                            "--max-batch requests at the model's full context; every stored page's record stays in "
                            "memory, so a larger store costs memory too)")
    group.add_argument("--pool-tokens", type=int, metavar="N",
                       help="cap the in-memory KV pool at N tokens, below what --memory-budget allows: memory left "
                            "to other processes on the board, or a small pool to try --kv-store (default: no cap)")
    group.add_argument("--kv-recall-pages", type=int, metavar="N",
                       help="frames per layer that stored pages are read back into, kept across steps (LRU) "
                            "(default: max_batch x KV heads x top_k, what one step's selection can name)")
    group.add_argument("--kv-store-checksums", action=argparse.BooleanOptionalAction, default=None,
                       help="crc32 every stored page and check it on every read (debugging a drive; default: off)")


def _pick(flag, table: dict, key: str, default):
    if flag is not None:
        return flag
    return table.get(key, default)


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    """Merge flags over the config file over the defaults; raises ValueError naming a bad value.

    --threads is applied here (torch.set_num_threads is process-wide), so serve and chat share it.
    """
    threads = getattr(args, "threads", None)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads} must be >= 1")
        import torch

        torch.set_num_threads(threads)
    weight_cache = getattr(args, "weight_cache", None)
    if weight_cache is not None:  # read by load_model (process-wide, like --threads), so serve and chat share it
        from oval_edge.runtime.model.weight_cache import DISABLE_ENV

        os.environ[DISABLE_ENV] = "1" if weight_cache else "0"
    sections = {"model": {}, "oval": {}, "server": {}}
    if args.config:
        from oval_edge.runtime.config_file import load_config_file

        sections.update(load_config_file(args.config))
    model_t, server_t = sections["model"], sections["server"]
    oval_values = dict(sections.get("oval") or {})
    for flag, key in ((args.page_size, "page_size"), (args.top_k, "top_k"), (getattr(args, "kv_dtype", None), "kv_dtype")):
        if flag is not None:
            oval_values[key] = flag
    if getattr(args, "window_module", None):
        oval_values["window_module"] = args.window_module
    if oval_values.get("window_module") and oval_values.get("window_min") == oval_values.get("window_max"):
        from oval_edge.sparse.window_module import calibrated_window_range  # the range the module was fitted for

        oval_values["window_min"], oval_values["window_max"] = calibrated_window_range(oval_values["window_module"])
    budget = _pick(args.memory_budget, server_t, "memory_budget", oval_values.get("memory_budget"))
    if budget is not None:
        oval_values["memory_budget"] = budget
    oval = OvalConfig.from_dict(oval_values)
    template = _pick(getattr(args, "chat_template", None), model_t, "chat_template", None)
    spec = EngineSpec(
        model=_pick(args.model, model_t, "path", "default"),
        quant=_pick(args.quant, model_t, "quant", "auto"),
        device=_pick(args.device, server_t, "device", "auto"),
        oval=oval,
        max_batch=_pick(args.max_batch, server_t, "max_batch", 4),
        max_queue=_pick(args.max_queue, server_t, "max_queue", 64),
        prefill_chunk=_pick(args.prefill_chunk, server_t, "prefill_chunk", DEFAULT_PREFILL_CHUNK),
        max_context=_pick(args.max_context, server_t, "max_context", server_t.get("max_model_len")),
        attention=_pick(args.attention, server_t, "attention", "oval"),
        oval_from=_pick(getattr(args, "oval_from", None), server_t, "oval_from", None),
        state_snapshots=_pick(getattr(args, "state_snapshots", None), server_t, "state_snapshots", None),
        server=dict(server_t),
        decode_step=_pick(getattr(args, "decode_step", None), server_t, "decode_step", "static"),
        cuda_graphs=_pick(getattr(args, "cuda_graphs", None), server_t, "cuda_graphs", True),
        dtype=_pick(getattr(args, "dtype", None), model_t, "dtype", "auto"),
        prefix_cache=_pick(getattr(args, "prefix_cache", None), server_t, "prefix_cache", True),
        max_step_tokens=_pick(getattr(args, "max_step_tokens", None), server_t, "max_step_tokens", None),
        chat_template=template,
        chat_template_text=None if template is None else read_chat_template(template),
        **_store_values(args, server_t),
    )
    device = spec.device
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ValueError(f"device={device!r} is not a device; use auto, cpu, cuda or cuda:N")
    if spec.quant not in QUANT_TYPES:
        raise ValueError(f"quant={spec.quant!r} is unknown; allowed: {', '.join(QUANT_TYPES)}")
    if spec.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={spec.dtype!r} is unknown; allowed: auto, float32, bfloat16, float16")
    spec.engine_config()  # validates max_batch, max_queue, prefill_chunk, max_context now, before any loading
    if spec.kv_store is not None and spec.device.startswith("cuda"):  # store/tier.py reads into CPU memory
        raise ValueError(f"kv_store is not built for device={spec.device!r} yet (the page store reads into CPU "
                         "memory); use --device cpu or leave --kv-store unset")
    if spec.kv_store is not None:  # tmpfs / zram, a missing or read-only folder, a short drive: refused now
        from oval_edge.kv.store.page_file import check_store_path

        check_store_path(spec.kv_store, spec.kv_store_size or 0)  # an automatic size is checked once it is known
    return spec


def _store_values(args: argparse.Namespace, server_t: dict) -> dict:
    """The page store's EngineSpec fields: flags over [server] keys over the defaults (sizes as bytes)."""
    size = getattr(args, "kv_store_size", None)
    size = parse_bytes(size, "--kv-store-size") if size is not None else server_t.get("kv_store_size")
    store = _pick(getattr(args, "kv_store", None), server_t, "kv_store", None)
    return dict(
        pool_tokens=_pick(getattr(args, "pool_tokens", None), server_t, "pool_tokens", None),
        kv_store=os.path.expanduser(store) if store else store,
        kv_store_size=size,
        recall_pages=_pick(getattr(args, "kv_recall_pages", None), server_t, "recall_pages", None),
        kv_store_checksums=_pick(getattr(args, "kv_store_checksums", None), server_t, "kv_store_checksums", False),
    )


def describe_spec(spec: EngineSpec) -> str:
    o = spec.oval
    return (f"page_size {o.page_size}, top_k {o.top_k}, sink {o.sink_pages}, window {o.window_min}..{o.window_max}, "
            f"dense_layers {o.dense_layers}, scorer {o.scorer}, attention {spec.attention}"
            f"{f' from {spec.oval_from} tokens' if spec.attention == 'oval' and spec.oval_from is not None else ''}"
            f", decode step "
            f"{spec.decode_step}{' (CUDA graphs on CUDA)' if spec.cuda_graphs and spec.decode_step == 'static' else ''}, "
            f"dtype {spec.dtype}, {'chat template ' + spec.chat_template + ', ' if spec.chat_template else ''}max_batch "
            f"{spec.max_batch}, max_queue {spec.max_queue}"
            + (f", pool_tokens {spec.pool_tokens}" if spec.pool_tokens is not None else "")
            + (f", kv store {spec.kv_store} ("
               f"{format_bytes(spec.kv_store_size) if spec.kv_store_size else 'size: max_batch x context'})"
               if spec.kv_store else ""))
