"""Where OVAL's decode step starts to pay: the context length from which it is not slower than the dense step
([R-dense-where-it-pays]).

Below some length a sparse step saves nothing: the pages it skips cost less to read than its scoring and selection
cost to run, so the dense step (every cached token, no selection) is faster there. `EngineConfig.oval_from` is that
length: a decode step whose longest row is shorter runs the dense step, OVAL from it on. It depends on the device
and the model, so `oval-edge profile` measures it (tools/profile/crossover.py, which calls `crossover_length`) and
writes it to the TOML's [server] section; without one, `default_oval_from` gives the device type's default, from
the measurement in docs/crossover.md. Imports no torch: the config reader and the CLI use it.
"""

from __future__ import annotations

import math
from typing import Sequence

# OVAL counts as not slower at a length when its decode tok/s is at least (1 - NOISE_MARGIN) x the dense step's.
# Why 2%: on this project's CPU host the OVAL/dense ratio at one length moved by 0.01-0.04 between repeated runs
# near the crossover (docs/crossover.md); a 2% band calls a difference inside that a tie (OVAL, which reads less),
# while the 3-6% that OVAL costs a step at 1536-2048 tokens there still counts as slower.
NOISE_MARGIN = 0.02

# The default crossover per device type, in tokens. CPU: measured with the bundled model at the serve defaults
# (docs/crossover.md: OVAL is 17% slower than dense at 512 tokens, 3% at 2048, and faster from 3072 on).
# CUDA: not measured yet; the CPU's value until a GPU's profile says otherwise (`oval-edge profile` writes the
# device's own to the TOML).
DEFAULT_OVAL_FROM = {"cpu": 3072, "cuda": 3072}
FALLBACK_OVAL_FROM = 3072  # another device type (mps, xpu, ...): unmeasured, the CPU's value


def default_oval_from(device) -> int:
    """The default `EngineConfig.oval_from` for a device: a torch.device, or its name ('cpu', 'cuda', 'cuda:1')."""
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    return DEFAULT_OVAL_FROM.get(kind, FALLBACK_OVAL_FROM)


def crossover_length(lengths: Sequence[int], oval_tps: Sequence[float], dense_tps: Sequence[float],
                     margin: float = NOISE_MARGIN) -> int:
    """The crossover from decode speeds measured at several context lengths: the shortest measured length L such
    that at L and at every longer measured length OVAL is not slower than dense (oval >= (1 - margin) x dense).

    Requiring every longer length too means one noisy short length where OVAL happens to win cannot pull the
    crossover below a length where it loses. The ends:
    - OVAL not slower at every measured length -> 0 (OVAL at every length: nothing measured favours dense);
    - OVAL slower at the longest measured length -> that length + 1 (dense wherever it was measured; past the
      longest only when a longer row exists, which the profile rules out by measuring up to the token limit).
    """
    lengths, oval_tps, dense_tps = list(lengths), list(oval_tps), list(dense_tps)
    if not lengths:
        raise ValueError("crossover_length needs at least one measured context length")
    if not len(lengths) == len(oval_tps) == len(dense_tps):
        raise ValueError(f"crossover_length: {len(lengths)} lengths but {len(oval_tps)} OVAL and {len(dense_tps)} "
                         "dense speeds; give one of each per length")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"crossover_length: lengths {lengths} must be positive integers (tokens)")
    if any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"crossover_length: lengths {lengths} must be strictly increasing")
    for name, speeds in (("oval_tps", oval_tps), ("dense_tps", dense_tps)):
        if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) for v in speeds):
            raise ValueError(f"crossover_length: {name} {speeds} must be positive finite tokens per second")
    if not 0 <= margin < 1:
        raise ValueError(f"crossover_length: margin={margin!r} must be a fraction in [0, 1), e.g. {NOISE_MARGIN}")
    crossover = lengths[-1] + 1
    for length, oval, dense in reversed(list(zip(lengths, oval_tps, dense_tps))):
        if oval < (1 - margin) * dense:
            break
        crossover = length
    return 0 if crossover == lengths[0] else crossover
