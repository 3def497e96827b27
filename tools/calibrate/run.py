"""The calibration pipeline behind `oval-edge calibrate`, on a loaded model and a token list (no CLI, no files).

capture (dense prefill, hidden states, K/V) -> per sparse layer: window targets and page masses -> freeze the
scorer's (eta, r) -> fit the window module on the calibration split -> held-out report -> a calibrated module.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from oval_edge.config import DEFAULT_PREFILL_CHUNK, OvalConfig
from oval_edge.sparse.window_module import ModuleCard, OutputAwareModule

from .capture import capture, collect
from .fit import FitSettings, fit_module, fit_report, heldout_mask
from .scorer import ScorerFit, ScorerTally


@dataclass(frozen=True)
class CalibrationSettings:
    config: OvalConfig  # page size, top-k, sink pages, dense layers and the (fixed) window the scorer is fitted at
    window_range: tuple[int, int] = (16, 128)
    share: float = 0.9
    start: int = 256
    stride: int = 2
    scorer_stride: int = 8
    etas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    ranks: tuple[int, ...] = (2, 4, 8)
    rank_tolerance: float = 0.02
    records: tuple[str, ...] = ("float", "int8", "int4")  # stored formats each (eta, r) is scored through
    record_tolerance: float = 0.02
    width: int = 16
    bins: int = 8
    fit: FitSettings = field(default_factory=FitSettings)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    text: str = ""  # where the calibration text came from (recorded in the module's card)


@dataclass
class CalibrationResult:
    module: OutputAwareModule  # calibrated (card.calibrated True, card.fit = report)
    scorer: ScorerFit
    report: dict
    timings: dict  # seconds per phase: capture, statistics (incl. the scorer fit), fit


def calibrate(loaded, ids: list[int], s: CalibrationSettings, show_progress: bool = True) -> CalibrationResult:
    config, c = s.config, loaded.config
    if not s.start < len(ids) - 1:
        raise ValueError(f"the calibration text has {len(ids)} tokens: fewer than start={s.start} + 2")
    if not 0 <= config.dense_layers < c.num_hidden_layers:
        raise ValueError(f"dense_layers={config.dense_layers} leaves no sparse layer in a {c.num_hidden_layers}-"
                         "layer model")
    lo, hi = s.window_range
    tic = time.perf_counter()
    cap = capture(loaded, ids, config.page_size, s.prefill_chunk)
    timings = {"capture": time.perf_counter() - tic}
    tic = time.perf_counter()
    positions = torch.arange(s.start, len(ids), s.stride)
    heldout = heldout_mask(positions)
    tally = ScorerTally(list(s.etas), list(s.ranks), config, cap.keys.shape[-1], s.records)
    targets = []
    ms = s.scorer_stride  # the scorer fit attends densely again: a subsample is enough
    # eta > 0 records weigh the values by the output projection's metric ([R-page-score]): one per paged layer.
    metrics = cap.runner.output_metrics() if any(eta > 0 for eta in s.etas) else None
    for layer, queries, layer_targets in collect(cap, positions, config, s.share, hi, show_progress):
        targets.append(layer_targets)
        metric = metrics[cap.runner.pool.paged_index[layer]].cpu() if metrics is not None else None
        tally.add(queries[::ms], cap.keys[layer], cap.values[layer], positions[::ms], heldout[::ms],
                  cap.runner.scale, metric=metric)
    timings["statistics"] = time.perf_counter() - tic
    scorer = tally.result(s.rank_tolerance, s.record_tolerance)
    hidden = cap.hidden[config.dense_layers :, positions].transpose(0, 1).contiguous()  # [S, Ls, H]
    del cap
    window_targets = torch.stack(targets, dim=1)  # [S, Ls, Hkv] tokens
    card = ModuleCard(model=loaded.name, num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
                      kv_heads=c.num_key_value_heads, first_layer=config.dense_layers, width=s.width, bins=s.bins,
                      max_position=c.max_position_embeddings, page_size=config.page_size,
                      sink_pages=config.sink_pages, target_share=s.share, window_range=(lo, hi), eta=scorer.eta,
                      rank=scorer.rank, text=s.text)
    tic = time.perf_counter()
    module = fit_module(card, hidden, positions, window_targets, ~heldout, s.fit)
    report = fit_report(module, hidden, positions, window_targets, ~heldout)
    timings["fit"] = time.perf_counter() - tic
    module.card = dataclasses.replace(card, calibrated=True, mean_reach=report["mean_reach"], fit=report)
    return CalibrationResult(module, scorer, report, timings)
