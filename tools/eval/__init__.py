"""`oval-edge eval`: fidelity (KL, top-1, perplexity) and passkey retrieval of the decode policies, through
the real runtime."""
