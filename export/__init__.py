"""edgespec.export: the offline pipeline (checkpoint -> reference model -> ONNX/TensorRT engine folder) and the
training of the bundled demo models.

Imports: the runtime (edgespec), torch, onnx, onnxruntime, transformers, safetensors, tokenizers, tqdm
(the `export` extra); never edgespec.robots. Training data that comes from a simulator is written by edgespec.robots
(robots/demos.py) and read here from .npz files. The runtime never imports this package.
"""
