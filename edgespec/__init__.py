"""edgespec: speculative decoding on edge devices (numpy + onnxruntime + tokenizers, no torch).

    gen = edgespec.load("engines/demo-target", draft="engines/demo-draft")
    out = gen.generate("def fib(n):", max_new_tokens=64)

    policy = edgespec.load_policy("engines/vla-reacher", draft=True)      # VLA: action chunks
    actions = policy.act(image, state, "reach the red target")           # (H, D)

Imports numpy, onnxruntime and tokenizers; never torch, `edgespec.export` or `edgespec.robots` (the
`edgespec` command loads those two inside the subcommands that need them, from their extras).
tests/test_layering.py checks this table for all three packages.
"""
__version__ = "0.1.0"

from .contract import EngineError  # noqa: E402
from .generate import GenerationResult, Generator, Stats, load  # noqa: E402
from .policy import Policy, load_policy  # noqa: E402
from .remote import RemoteConfig, RemoteUnavailable  # noqa: E402
from .sampling import SamplingConfig  # noqa: E402
from .speculation import SpeculationConfig  # noqa: E402
from .stats import RoundStats  # noqa: E402

__all__ = ["load", "load_policy", "Policy", "Generator", "GenerationResult", "Stats", "RoundStats", "SamplingConfig",
           "SpeculationConfig", "EngineError", "RemoteConfig", "RemoteUnavailable", "__version__"]
