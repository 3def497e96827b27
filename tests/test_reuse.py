"""Selection reuse ([R-reuse], issue 10 part 3): a row whose queries barely moved keeps a recent selection.

The synthetic tests drive `ReuseInput` (the static step's scorer and selection inputs) over a real page pool
(tests/oval_reference.py helpers) and compare each step with `decode_attention` scoring afresh on the same step. The model tests use a tiny random
Llama: reuse that never hits must leave the logits bitwise unchanged, and the engine must drop a request's state
and export the counts on /metrics.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM
from oval_reference import make_pool, prefill, structured_kv, write_tokens

from oval_edge import OvalConfig
from oval_edge.runtime.engine.forward.paged_llama import PagedLlama
from oval_edge.runtime.model.loader import LoadedModel
from oval_edge.sparse.attention import attend_selection, decode_attention, decode_plan
from oval_edge.sparse.reuse import ReuseInput, SelectionReuse
from oval_edge.sparse.scoring import group_queries

LAYERS, KV_HEADS, Q_HEADS, DIM, P = 2, 3, 9, 64, 16
LAYER = 1
SCALE = DIM**-0.5
# Reuse takes a fixed window (ReuseInput refuses a range: a reused selection keeps the config's window).
CONFIG = OvalConfig(page_size=P, top_k=3, sink_pages=1, window_min=48, window_max=48, kv_dtype="float32")


class Seqs:
    """Sequences prefilled into a pool; `step(qs)` decodes one more token of every row (uncommitted until done)."""

    def __init__(self, lengths: list[int], steps: int = 8, seed: int = 7):
        gen = torch.Generator().manual_seed(seed)
        data = [structured_kv(gen, LAYERS, KV_HEADS, n + steps, DIM) for n in lengths]
        self.keys, self.values = [k for k, _ in data], [v for _, v in data]
        self.ids = [f"seq{i}" for i in range(len(lengths))]
        pages = sum(-(-(n + steps) // P) for n in lengths)
        self.pool = make_pool(LAYERS, KV_HEADS, DIM, P, num_pages=pages)
        prefill(self.pool, self.ids, self.keys, self.values, lengths, chunk=512)
        self.gen = gen

    def query(self, rows: int) -> torch.Tensor:
        return torch.randn(rows, Q_HEADS, DIM, generator=self.gen) * 1.5

    def step(self, reuse: SelectionReuse, q: torch.Tensor, config: OvalConfig = CONFIG):
        """(reuse output, its selection, fresh output, fresh selection) of one decode step, then commit it."""
        step = write_tokens(self.pool, self.ids, self.keys, self.values, [1] * len(self.ids))
        plan = decode_plan(self.pool, step, config)
        inputs = ReuseInput(reuse, self.pool, config, SCALE)  # what the static step calls, in its order
        inputs.begin(step.seq_ids, step.lengths_list)
        sel = plan.select(inputs.scores(LAYER, group_queries(q, KV_HEADS), step.page_table, step.sealed,
                                        step.lengths))
        inputs.selected(LAYER, q, sel)
        out = attend_selection(self.pool, LAYER, q, sel, SCALE)
        fresh, fresh_sel = decode_attention(self.pool, LAYER, step, q, config, SCALE, plan=plan)
        self.pool.commit(step)
        return out, sel, fresh, fresh_sel


def make_reuse(tau: float, entries: int = 8, config: OvalConfig = CONFIG) -> SelectionReuse:
    return SelectionReuse(tau, entries, LAYERS, KV_HEADS, Q_HEADS // KV_HEADS * DIM, config.top_k)


def page_sets(sel, row: int) -> list[set[int]]:
    return [{int(p) for p in sel.pages[row, h] if p >= 0} for h in range(KV_HEADS)]


def test_identical_query_hits_and_equals_a_fresh_selection():
    seqs = Seqs([601])  # 601 -> 606 tokens: no page is sealed, no candidate appears, between the steps
    reuse = make_reuse(tau=1.0)  # the strictest threshold: only an unchanged query may reuse
    q = seqs.query(1)
    _, first, _, _ = seqs.step(reuse, q)
    assert (reuse.counts.lookups, reuse.counts.hits) == (1, 0)  # nothing to reuse yet: scored and stored
    for _ in range(3):
        out, sel, fresh, fresh_sel = seqs.step(reuse, q)
        assert page_sets(sel, 0) == page_sets(first, 0) == page_sets(fresh_sel, 0)
        assert torch.equal(sel.window, fresh_sel.window)
        assert torch.equal(sel.valid.sum(-1), fresh_sel.valid.sum(-1))
        torch.testing.assert_close(out, fresh, atol=1e-6, rtol=0)  # same slots, maybe in another page order
    assert (reuse.counts.lookups, reuse.counts.hits) == (4, 3)
    assert (reuse.counts.head_lookups, reuse.counts.head_hits) == (4 * KV_HEADS, 3 * KV_HEADS)


def test_moved_query_misses_and_is_scored_afresh():
    seqs = Seqs([700])
    reuse = make_reuse(tau=0.9)
    q = seqs.query(1)
    seqs.step(reuse, q)
    moved = q.clone()
    moved[:, 0] = -moved[:, 0]  # one query head of KV head 0 flipped: that group's cosine drops well below 0.9
    out, sel, fresh, fresh_sel = seqs.step(reuse, moved)
    assert reuse.counts.hits == 0 and reuse.counts.head_hits == KV_HEADS - 1  # heads 1, 2 matched; not enough
    assert torch.equal(sel.pages, fresh_sel.pages) and torch.equal(out, fresh)  # a miss is the fresh selection
    # A query close to the stored one (cosine > 0.99) hits.
    near = moved + 0.01 * torch.randn(moved.shape, generator=seqs.gen)
    seqs.step(reuse, near)
    assert reuse.counts.hits == 1


def test_a_batch_mixes_hit_and_scored_rows():
    seqs = Seqs([650, 1000, 60])  # the third row fits the token budget: dense, never looked up
    reuse = make_reuse(tau=0.95)
    q = seqs.query(3)
    _, first, _, _ = seqs.step(reuse, q)
    q2 = q.clone()
    q2[1] = seqs.query(1)[0]  # row 1 moved, row 0 did not
    out, sel, fresh, fresh_sel = seqs.step(reuse, q2)
    assert (reuse.counts.lookups, reuse.counts.hits) == (4, 1)  # 2 sparse rows x 2 steps; row 0 reused
    assert page_sets(sel, 0) == page_sets(first, 0)
    assert torch.equal(sel.pages[1], fresh_sel.pages[1])  # the moved row was scored: its own fresh pages
    torch.testing.assert_close(out, fresh, atol=1e-6, rtol=0)  # row 0's query did not move: same pages anyway
    assert not bool(sel.sparse_rows[2]) and (sel.pages[2] == -1).all()
    assert sorted(reuse.sequences) == sorted(seqs.ids)


def test_lru_keeps_the_most_recently_used_selections():
    """Two entries: reusing A makes B the least recent, so a third query C evicts B and A still hits."""
    layers, heads, dim, k = 1, 2, 8, 2
    reuse = SelectionReuse(0.99, 2, layers, heads, dim, k)
    gen = torch.Generator().manual_seed(3)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen))
    queries = {name: basis[i].repeat(heads, 1).reshape(1, heads, dim) for i, name in enumerate("ABC")}
    picks = {"A": [1, 2], "B": [3, 4], "C": [2, 5]}
    sparse = torch.zeros(1, dtype=torch.bool)  # dense_rows: the row selects pages
    seen = []
    for length, name in enumerate("ABACAB", start=10):
        reuse.bind(object(), ["s"], [length], sparse)
        found = reuse.lookup(0, queries[name])
        seen.append((name, found.hit_rows == [0]))
        if found.hit_rows:
            assert reuse.cached(found)[0][0].tolist() == [picks[name]] * heads  # the pages stored with that query
        reuse.record(found, torch.tensor([[picks[name]] * heads]), None)
    assert seen == [("A", False), ("B", False), ("A", True), ("C", False), ("A", True), ("B", False)]
    # An entry with fewer than k pages (chosen while fewer candidates existed) is never reused.
    for length, pages in ((16, [[6, -1]] * heads), (17, [[6, 7]] * heads)):
        reuse.bind(object(), ["s"], [length], sparse)
        found = reuse.lookup(0, basis[3].repeat(heads, 1)[None] * 2)  # a new query D, twice (scale is ignored)
        assert found.hit_rows == []
        reuse.record(found, torch.tensor([pages]), None)
    # Short rows (dense) neither look up nor count.
    reuse.bind(object(), ["s"], [18], torch.ones(1, dtype=torch.bool))
    before = reuse.counts.lookups
    assert reuse.lookup(0, queries["A"]).hit_rows == [] and reuse.counts.lookups == before


def test_state_is_dropped_with_its_sequence_and_never_crosses_sequences():
    reuse = SelectionReuse(0.5, 4, 1, 1, 4, 1)
    q = torch.ones(1, 1, 4)
    sparse = torch.zeros(1, dtype=torch.bool)

    def look(seq, length, owns=None):
        reuse.bind(object(), [seq], [length], sparse, owns)
        found = reuse.lookup(0, q)
        reuse.record(found, torch.tensor([[[1]]]), None)
        return bool(found.hit_rows)

    assert [look("a", 5), look("a", 6)] == [False, True]
    reuse.drop("a")
    assert reuse.sequences == [] and look("a", 7) is False  # dropped: a new "a" starts empty
    assert look("b", 40) is False  # another sequence never sees "a"'s selections
    assert look("a", 3) is False  # "a" again, but not at its next length: a new sequence under an old id
    look("c", 9, owns=lambda s: s != "b")  # the pool no longer owns "b": its slot is freed here
    assert sorted(reuse.sequences) == ["a", "c"]
    assert len(reuse._free) + len(reuse.sequences) == reuse.stamp.shape[1]  # freed slots are reused


# ---- with a model ------------------------------------------------------------------------------------------------

class _Tokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def tiny_loaded() -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    return LoadedModel(LlamaForCausalLM(config).eval(), _Tokenizer(), None, "none", torch.device("cpu"),
                       torch.float32, 0, 0.0)


TINY = dict(page_size=16, top_k=1, window_min=16, window_max=16, dense_layers=1, kv_dtype="float32")


def _decode_logits(loaded, config: OvalConfig, prompt: list[int], steps: int):
    """Greedy decode through the static step, with selection reuse as its inputs when the config asks."""
    from oval_edge.runtime.engine.forward.step_policy import StepPolicy
    from oval_edge.runtime.engine.setup import EngineConfig, build_pool

    pool = build_pool(loaded, config, EngineConfig(num_pages=16), 1024)
    runner = PagedLlama(loaded.model, pool, config)
    reuse = None
    if config.reuse_tau is not None:
        state = SelectionReuse.for_model(config, len(runner.layers), runner.num_heads, runner.kv_heads,
                                         runner.head_dim, pool.device)
        reuse = ReuseInput(state, pool, config, runner.scale)
    policy = StepPolicy() if reuse is None else StepPolicy(scores=reuse.scores, selected=reuse.selected,
                                                           begin=reuse.begin)
    decoder = runner.static_decoder(policy, rows=1)
    pool.allocate("s", len(prompt) + steps)
    step = pool.prepare(["s"], [len(prompt)])
    logits, _ = runner.forward(step, torch.tensor(prompt), decode=False)
    pool.commit(step)
    out = []
    for _ in range(steps):
        logits, _, lengths = decoder.decode(["s"], [int(logits[0].argmax())])
        pool.advance(["s"], lengths)
        out.append(logits)
    return torch.cat(out), reuse


def test_reuse_that_never_hits_changes_no_logit():
    loaded = tiny_loaded()
    prompt = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    off, runner_off = _decode_logits(loaded, OvalConfig(**TINY), prompt, 12)
    on, runner_on = _decode_logits(loaded, OvalConfig(**TINY, reuse_tau=1.0), prompt, 12)
    assert runner_off is None
    counts = runner_on.counts
    assert counts.lookups == 12 * 2 and counts.hits == 0  # 2 sparse layers x 12 steps, every query moved
    assert torch.equal(on, off)  # bitwise: a miss takes exactly the path reuse-off takes


def test_engine_drops_finished_requests_and_exports_the_counts():
    from oval_edge.runtime.engine.engine import Engine, EngineConfig
    from oval_edge.runtime.engine.sampling import SamplingParams
    from oval_edge.runtime.server.metrics import ServerMetrics

    loaded = tiny_loaded()
    engine = Engine(loaded, OvalConfig(**TINY, reuse_tau=0.05), EngineConfig(max_batch=2, num_pages=32, oval_from=0))
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    requests = [engine.submit(torch.randint(0, 128, (n,), generator=gen).tolist(), params) for n in (70, 120)]
    while engine.has_work():
        engine.step()
    assert all(r.finish_reason == "length" for r in requests)
    reuse = engine.reuse.state
    assert reuse.sequences == [] and engine.pool.num_used == 0  # state dropped with the pages
    assert reuse.counts.hits > 0 and reuse.counts.lookups > reuse.counts.hits

    text = ServerMetrics(lambda: ("ready", engine)).render()[0].decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["oval_edge_selection_reuse_tau"] == 0.05
    assert samples["oval_edge_selection_reuse_lookups_total"] == reuse.counts.lookups
    assert samples["oval_edge_selection_reuse_hits_total"] == reuse.counts.hits
    assert samples["oval_edge_selection_reuse_head_hits_total"] == reuse.counts.head_hits
    off = Engine(loaded, OvalConfig(**TINY), EngineConfig(max_batch=1, num_pages=8))
    text = ServerMetrics(lambda: ("ready", off)).render()[0].decode()
    assert "oval_edge_selection_reuse_hits_total 0.0" in text and "oval_edge_selection_reuse_tau 0.0" in text


@pytest.mark.parametrize("value,message", [(0, r"reuse_slots=0 is out of range"), (True, r"must be an integer")])
def test_reuse_slots_is_validated(value, message):
    with pytest.raises(ValueError, match=message):
        OvalConfig(reuse_tau=0.9, reuse_slots=value)



def test_eval_reuse_rows_report_hit_rates_and_equal_oval_when_nothing_hits():
    from oval_edge.tools.eval.fidelity import run_fidelity
    from oval_edge.tools.eval.policies import build_policies
    from oval_edge.tools.eval.report import fidelity_records, fidelity_table

    loaded = tiny_loaded()
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    policies = build_policies(["oval"], [1], [0.5], reuse_taus=[1.0, 0.05])
    assert [p.label for p in policies] == ["dense", "oval eta=0.5 k=1", "oval eta=0.5 reuse τ=1 k=1",
                                           "oval eta=0.5 reuse τ=0.05 k=1"]
    rows = run_fidelity(loaded, ids, 150, OvalConfig(**TINY), policies, [16], show_progress=False)
    plain, strict, loose = rows[1], rows[2], rows[3]
    assert plain.reuse is None and strict.reuse["lookups"] == 50 * 2  # 50 steps x 2 sparse layers
    assert strict.reuse["hit_rate"] == 0.0 and strict.kl == plain.kl and strict.top1 == plain.top1
    assert loose.reuse["hit_rate"] > 0.3 and loose.kl != plain.kl  # reused pages change the output
    records = fidelity_records(rows)
    assert records[3]["reuse_tau"] == 0.05 and records[3]["reuse_hit_rate"] == loose.reuse["hit_rate"]
    table = fidelity_table(records)
    assert "reused" in table.splitlines()[0] and "oval reuse τ=0.05" in table


def test_eval_command_rejects_bad_reuse_values():
    from oval_edge.cli import main

    assert main(["eval", "--reuse-tau", "0,0.9"]) == 2
    assert main(["eval", "--reuse-tau", "0.9", "--policies", "quest"]) == 2


def test_bench_adds_the_reuse_engine_next_to_oval():
    import argparse

    from oval_edge.tools.bench import command as bench_command
    from oval_edge.tools.bench.runner import job_spec
    from oval_edge.tools.bench.settings import BenchSettings

    parser = argparse.ArgumentParser()
    bench_command.add_arguments(parser)
    settings = bench_command.build_settings(parser.parse_args(["--reuse-tau", "0.9,0.95", "--contexts", "512"]))
    assert settings.engines == ("oval", "oval+reuse@0.9", "oval+reuse@0.95", "dense")
    job = job_spec(settings, "oval+reuse@0.95", 512, 0, [1, 2], 10)
    assert job["reuse_tau"] == 0.95 and job_spec(settings, "oval", 512, 0, [1, 2], 10)["reuse_tau"] is None
    with pytest.raises(ValueError, match=r"--reuse-tau='0.9,1.5': \[1.5\] out of range; allowed \(0, 1\]"):
        bench_command.build_settings(parser.parse_args(["--reuse-tau", "0.9,1.5"]))
    with pytest.raises(ValueError, match=r"the reuse cosine must be in \(0, 1\]"):
        BenchSettings(contexts=(512,), engines=("oval", "oval+reuse@0"))


def test_config_file_turns_reuse_on(tmp_path):
    from oval_edge.runtime.config_file import load_config_file, oval_config

    path = tmp_path / "oval-edge.toml"
    path.write_text("[oval]\nreuse_tau = 0.95\nreuse_slots = 4\n")
    config = oval_config(load_config_file(str(path)))
    assert (config.reuse_tau, config.reuse_slots) == (0.95, 4)
    path.write_text("[oval]\nreuse_slots = 100\n")
    with pytest.raises(ValueError, match=r"reuse_slots=100 is out of range: allowed \[1, 64\]"):
        oval_config(load_config_file(str(path)))
