"""What `oval-edge bench` runs: validated settings, the prompt, and the alternating order of the runs.

Each (engine, context, run) is one job in its own child process. Jobs alternate engine by engine inside a
context (oval dense hf llama.cpp oval dense …), and the contexts run by run (run 1 of every context, then run 2 …),
so that machine noise — another process waking up, the CPU clocking down — lands on every engine and every
context alike instead of on whichever ran last ([R-measuring]): the ratios bench reports (engine over engine, long
context over the shortest) compare runs made minutes apart, not a block of runs against another block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

RUNTIME_ENGINES = ("oval", "dense")  # this project's runtime, OVAL and dense attention on the same page pool
REUSE_PREFIX = "oval+reuse@"  # OVAL with selection reuse at a query cosine (--reuse-tau 0.95 -> oval+reuse@0.95)
GROUPS_PREFIX = "oval+groups@"  # OVAL scoring in two levels, groups of G pages (--group-pages 16 -> oval+groups@16;
#                                 --group-pages 0 -> oval+groups@0: flat scoring at every context)
CONSTRAINED = "oval+schema"  # OVAL with every token masked by --schema's grammar (the cost of constrained decoding)
PEER_ENGINES = ("hf", "llama.cpp")  # what a user would pick instead (Hugging Face generate(), llama-cpp-python)
ENGINES = RUNTIME_ENGINES + PEER_ENGINES
ENGINE_ALIASES = {"llamacpp": "llama.cpp", "llama_cpp": "llama.cpp", "huggingface": "hf", "transformers": "hf"}
HF_DTYPES = ("float32", "bfloat16", "float16")
WARMUP_PROMPT_TOKENS = 32
WARMUP_GEN_TOKENS = 4
COUNTED_STEPS = 1  # decode steps past the timed ones, run under the op counter (runtime engines only)

# A plain English passage, repeated and tokenized with the model's own tokenizer to make a prompt of exactly
# `context` tokens. Prose (not random ids) so that attention looks like it does on real input: OVAL's page
# selection and the softmax behave differently on noise.
PASSAGE = (
    "The ferry to the island leaves twice a day, once at dawn and once in the late afternoon, and the people "
    "who live on the far shore plan their lives around it. In winter the crossing is rough; the captain, who "
    "has made the trip for thirty years, reads the colour of the water and the shape of the clouds before he "
    "decides whether to sail. The harbour master keeps a notebook of every crossing: the time of departure, "
    "the number of passengers, the cargo, and a short remark about the weather. Some of the older entries "
    "mention storms that closed the harbour for a week, when bread and letters had to wait on the mainland. "
    "Children from the island go to school in the town, so the morning boat is full of backpacks and "
    "half-finished homework, while the afternoon boat carries tired workers, crates of vegetables and, "
    "now and then, a visitor who has read about the lighthouse and wants to see it for herself. "
    "The lighthouse stands on a rock at the northern tip. Its lamp was electrified long ago, but a keeper "
    "still climbs the stairs every evening to check the lens, wipe the salt from the glass and write the "
    "hour in a logbook that nobody else reads. He says the light is not only for ships: on a clear night "
    "the farmers inland can see it sweep across the fields, and they know the day is over. "
    "When the new bridge was proposed, the island argued about it for two years. A bridge would bring "
    "doctors and deliveries faster, but it would also bring traffic, and the quiet that made the place "
    "what it was might not survive. In the end the plan was shelved, not because of a vote but because the "
    "money ran out, and the ferry kept running as it always had. "
)


@dataclass(frozen=True)
class BenchSettings:
    contexts: tuple[int, ...]
    engines: tuple[str, ...]
    gen: int = 64
    runs: int = 3
    model: str = "default"
    model_name: str = ""  # what every row is labelled with (a synthetic model's name says "synthetic: speed only")
    synthetic: bool = False  # random weights (--model synthetic-long): speed and memory only, no quality
    # The model as resolved once by the parent (runtime.model.origin.source.resolve_model): the peers' workers load it
    # from these paths, so the llama.cpp worker never imports oval_edge.runtime (and with it torch).
    model_dir: str = ""
    gguf_file: str | None = None
    quant: str = "auto"
    device: str = "cpu"
    threads: int = 1
    page_size: int = 32
    top_k: int = 4
    decode_step: str = "static"  # EngineConfig.decode_step of the runtime's engines
    oval_from: int | None = None  # EngineConfig.oval_from of the oval engines (None: serve's default for the device)
    cuda_graphs: bool = True  # EngineConfig.cuda_graphs (on CUDA: the static step replayed from CUDA graphs)
    hf_dtype: str = "float32"
    timeout_s: float = 3600.0
    skipped: dict = field(default_factory=dict)  # engine -> why it does not run (printed, kept in the JSON)
    schema: dict | bool | None = None  # --schema: the JSON schema the oval+schema engine decodes under

    def __post_init__(self) -> None:
        if not self.contexts:
            raise ValueError("--contexts names no context; give e.g. 512,2048,4096,8192")
        for c in self.contexts:
            if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 1_048_576:
                raise ValueError(f"--contexts value {c!r} is out of range: allowed integers in [1, 1048576]")
        if not self.engines:
            raise ValueError("no engine to run; give --engines oval,dense and/or --peers")
        unknown = [e for e in self.engines if e not in (*ENGINES, CONSTRAINED)
                   and not e.startswith((REUSE_PREFIX, GROUPS_PREFIX))]
        if unknown:
            raise ValueError(f"--engines {unknown} unknown; allowed: {', '.join(ENGINES)}")
        if (CONSTRAINED in self.engines) != (self.schema is not None):
            raise ValueError(f"the {CONSTRAINED} engine runs exactly when --schema FILE.json is given")
        for engine in self.engines:
            try:
                tau = reuse_tau_of(engine)
            except ValueError:
                tau = float("nan")
            if tau is not None and not 0.0 < tau <= 1.0:
                raise ValueError(f"engine {engine!r}: the reuse cosine must be in (0, 1], e.g. {REUSE_PREFIX}0.95")
        for name, low, high in (("gen", 2, 1_000_000), ("runs", 1, 1000), ("threads", 1, 4096)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"--{name}={value!r} is out of range: allowed integers in [{low}, {high}]"
                                 + (" (decode speed needs at least 2 generated tokens)" if name == "gen" else ""))
        if self.hf_dtype not in HF_DTYPES:
            raise ValueError(f"--hf-dtype={self.hf_dtype!r} is unknown; allowed: {', '.join(HF_DTYPES)}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout={self.timeout_s!r} must be a positive number of seconds per run")


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    """'512,2k,4096' -> (512, 2048, 4096); a 'k' suffix means x1024."""
    values = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        scale = 1024 if part.endswith("k") else 1
        try:
            values.append(int(part[:-1] if scale > 1 else part) * scale)
        except ValueError as exc:
            raise ValueError(f"{flag}={text!r}: {part!r} is not an integer; give e.g. 512,2048,4096,8192") from exc
    if not values:
        raise ValueError(f"{flag}={text!r} names no value; give e.g. 512,2048,4096,8192")
    return tuple(dict.fromkeys(values))  # keep the order, drop repeats


def reuse_tau_of(engine: str) -> float | None:
    """The cosine threshold of an oval+reuse@TAU engine (None for any other engine)."""
    return float(engine[len(REUSE_PREFIX):]) if engine.startswith(REUSE_PREFIX) else None


def with_reuse(engines: tuple[str, ...], text: str | None) -> tuple[str, ...]:
    """--reuse-tau 0.9,0.95: one oval+reuse@TAU engine per value, right after oval (so they alternate A B A B)."""
    taus = variant_values(text, "--reuse-tau", float, lambda t: 0.0 < t <= 1.0, "(0, 1]", "cosines, e.g. 0.9,0.95")
    return after_oval(engines, [f"{REUSE_PREFIX}{t:g}" for t in taus])


def group_pages_of(engine: str) -> int | None:
    """The group size of an oval+groups@G engine (0: flat scoring); None for any other engine (the config's
    default: two levels past the context where they take over, OvalConfig.for_context)."""
    return int(engine[len(GROUPS_PREFIX):]) if engine.startswith(GROUPS_PREFIX) else None


def with_groups(engines: tuple[str, ...], text: str | None) -> tuple[str, ...]:
    """--group-pages 0,16: one oval+groups@G engine per value, right after oval (0: flat scoring at every context,
    G: two levels with groups of G pages)."""
    sizes = variant_values(text, "--group-pages", int, lambda g: g == 0 or 2 <= g <= 256, "0 or [2, 256]",
                           "page counts, e.g. 0,16")
    return after_oval(engines, [f"{GROUPS_PREFIX}{g}" for g in sizes])


def variant_values(text: str | None, flag: str, kind, valid, allowed: str, example: str) -> list:
    """The comma-separated values of a flag that adds oval variants ([] when not given); errors name the flag."""
    if text is None:
        return []
    try:
        values = [kind(part) for part in str(text).split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"{flag}={text!r} must be comma-separated {example}") from exc
    bad = [v for v in values if not valid(v)]
    if bad or not values:
        raise ValueError(f"{flag}={text!r}: {bad or 'no value'} out of range; allowed {allowed}")
    return values


def after_oval(engines: tuple[str, ...], added: list[str]) -> tuple[str, ...]:
    """Variants of oval go right after it, so that runs alternate oval, variant, ..., peer."""
    if not added:
        return engines
    at = engines.index("oval") + 1 if "oval" in engines else 0
    return engines[:at] + tuple(dict.fromkeys(added)) + engines[at:]


def with_schema(engines: tuple[str, ...], schema) -> tuple[str, ...]:
    """--schema FILE: the oval+schema engine right after oval (so the two alternate run by run)."""
    if schema is None:
        return engines
    if "oval" not in engines:
        raise ValueError("--schema compares constrained with free decoding under OVAL; keep oval in --engines")
    return after_oval(engines, [CONSTRAINED])


def parse_engines(text: str, peers: bool) -> tuple[str, ...]:
    names = [ENGINE_ALIASES.get(p.strip().lower(), p.strip().lower()) for p in str(text).split(",") if p.strip()]
    if peers:
        names += list(PEER_ENGINES)
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise ValueError(f"--engines: {unknown} unknown; allowed: {', '.join(ENGINES)} (--peers adds hf, llama.cpp)")
    return tuple(dict.fromkeys(names))


def default_threads() -> int:
    """CPUs this process may run on (respects taskset/cgroup affinity), the same for every engine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def schedule(contexts: tuple[int, ...], engines: tuple[str, ...], runs: int) -> list[tuple[str, int, int]]:
    """(engine, context, run) in execution order: run by run, every context, every engine once in each (A B A B …)."""
    return [(engine, context, run) for run in range(runs) for context in contexts for engine in engines]


