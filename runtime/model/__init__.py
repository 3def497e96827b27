"""Models in: sources (GGUF, Hugging Face folders), their configs and tokenizers, weight streaming, 4-bit
quantization, bound projections and the runtime's own decoder that holds the weights."""
