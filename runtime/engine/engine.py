"""The engine: admission by pages (scheduler.py), one forward per step over decode rows and prompt chunks,
sampling (nano-vllm's schedule -> run -> postprocess).

Thread safety: `submit`, `cancel` and `step` take one lock, so an HTTP thread may submit or cancel while the
engine thread steps; a cancel lands between steps and frees the request's pages at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import torch

from oval_edge.config import OvalConfig
from oval_edge.kv.store.page_file import StoreError
from oval_edge.kv.pool import PagePool
from oval_edge.runtime.model.heap import release_heap
from oval_edge.sparse.reuse import ReuseInput, SelectionReuse
from oval_edge.runtime.model.loader import LoadedModel, load_model
from oval_edge.runtime.model.tokenizer import encode_chat, eos_token_ids

from .forward.paged_llama import PagedLlama
from .forward.step_policy import StepPolicy, WindowModuleInput
from .forward.step_rows import PrefillRows, StaticDecodeRows
from .grammar import GrammarService
from .request import FINISHED, RUNNING, WAITING, QueueFull, Request, RequestRejected
from .sampling import SamplingParams, choose_batch
from .scheduler import Scheduler, StepPlan
from .setup import EngineConfig, build_pool, describe_decode_step, resolve_oval_from, uses_cuda_graphs
from .forward.static_step import StaticDecoder
from .stats import EngineStats


class Engine:
    def __init__(self, loaded: LoadedModel, oval: OvalConfig | None = None, config: EngineConfig | None = None):
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.chat_template: str | None = None  # `serve --chat-template`: replaces the tokenizer's own template
        model_len = loaded.config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        # no coarse records it could never use; the page store scores flat (its recalls know no coarse records yet)
        self.oval = (oval or OvalConfig()).for_context(0 if self.config.kv_store else self.max_model_len)
        self.pool: PagePool = build_pool(loaded, self.oval, self.config, self.max_model_len)
        self.runner = PagedLlama(loaded.model, self.pool, self.oval, attention=self.config.attention,
                                 context=min(self.pool.capacity_tokens, self.max_model_len))  # = token_limit()
        policy = StepPolicy()
        self.reuse = None  # selection reuse ([R-reuse], oval_edge/sparse/reuse.py): the step's scorer when asked
        if self.oval.reuse_tau is not None:
            if self.runner.softcap:
                raise ValueError("selection reuse (reuse_tau) does not support soft-capped attention (Gemma 2); "
                                 "leave reuse_tau unset")
            r = self.runner
            self.reuse = ReuseInput(SelectionReuse.for_model(self.oval, len(r.layers), r.num_heads, r.kv_heads,
                                                             r.head_dim, self.pool.device), self.pool, self.oval,
                                    r.scale)
            policy = StepPolicy(scores=self.reuse.scores, selected=self.reuse.selected, begin=self.reuse.begin)
        if self.oval.window_module:  # the calibrated output-aware window module (oval-edge calibrate): a step input
            from oval_edge.sparse.window_module import window_hook

            policy = dataclasses.replace(policy, window=WindowModuleInput(
                window_hook(self.oval, loaded.config, loaded.name, loaded.device)))
        # The static decode step (static_step.py), sized for the longest sequence this engine admits: the one decode
        # path. decode_step="eager" runs it uncaptured and uncompiled; a page store runs it eager (its recalls are
        # decided per layer on the host: store/tier.py).
        compiled = "inductor" if self.config.decode_step == "compiled" else None
        self.static = StaticDecoder(self.runner, self.config.max_batch, self.token_limit(), compiled, policy)
        # Below `oval_from` tokens a step attends densely (the same static step, attention="dense"): there OVAL's
        # scoring costs more than the pages it skips (runtime/engine/crossover.py, measured by `oval-edge profile`)
        # (not with a page store: a dense step would read every stored page back from the drive at every step)
        self.oval_from = 0 if self.config.attention == "dense" or self.pool.store is not None else \
            resolve_oval_from(self.config, loaded.device)
        self.dense_static = StaticDecoder(self.runner, self.config.max_batch, min(self.oval_from, self.token_limit()),
                                          compiled, StepPolicy(attention="dense")) \
            if self.oval_from > 0 else None
        if uses_cuda_graphs(self.config, loaded.device) and policy.graph_safe() and self.pool.store is None:
            from .forward.cuda_graph import CudaGraphs

            for decoder in (self.static, self.dense_static):  # now, while every page is free (cuda_graph.py)
                if decoder is not None:
                    decoder.capture(CudaGraphs(loaded.device))
        self.next_decode_trace = None  # a dispatch mode to run the next decode step under (bench's op count)
        self.tokenizer = loaded.tokenizer  # after the pool: it may still be loading (load_model's background load)
        self.eos_ids = eos_token_ids(self.tokenizer, loaded.model)
        self.stats = EngineStats(pages_total=self.pool.num_pages)
        # Requests that fit the token budget are attended densely at every step: their pages need no summaries.
        # Below oval_from they run the dense step too: a request that never reaches it seals no summaries unless it
        # shares an OVAL step with a longer row (_decoder_for scores it then: PagePool.score).
        scored_above = None if self.config.attention == "dense" else max(self.oval.token_budget, self.oval_from - 1)
        self.scheduler = Scheduler(self.pool, self.config.max_batch, self.config.max_queue, scored_above)
        self._lock = threading.RLock()
        # JSON-schema grammars (grammar.py): compiler built on first use; a worker fills masks while a step runs.
        self.grammar = GrammarService(self.tokenizer, loaded.config.vocab_size, self.eos_ids)

    @classmethod
    def load(cls, model: str | None = "default", quant: str = "auto", device: str | None = "auto",
             oval: OvalConfig | None = None, config: EngineConfig | None = None, dtype: str = "auto") -> "Engine":
        return cls(load_model(model, quant, device, dtype, tokenizer_in_background=True), oval, config)

    # ---- admission -----------------------------------------------------------------------------------------
    def describe_decode_step(self) -> str:
        """Which decode step runs, for serve's startup report and bench's labels."""
        return describe_decode_step(self)

    def describe_step_ops(self) -> str:
        """The decode step's op bodies, resolved once (oval_edge/sparse/step_ops_table.py), for the startup report."""
        return self.static.step_for(1).ops.describe()

    def token_limit(self) -> int:
        """Longest prompt + max_tokens one request may ever have: the pool's and the model's limit."""
        return min(self.pool.capacity_tokens, self.max_model_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str = "",
               on_token=None, on_finish=None, follows: Request | None = None) -> Request:
        """Queue a request. Raises RequestRejected if it can never fit, QueueFull if the queue is at its bound.
        follows: another choice of the same prompt (n > 1), whose prefill this one waits for to share its pages."""
        if not prompt_ids:
            raise RequestRejected("the prompt is empty; send at least one token of text")
        request = Request(list(prompt_ids), params, self.tokenizer, request_id, on_token, on_finish, follows=follows)
        limit = self.token_limit()
        if request.reserved_tokens > limit:
            self.stats.refused += 1
            raise RequestRejected(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {request.reserved_tokens} "
                f"tokens exceeds this server's limit of {limit} tokens{self.pool.capacity_note()}; shorten the prompt or lower max_tokens"
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

    def grammars(self):
        """The JSON-schema compiler for this model's tokenizer (runtime/engine/grammar.py), made on first use;
        the server calls it on its tokenize worker, never on the engine thread."""
        return self.grammar.compiler()

    # ---- one engine step -----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Admit what fits, then one forward over every running row's next token and prompt chunks under the
        step's token budget (scheduler.py); returns requests that finished."""
        with self._lock:
            self.scheduler.admit()
            plan = self.scheduler.schedule(self.config.step_tokens, self.config.prefill_chunk)
            self.stats.preemptions += len(plan.preempted)
            for request, why in plan.failed:
                self._end(request, "error", why)
                self.stats.errors += 1
            finished = self._guarded(self._run, plan) if plan else []
            self.scheduler.sweep()
            self._refresh_stats()
            return finished

    def _refresh_stats(self) -> None:
        # Also called by submit and cancel, so /metrics is right between steps, not only after the next one.
        self.stats.running = self.scheduler.num_unfinished
        self.stats.waiting = len(self.scheduler.waiting)
        self.stats.pages_used = self.pool.num_used

    def _guarded(self, work, plan: StepPlan) -> list[Request]:
        """Run a step; if it raises, fail just its requests (pages freed) and keep serving the rest. A page store
        error fails only the request whose page it was: the step committed nothing, the others run it again."""
        try:
            return work(plan)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the server down
            requests = plan.decode + [r for r, _ in plan.prefill]
            message = f"{type(exc).__name__}: {exc}"
            owner = [r for r in requests if r.request_id == getattr(exc, "seq_id", None)]
            if isinstance(exc, StoreError) and owner:
                requests, message = owner, f"the KV page store failed: {exc}"
            for request in requests:
                self._end(request, "error", message)
            self.stats.errors += 1
            return requests

    def _run(self, plan: StepPlan) -> list[Request]:
        """One forward for the whole plan (forward/step_rows.py): decode rows through the static step's attention (the
        eager decode while a hook is installed), prompt chunks through dense prefill attention, every projection once
        over all the step's tokens. A step without chunks is the static step itself (compiled or captured when so
        configured). With CUDA graphs the decode rows replay their graph and the chunks run in a second forward
        right after it: a graph has fixed shapes, a chunk's do not."""
        began = time.perf_counter()
        groups, seq_ids, lengths = [], [], []
        decode_logits = read = None
        trace, self.next_decode_trace = (self.next_decode_trace, None) if plan.decode else (None, None)
        self.grammar.start_masks(plan)
        decoder = self._decoder_for(plan.decode) if plan.decode else None
        if plan.decode:
            group = self._decode_rows(plan.decode, bool(plan.prefill), decoder)
            if group is None:  # the static step alone: replayed from its graph, compiled, or run eager
                decode_logits, read, after = decoder.decode(*self._decode_inputs(plan.decode), trace)
                seq_ids, lengths, trace = [r.request_id for r in plan.decode], after, None
            else:
                groups.append(group)
        if plan.prefill:
            ids = []
            for request, n in plan.prefill:
                chunk = request.prefill_ids[request.prefilled : request.prefilled + n]
                self.pool.record_tokens(request.request_id, chunk)  # names the pages it seals (prefix caching)
                ids.extend(chunk)
            step = self.pool.prepare([r.request_id for r, _ in plan.prefill], [n for _, n in plan.prefill])
            groups.append(PrefillRows(self.runner, step, torch.tensor(ids, dtype=torch.long)))
        with trace if trace is not None else contextlib.nullcontext():
            outputs = self.runner.forward_rows(groups) if groups else []
        for group in groups:
            seq_ids += group.seq_ids
            lengths += group.lengths_list
        if groups and groups[0].decode:
            decode_logits, read = outputs[0], decoder.read_stats(groups[0].step, groups[0].stats_vector())
        self.pool.advance(seq_ids, lengths)  # one batch of sealing for the whole step
        if self.pool.device.type == "cpu" and plan.prefill:
            release_heap()  # a chunk's transients (tens of MB at 8k) would stay mapped and fragment the heap
        elapsed = time.perf_counter() - began
        finished = []
        if plan.decode:
            for request in plan.decode:
                request.decode_seconds += elapsed
                request.decode_steps += 1
            self.stats.record_decode(len(plan.decode), elapsed, read, self.pool.geometry)
            finished += self._postprocess(plan.decode, decode_logits)
        if plan.prefill:
            self.stats.mixed_steps += bool(plan.decode)
            finished += self._prefilled(plan.prefill, outputs[-1], elapsed)
        return finished

    def _decode_inputs(self, requests: list[Request]) -> tuple[list, list[int]]:
        """Row ids and each row's next input token (its last output), recorded for the pages they seal."""
        seq_ids, tokens = [r.request_id for r in requests], [r.output_ids[-1] for r in requests]
        for seq_id, token in zip(seq_ids, tokens):
            self.pool.record_tokens(seq_id, (token,))
        return seq_ids, tokens

    def _decoder_for(self, requests: list[Request]) -> StaticDecoder:
        """The dense step while every row is shorter than oval_from tokens (after this step's token), else OVAL's,
        whose rows past the token budget select pages: one allocated unscored gets its pages' summaries now."""
        if self.config.attention == "dense":  # nothing is ever scored
            return self.static
        if self.dense_static is not None and all(self.pool.length(r.request_id) + 1 < self.oval_from
                                                 for r in requests):
            return self.dense_static
        budget = self.oval.token_budget
        for request in requests:
            if self.pool.length(request.request_id) + 1 > budget:
                self.pool.score(request.request_id)
        return self.static

    def _decode_rows(self, requests: list[Request], mixed: bool, decoder: StaticDecoder):
        """The decode rows' group for the step's forward, or None when the static step runs them alone: always
        without prompt chunks (its compiled or captured form), and beside them when it replays a CUDA graph."""
        if not mixed or decoder.graphs is not None:
            return None
        seq_ids, tokens = self._decode_inputs(requests)
        return StaticDecodeRows(decoder.load(seq_ids, tokens), seq_ids)

    def _prefilled(self, chunks: list[tuple[Request, int]], logits: torch.Tensor, elapsed: float) -> list[Request]:
        """After a step's prompt chunks: requests whose prompt is complete start running (their first token comes
        from these logits), or resume their output after a preemption (the next decode feeds their last token)."""
        done, rows = [], []
        share = elapsed / sum(n for _, n in chunks)
        for row, (request, n) in enumerate(chunks):
            request.prefilled += n
            request.prefill_seconds += share * n
            self.stats.prompt_tokens += n
            if request.prefilled < len(request.prefill_ids):
                continue
            request.status = RUNNING
            if not request.resumes:
                done.append(request)
                rows.append(row)
        return self._postprocess(done, logits[rows]) if done else []

    def _postprocess(self, requests: list[Request], logits: torch.Tensor) -> list[Request]:
        finished = []  # every row's token is chosen at once on the device, with one read back (choose_batch)
        for request, sample in zip(requests, choose_batch([r.sample_row() for r in requests], logits)):
            if request.finished:  # cancelled from a callback during this step: its sample is dropped
                continue
            token = request.take(sample)
            self.stats.generated_tokens += 1
            if request.emit(token, self.eos_ids):
                self._end(request, request.finish_reason)
                finished.append(request)
        return finished

    def _end(self, request: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.remove(request)
        self.pool.free(request.request_id)
        if self.reuse is not None:  # its selections must not outlive it (oval_edge/sparse/reuse.py)
            self.reuse.drop(request.request_id)
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

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat template (`chat_template`, else the model's own), tools rendered, the assistant turn opened."""
        return encode_chat(self.tokenizer, messages, tools, self.chat_template)


__all__ = ["Engine", "EngineConfig", "Request", "RequestRejected", "QueueFull", "SamplingParams", "FINISHED",
           "WAITING"]
