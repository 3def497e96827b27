"""Constrained decoding with xgrammar: JSON schemas compiled once per tokenizer, one matcher per request.

Why xgrammar (measured on this machine's CPU, one thread, SmolLM2's 49152-token vocabulary, a 4-property nested
schema, 49 tokens of output; docs/structured-output.md): xgrammar fills a token mask in 5-6 us on average (100 us at
worst), llguidance in 48-68 us (1.4-2.4 ms at worst); xgrammar compiles the schema in ~6 ms, llguidance in ~1.4 ms.
A decode step here takes tens of milliseconds, so both are small beside it, and the per-token cost decides.

Masks are filled on the engine's grammar worker thread while the step's forward runs (`start_mask` before the
forward, `allowed` after it): the matcher's state only depends on tokens already accepted, not on this step.

Numbers are bounded in every grammar built here (`bound_numbers`): at most 16 digits before the point, 16 after it
and 2 in an exponent, as llama.cpp's schema converter bounds them. xgrammar's own number rules repeat digits
without end, and the bundled model, asked for {"x": number}, wrote `100000000000000000000...` until max_tokens.

Keywords xgrammar parses but does not enforce (checked one by one: a document that breaks them was accepted) are
refused with a 400 naming the keyword and where it is, rather than producing output that fails validation.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch

# Accepted by xgrammar's schema converter but not enforced by the grammar it builds.
UNENFORCED_KEYWORDS = ("not", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
                       "dependencies", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems", "propertyNames")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")


INTEGRAL_DIGITS = 16  # a number's digits before the point (a double holds ~16 significant digits)
FRACTION_DIGITS = 16  # after the point
EXPONENT_DIGITS = 2  # after e/E and its sign: up to 1e99, finite as a double
# A rule whose body is one digit, which xgrammar's printed grammar repeats with {m, -1} (-1 = no upper bound).
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)


class GrammarError(ValueError):
    """The schema cannot be enforced as given; the message names the construct and where it is."""


def check_enforceable(schema, path: str = "$") -> None:
    """Raise GrammarError at the first keyword the grammar would silently ignore (a JSON path in the message)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{path}: a schema must be an object or a boolean, got {type(schema).__name__}")
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            raise GrammarError(f"{path}: the keyword '{keyword}' cannot be enforced by constrained decoding; "
                               "remove it (or express it with enum/anyOf)")
    if schema.get("uniqueItems") is True:
        raise GrammarError(f"{path}: 'uniqueItems': true cannot be enforced by constrained decoding; remove it")
    for key in _SCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            check_enforceable(sub, f"{path}.{key}.{name}")
    for key in _SCHEMA_VALUES:
        if key in schema:
            check_enforceable(schema[key], f"{path}.{key}")
    for key in _SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or ()) if isinstance(schema.get(key), list) else ():
            check_enforceable(sub, f"{path}.{key}[{i}]")


def bound_numbers(ebnf: str) -> str:
    """xgrammar's printed grammar `ebnf` with every unbounded run of digits bounded: after a leading [1-9] (the
    integral part) to INTEGRAL_DIGITS in all, after e/E to EXPONENT_DIGITS, elsewhere (a fraction) to
    FRACTION_DIGITS. Pattern strings are Regex(...) rules and string formats repeat their own rules, so only
    numbers' digits match. `unbounded_digits` says what is left (tests hold it empty)."""
    digit_rules = _DIGIT_RULE.findall(ebnf)
    ebnf = ebnf.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {INTEGRAL_DIGITS - 1}}}")
    if not digit_rules:
        return ebnf
    names = "|".join(re.escape(name) for name in digit_rules)

    def bounded(limit: int):
        return lambda m: f"{m.group(1)}{m.group(2)}{{{m.group(3)}, {max(int(m.group(3)), limit)}}}"

    ebnf = re.sub(rf"(\[eE\] (?:\w+ )?)({names})\{{(\d+), -1\}}", bounded(EXPONENT_DIGITS), ebnf)
    ebnf = re.sub(rf"(\[1-9\] )({names})\{{(\d+), -1\}}", bounded(INTEGRAL_DIGITS - 1), ebnf)
    return re.sub(rf"()({names})\{{(\d+), -1\}}", bounded(FRACTION_DIGITS), ebnf)


