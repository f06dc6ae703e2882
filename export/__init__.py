"""edgespec.export: the offline pipeline (checkpoint -> reference model -> ONNX/TensorRT engine folder).

Needs the `export` extra (torch, onnx, transformers, safetensors). The device runtime never imports it.
"""
