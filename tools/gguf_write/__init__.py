"""Writing GGUF files under llama.cpp's tensor names: real checkpoints (tests) and seeded random models (bench)."""
