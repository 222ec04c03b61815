"""The CPU backend: C kernels (``csrc/``) built at first use with the host's compiler, and their
ctypes bindings, one module per kind of kernel (``quant``: matmuls over GGUF blocks;
``paged_attention``, ``causal_attention``, ``layer_ops``, ``decoder_layer``); ``build`` compiles
and loads them. Nothing here imports the engine."""
