"""Test-session settings.

One intra-op thread per process (set before torch is imported, and inherited by the servers and workers the
tests start): the suite's work is many small tensor ops, where a second thread mostly waits, and on a shared
2-core machine two spinning threads per process stall each other. Timing is measured by `oval-edge bench`,
never by tests, so this changes no result.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
