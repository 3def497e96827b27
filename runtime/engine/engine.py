"""The engine: admission by pages (scheduler.py), chunked prefill, batched decode, sampling (nano-vllm's
schedule -> run -> postprocess).

Thread safety: `submit`, `cancel` and `step` take one lock, so an HTTP thread may submit or cancel while the
engine thread steps; a cancel lands between steps and frees the request's pages at once.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from oval_edge.config import OvalConfig
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.model.heap import release_heap
from oval_edge.runtime.model.loader import LoadedModel, load_model

from .paged_llama import PagedLlama
from .request import FINISHED, RUNNING, WAITING, QueueFull, Request, RequestRejected
from .sampling import SamplingParams
from .scheduler import Scheduler
from .setup import EngineConfig, build_pool, uses_cuda_graphs
from .static_step import StaticDecoder
from .stats import EngineStats


class Engine:
    def __init__(self, loaded: LoadedModel, oval: OvalConfig | None = None, config: EngineConfig | None = None):
        self.loaded = loaded
        self.oval = oval or OvalConfig()
        self.config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        model_len = loaded.config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        self.pool: PagePool = build_pool(loaded, self.oval, self.config, self.max_model_len)
        self.runner = PagedLlama(loaded.model, self.pool, self.oval, attention=self.config.attention)
        if self.oval.window_module:  # the calibrated output-aware window module (oval-edge calibrate)
            from oval_edge.sparse.window_module import window_hook

            self.runner.hooks.window = window_hook(self.oval, loaded.config, loaded.name, loaded.device)
        # The static decode step (static_step.py), sized for the longest sequence this engine admits.
        self.static = None if self.config.decode_step == "eager" else StaticDecoder(
            self.runner, self.config.max_batch, self.token_limit(),
            compile_backend="inductor" if self.config.decode_step == "compiled" else None)
        if self.static is not None and uses_cuda_graphs(self.config, loaded.device) and self.runner.hooks.empty():
            from .cuda_graph import CudaGraphs

            self.static.capture(CudaGraphs(loaded.device))  # now, while every page is free (cuda_graph.py)
        self.next_decode_trace = None  # a dispatch mode to run the next decode step under (bench's op count)
        self.eos_ids = _eos_ids(loaded)
        self.stats = EngineStats(pages_total=self.pool.num_pages)
        self.scheduler = Scheduler(self.pool, self.config.max_batch, self.config.max_queue)
        self._lock = threading.RLock()

    @classmethod
    def load(cls, model: str | None = "default", quant: str = "nf4", device: str | None = "auto",
             oval: OvalConfig | None = None, config: EngineConfig | None = None, dtype: str = "auto") -> "Engine":
        return cls(load_model(model, quant, device, dtype), oval, config)

    # ---- admission -----------------------------------------------------------------------------------------
    def describe_decode_step(self) -> str:
        """Which decode step runs, for serve's startup report and bench's labels."""
        if self.static is None:
            return "eager forward (shapes follow the context)"
        if not self.runner.hooks.empty():
            return "eager forward (a decode hook is installed: reuse, the window module or an eval policy)"
        if self.static.graphs is not None:
            return f"static step replayed from {self.static.graphs.explain()}"
        if self.config.decode_step == "compiled":
            return "static step through torch.compile (inductor), compiled per batch bucket on first use"
        return "static step, run eager" + (" (CUDA graphs off)" if self.loaded.device.type == "cuda" else "")

    def token_limit(self) -> int:
        """Longest prompt + max_tokens one request may ever have: the pool's and the model's limit."""
        return min(self.pool.capacity_tokens, self.max_model_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "",
               on_token=None, on_finish=None) -> Request:
        """Queue a request. Raises RequestRejected if it can never fit, QueueFull if the queue is at its bound."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty; send at least one token of text")
        request = Request(list(prompt_ids), params, self.tokenizer, request_id, on_token, on_finish)
        limit = self.token_limit()
        if request.reserved_tokens > limit:
            self.stats.refused += 1
            raise RequestRejected(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {request.reserved_tokens} "
                f"tokens exceeds this server's limit of {limit} tokens; shorten the prompt or lower max_tokens"
            )
        with self._lock:
            try:
                self.scheduler.enqueue(request)
            except QueueFull:
                self.stats.refused += 1
                raise
            self._refresh_stats()
        return request

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its pages; False if it is unknown or already finished."""
        with self._lock:
            for request in self.scheduler.requests():
                if request.request_id == request_id and not request.finished:
                    self._end(request, "cancelled")
                    self._refresh_stats()
                    return True
        return False

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one engine step -----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit what fits, run one prefill chunk and one batched decode; returns requests that finished."""
        with self._lock:
            finished: list[Request] = []
            self.scheduler.admit()
            prefilling = self.scheduler.prefilling()
            if prefilling:
                finished += self._guarded(self._prefill_chunk, [prefilling[0]])
            running = self.scheduler.running()
            if running:
                finished += self._guarded(self._decode, running)
            self.scheduler.sweep()
            self._refresh_stats()
            return finished

    def _refresh_stats(self) -> None:
        # Also called by submit and cancel, so /metrics is right between steps, not only after the next one.
        self.stats.running = self.scheduler.num_unfinished
        self.stats.waiting = len(self.scheduler.waiting)
        self.stats.pages_used = self.pool.num_used

    def _guarded(self, work, requests: list[Request]) -> list[Request]:
        """Run a step; if it raises, fail just these requests (pages freed) and keep serving the rest."""
        try:
            return work(requests)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the server down
            for request in requests:
                self._end(request, "error", f"{type(exc).__name__}: {exc}")
            self.stats.errors += 1
            return list(requests)

    def _prefill_chunk(self, requests: list[Request]) -> list[Request]:
        request = requests[0]
        start = request.prefilled
        chunk = request.prompt_ids[start : start + self.config.prefill_chunk]
        began = time.perf_counter()
        step = self.pool.prepare([request.request_id], [len(chunk)])
        logits, _ = self.runner.forward(step, torch.tensor(chunk, dtype=torch.long), decode=False)
        self.pool.record_tokens(request.request_id, chunk)  # names the pages it seals (prefix caching)
        self.pool.commit(step)
        if self.pool.device.type == "cpu":
            release_heap()  # a chunk's transients (tens of MB at 8k) would stay mapped and fragment the heap
        request.prefilled += len(chunk)
        request.prefill_seconds += time.perf_counter() - began
        self.stats.prompt_tokens += len(chunk)
        if request.prefilled < len(request.prompt_ids):
            return []
        request.status = RUNNING
        return self._postprocess([request], logits)

    def _decode(self, requests: list[Request]) -> list[Request]:
        began = time.perf_counter()
        trace, self.next_decode_trace = self.next_decode_trace, None
        seq_ids, tokens = [r.request_id for r in requests], [r.output_ids[-1] for r in requests]
        for seq_id, token in zip(seq_ids, tokens):
            self.pool.record_tokens(seq_id, (token,))
        if self.static is not None and self.runner.hooks.empty():
            logits, step_stats, lengths = self.static.decode(seq_ids, tokens, trace)
            self.pool.advance(seq_ids, lengths)
        else:  # the eager forward: a hook (reuse, the window module, eval policies) decides per layer in Python
            step = self.pool.prepare(seq_ids, [1] * len(requests))
            with trace if trace is not None else contextlib.nullcontext():
                logits, step_stats = self.runner.forward(step, torch.tensor(tokens, dtype=torch.long), decode=True)
            self.pool.commit(step)
        elapsed = time.perf_counter() - began
        for request in requests:
            request.decode_seconds += elapsed
            request.decode_steps += 1
        self.stats.record_decode(len(requests), elapsed, step_stats, self.pool.geometry)
        return self._postprocess(requests, logits)

    def _postprocess(self, requests: list[Request], logits: torch.Tensor) -> list[Request]:
        finished = []
        for row, request in enumerate(requests):
            if request.finished:  # cancelled from a callback during this step
                continue
            token = request.sampler.sample(logits[row])
            self.stats.generated_tokens += 1
            if request.emit(token, self.eos_ids):
                self._end(request, request.finish_reason)
                finished.append(request)
        return finished

    def _end(self, request: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.remove(request)
        self.pool.free(request.request_id)
        if self.runner.reuse is not None:  # its selections must not outlive it (oval_edge/sparse/reuse.py)
            self.runner.reuse.drop(request.request_id)
        self.stats.pages_used = self.pool.num_used
        if reason == "cancelled":
            self.stats.cancelled += 1
        request.finish(reason, error)

    # ---- convenience -----------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, on_token=None) -> Request:
        """Run one request to completion (the bench and tests use this; the server drives step() itself)."""
        request = self.submit(prompt_ids, params or SamplingParams(), on_token=on_token)
        while not request.finished:
            self.step()
        return request

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The model's own chat template, with the assistant turn opened."""
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids = set()
    for source in (loaded.tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids


__all__ = ["Engine", "EngineConfig", "Request", "RequestRejected", "QueueFull", "SamplingParams", "FINISHED",
           "WAITING"]
