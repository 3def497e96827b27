"""Where a model comes from: the bundled GGUF, a local GGUF file or Hugging Face folder (source.py), or a repository
pulled from the Hugging Face Hub into its cache (hub.py); checked before anything loads."""
