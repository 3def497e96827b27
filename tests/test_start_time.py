"""A fast warm start (#53): what `oval-edge serve` imports and waits for before it is healthy.

Wall time is too noisy to test on a shared machine; these check the causes instead: the modules a served model
pulls in (none of transformers' model classes, no hub client, no compiler stack), and the engine building its KV
pool while the tokenizer (mostly transformers' import) still loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from test_gguf_serving import tiny_llama_gguf

# Never needed to serve: transformers' model classes and their loading machinery, accelerate, the Hugging Face
# kernel-hub client (bitsandbytes asked it for a CPU kernel at import), TorchDynamo / Inductor and sympy.
NEVER = ("transformers.modeling_utils", "transformers.models.llama.modeling_llama",
         "transformers.models.auto.modeling_auto", "transformers.generation", "accelerate", "kernels",
         "torch._dynamo", "torch._inductor", "sympy")
# bitsandbytes only where the weights are its 4-bit layers
ONLY_FOR_BNB = ("bitsandbytes",)

# The serve command's path in one process: its modules, the app, then the engine as serve loads it (ServeSpec.load).
SERVE_PATH = """
import json, sys
from oval_edge.cli import prepare_runtime_process
prepare_runtime_process()
import argparse
from oval_edge.runtime.server import serve
from oval_edge.runtime.server.app import create_app
from oval_edge.runtime.server.options import engine_spec
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
engine = engine_spec(parser.parse_args(sys.argv[1:])).load()
assert engine.tokenizer is not None
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after_load(*args: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", SERVE_PATH, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def _loaded(modules: set[str], names) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["auto", "nf4"])
def test_a_served_model_imports_no_model_classes_hub_client_or_compiler(tmp_path, quant):
    """auto (a GGUF's own blocks, the default) and nf4 (bitsandbytes). Fails on the code before #53 for nf4:
    importing bitsandbytes imported the `kernels` hub client (and asked the hub for a kernel)."""
    modules = _modules_after_load("--model", tiny_llama_gguf(tmp_path, "Q4_0"), "--quant", quant,
                                  "--device", "cpu")
    assert "transformers.tokenization_utils_tokenizers" in modules  # the tokenizer is transformers' fast one
    assert _loaded(modules, NEVER) == []
    assert bool(_loaded(modules, ONLY_FOR_BNB)) == (quant == "nf4")


def test_the_kv_pool_is_built_while_the_tokenizer_loads(tmp_path, monkeypatch):
    """Engine.load builds the pool (first touch of its memory, GIL released) while the tokenizer loads on its own
    thread: the tokenizer here only finishes once the pool is built. Sequential (before #53), the pool was only
    started after the tokenizer had loaded, so this waited out its timeout and failed."""
    from oval_edge.runtime.engine import engine as engine_module
    from oval_edge.runtime.model import loader

    path = tiny_llama_gguf(tmp_path, "Q4_0")
    pool_built = threading.Event()
    waited: list[bool] = []
    real_tokenizer, real_pool = loader.load_tokenizer, engine_module.build_pool

    def tokenizer_after_pool(*args, **kwargs):
        tokenizer = real_tokenizer(*args, **kwargs)
        waited.append(pool_built.wait(timeout=30))
        return tokenizer

    def build_pool(*args, **kwargs):
        pool = real_pool(*args, **kwargs)
        pool_built.set()
        return pool

    monkeypatch.setattr(loader, "load_tokenizer", tokenizer_after_pool)
    monkeypatch.setattr(engine_module, "build_pool", build_pool)
    engine = engine_module.Engine.load(path, quant="auto", device="cpu")
    assert waited == [True]
    assert engine.tokenizer is engine.loaded.tokenizer and engine.eos_ids


def test_a_tokenizer_that_fails_in_the_background_raises_its_error(tmp_path, monkeypatch):
    """The background load keeps load_model's contract: a broken tokenizer is a ValueError naming the model."""
    from oval_edge.runtime.engine.engine import Engine
    from oval_edge.runtime.model import loader

    def broken(source, metadata=None):
        raise ValueError(f"model {source.path}: cannot load its tokenizer (test)")

    monkeypatch.setattr(loader, "load_tokenizer", broken)
    path = tiny_llama_gguf(tmp_path, "Q4_0")
    with pytest.raises(ValueError, match="cannot load its tokenizer"):
        Engine.load(path, quant="auto", device="cpu")
