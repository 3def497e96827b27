"""Issue #51, the GPU step's sampling: every row of a step is chosen on the device and the tokens come back to the
host in one copy, whatever the batch (runtime/engine/sampling.choose_batch).

On CUDA each read of a device value (int(tensor), .item(), .tolist(), .cpu()) waits for the device; the sampler
took one per row. No GPU is needed to count them: a TorchFunctionMode sees every such Python-level read and a
TorchDispatchMode every `_local_scalar_dense` (the op behind a scalar read), on CPU tensors as on CUDA ones.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from oval_edge.runtime.engine.sampling import RowSampler, SampleRow, SamplingParams, choose_batch

VOCAB = 500
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__index__}
# every kind of row a step may hold: greedy, sampled with each filter, penalised, biased, with logprobs, masked
ROW_PARAMS = [dict(), dict(temperature=0.8, top_p=0.9, top_k=40), dict(temperature=1.2, min_p=0.05),
              dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, logit_bias={7: 5.0}),
              dict(logprobs=3), dict(temperature=0.7, logprobs=5, top_p=0.5, min_p=0.1), dict(temperature=1.0),
              dict(frequency_penalty=1.0, temperature=0.9, top_k=5)]


class HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python (`python`) and scalar reads dispatched below them (`scalar`)."""

    def __init__(self) -> None:
        super().__init__()
        self.python, self.where = 0, []
        self._scalars = _ScalarReads()

    def __enter__(self):
        self._scalars.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._scalars.__exit__(*exc)

    @property
    def scalar(self) -> int:
        return self._scalars.count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.python += 1
            self.where.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _ScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _rows(batch: int, seed: int = 0) -> list[SampleRow]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(batch):
        params = SamplingParams(seed=100 + i, **ROW_PARAMS[i % len(ROW_PARAMS)])
        history = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
        allowed = (torch.rand(VOCAB, generator=gen) < 0.5) if i == 4 else None  # one row under a grammar's mask
        rows.append(SampleRow(RowSampler(params), history[:6], history[6:], allowed))
    return rows


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_a_step_reads_the_device_once_whatever_the_batch(batch):
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(batch)) * 3
    rows = _rows(batch)
    with HostReads() as reads:
        samples = choose_batch(rows, logits)
    assert len(samples) == batch
    assert (reads.python, reads.scalar) == (1, 0), f"host reads in one step: {reads.where}, {reads.scalar} scalar"


def test_each_row_gets_the_token_it_gets_alone_so_a_seed_reproduces_in_any_batch():
    """Batching changes where a row is chosen, not what: each row's sample equals choosing that row by itself
    (its own generator, its own filters and penalties), logprobs included."""
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    together = choose_batch(_rows(8), logits)
    alone = [choose_batch([row], logits[i:i + 1])[0] for i, row in enumerate(_rows(8))]
    assert together == alone
    assert len({s.token for s in together}) > 1


def test_greedy_rows_take_the_argmax_of_the_processed_logits():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    rows = [SampleRow(RowSampler(SamplingParams()))] * 3 + [SampleRow(RowSampler(SamplingParams(logit_bias={9: 100.0})))]
    tokens = [s.token for s in choose_batch(rows, logits.to(torch.bfloat16))]
    assert tokens[:3] == torch.argmax(logits.to(torch.bfloat16).float()[:3], dim=-1).tolist() and tokens[3] == 9
