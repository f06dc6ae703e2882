"""edgespec: speculative decoding on edge devices (numpy + onnxruntime + tokenizers, no torch).

    gen = edgespec.load("engines/demo-target", draft="engines/demo-draft")
    out = gen.generate("def fib(n):", max_new_tokens=64)
"""
__version__ = "0.1.0"

from .contract import EngineError  # noqa: E402
from .generate import GenerationResult, Generator, Stats, load  # noqa: E402
from .sampling import SamplingConfig  # noqa: E402

__all__ = ["load", "Generator", "GenerationResult", "Stats", "SamplingConfig", "EngineError", "__version__"]
