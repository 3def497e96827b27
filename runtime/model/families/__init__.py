"""What a decoder family adds to the shared DecoderConfig, read from its Hugging Face config keys."""
