"""The tests' GGUF writer lives in oval_edge.tools.gguf_write.writer (bench's synthetic model uses it too); this
name stays so the tests' `from gguf_checkpoint import write_gguf` keeps working."""

from oval_edge.tools.gguf_write.writer import write_gguf, write_gguf_tensors  # noqa: F401 - re-exported