def unbounded_digits(ebnf: str) -> list[str]:
    """The lines of a printed grammar that still repeat a digit without end (none after bound_numbers)."""
    names = set(_DIGIT_RULE.findall(ebnf))
    return [line for line in ebnf.splitlines() if not line.lstrip().split(" ::= ")[-1].startswith("Regex(")
            and ("[0-9]*" in line or "[0-9]+" in line
                 or any(re.search(rf"\b{re.escape(n)}\{{\d+, -1\}}", line) for n in names))]


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer (its vocabulary is scanned once, ~130 ms, on first use)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        # One thread: the board's other core runs the engine; the compiler caches what it compiled.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def json_schema(self, schema) -> object:
        """A compiled grammar for documents valid under `schema` (dict or bool); GrammarError if it cannot be."""
        check_enforceable(schema)
        return self._compile(schema, strict=True)

    def json_object(self) -> object:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return self._compile({"type": "object"}, strict=False)

    def tool_call(self, functions: list[tuple[str, object]], opening: str, closing: str) -> object:
        """A compiled grammar for exactly one call `opening{"name": N, "arguments": A}closing`, N one of the
        functions' names and A valid under that function's parameters schema. functions: [(name, parameters)].
        Raises ToolSchemaError(index, message) naming the first function whose schema cannot be enforced."""
        variants, defs = self._call_variants(functions)
        xgr = self._xgr
        body = self._from_schema(_with_defs(variants[0] if len(variants) == 1 else {"anyOf": variants}, defs))
        literal = lambda text: xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")  # noqa: E731
        return self._compiler.compile_grammar(xgr.Grammar.concat(literal(opening), body, literal(closing)))

    def tool_json(self, functions: list[tuple[str, object]], max_calls: int, reply: bool) -> object:
        """The generic tool format, for chat templates that do not render tools: one JSON object, either
        {"tool_calls": [{"name": N, "arguments": A}, ...]} (1..max_calls calls, each as in tool_call) or, when
        `reply`, {"response": "text"} (the model answers instead). Raises ToolSchemaError as tool_call does."""
        variants, defs = self._call_variants(functions)
        calls = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
            "minItems": 1, "maxItems": max_calls}}, "required": ["tool_calls"], "additionalProperties": False}
        schema = calls
        if reply:
            answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                      "additionalProperties": False}
            schema = {"anyOf": [calls, answer]}
        return self._compiler.compile_grammar(self._from_schema(_with_defs(schema, defs)))

    def _call_variants(self, functions: list[tuple[str, object]]) -> tuple[list[dict], dict]:
        """([{"name": const N, "arguments": parameters} object schema per function], their hoisted $defs)."""
        variants, defs = [], {}
        for index, (name, parameters) in enumerate(functions):
            try:
                self.json_schema(parameters)  # alone first, so that an error names its function
            except GrammarError as exc:
                raise ToolSchemaError(index, str(exc)) from exc
            parameters, own_defs = _hoist_defs(parameters, f"f{index}_")
            defs.update(own_defs)
            variants.append({"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                             "required": ["name", "arguments"], "additionalProperties": False})
        return variants, defs

    def _from_schema(self, schema):
        grammar = self._xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        return self._bounded(grammar)

    def _compile(self, schema, strict: bool):
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"the schema is not JSON-serialisable: {exc}") from exc
        try:
            # Compact separators: a small model given free whitespace may emit it until max_tokens.
            grammar = self._xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict)
        except RuntimeError as exc:  # xgrammar's message names the construct ("Unsupported type "foo"", ...)
            raise GrammarError(f"the schema cannot be compiled: {_last_line(exc)}") from exc
        return self._compiler.compile_grammar(self._bounded(grammar))

    def _bounded(self, grammar):
        return self._xgr.Grammar.from_ebnf(bound_numbers(str(grammar)))


class ToolSchemaError(GrammarError):
    """A tool's parameters schema cannot be enforced; `index` is its place in the request's tools."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def _with_defs(schema: dict, defs: dict) -> dict:
    return {**schema, "$defs": defs} if defs else schema


def _hoist_defs(schema, prefix: str):
    """(schema without its own $defs/definitions, those definitions renamed with `prefix`), its "#/$defs/X" and
    "#/definitions/X" references rewritten: a parameters schema is nested under "arguments", where its references
    to its own root would no longer resolve."""
    if not isinstance(schema, dict):
        return schema, {}
    defs = {prefix + k: v for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)
            for k, v in schema[key].items()}
    if not defs:
        return schema, {}

    def rewrite(node):
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = out.get("$ref")
            if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                out["$ref"] = "#/$defs/" + prefix + ref.split("/", 2)[2]
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    root = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    return rewrite(root), {name: rewrite(value) for name, value in defs.items()}


def _last_line(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text  # drop "[time] file:line"


class GrammarState:
    """One request's matcher. `start_mask` fills the next token's bitmask on a worker; `allowed` waits for it."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size = compiled.tokenizer_info.vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32, 1 bit per token
        self._pending: Future | None = None
        self._shifts = torch.arange(32, dtype=torch.int32)

    def start_mask(self, worker: Executor) -> None:
        if self._pending is None and not self.matcher.is_terminated():
            self._pending = worker.submit(self.matcher.fill_next_token_bitmask, self._bitmask)

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar accepts next."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        else:
            self.matcher.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask.view(-1, 1) >> self._shifts) & 1  # [words, 32]: bit j of word w is token 32w + j
        return bits.view(-1)[: self.vocab_size].bool()

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):  # only if the mask was not applied: a bug, fail the request
            raise RuntimeError(f"the grammar refused token {token} that its own mask allowed")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class GrammarService:
    """An engine's grammar side: the compiler for its tokenizer (made on first use, under a lock: the server's
    tokenize worker calls it) and the one worker thread that fills constrained rows' token masks during a forward."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids) -> None:
        self._args = (tokenizer, vocab_size, eos_ids)
        self._compiler: GrammarCompiler | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def compiler(self) -> "GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler

    def start_masks(self, plan) -> None:
        """Constrained rows that sample this step (a scheduler.StepPlan's decode rows, and prompt chunks that end
        their prompt): fill their token masks on the worker while the forward runs."""
        rows = [r for r in plan.decode if r.grammar is not None]
        rows += [r for r, n in plan.prefill if r.grammar is not None and not r.resumes
                 and r.prefilled + n >= len(r.prefill_ids)]
        if not rows:
            return
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oval-edge-grammar")
        for request in rows:
            request.grammar.start_mask(self._worker)
