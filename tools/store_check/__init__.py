"""`oval-edge store-check`: the page store (oval_edge/kv/store/) against the same runs fully in memory, on the real
model: teacher-forced logits, served greedy tokens, passkey answers, decode speed and the bytes read from disk."""
