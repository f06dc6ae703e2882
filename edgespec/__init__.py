"""edgespec: speculative decoding on edge devices (numpy + onnxruntime + tokenizers, no torch)."""
__version__ = "0.1.0"