def prompt_length(context: int, gen: int, max_positions: int | None) -> int:
    """Prompt tokens for a context: all of it, unless prompt + generated would pass the model's positions.

    A model trained on 8192 positions cannot be asked for 8192 prompt tokens and 64 more; there the prompt is
    shortened so that the last decode step runs at the model's full context (the row keeps its label). The runtime's
    engines decode COUNTED_STEPS more, untimed, to count what a step dispatches (runtime_engine.py); that is reserved
    too, so every engine gets the same prompt.
    """
    if max_positions is None or context + gen + COUNTED_STEPS <= max_positions:
        return context
    length = max_positions - gen - COUNTED_STEPS
    if length < 1:
        raise ValueError(f"--gen={gen} leaves no room for a prompt in the model's {max_positions} positions")
    return length


def passage_ids(tokenizer, length: int) -> list[int]:
    """The first `length` token ids of PASSAGE repeated (no special tokens, so every engine sees the same ids)."""
    def encode(text: str) -> list[int]:
        out = tokenizer(text, add_special_tokens=False)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    one = encode(PASSAGE)
    if not one:
        raise ValueError("the model's tokenizer turned the benchmark passage into no tokens")
    repeats = length // len(one) + 2
    ids = encode(PASSAGE * repeats)  # tokenized as one text so the joins between repeats are natural
    return ids[:length]


def warmup_ids(prompt: list[int]) -> list[int]:
    """A short prompt for the untimed warm-up (first calls allocate buffers and pick kernels). The workers reset
    every cache before the timed run, so it may overlap the timed prompt."""
    return list(prompt[:WARMUP_PROMPT_TOKENS])
