"""The engine: requests, admission by pages, chunked prefill + batched decode, sampling, detokenization, the
paged forward, memory figures and statistics."""
