"""The CPU backend: C kernels (``csrc/``, laid out as ggml-cpu's: each family's ``<family>.c`` and,
beside it, its x86 twin ``arch/x86/<family>.c``) built at first use with the host's compiler,
and their ctypes bindings, one module per kind of kernel (``quant``: matmuls over GGUF blocks,
the ``quants``, ``quants_a8``, ``repack_a8`` and ``repack_bf16`` families; ``paged_attention``,
``causal_attention``, ``layer_ops``, ``decoder_layer``); ``build`` compiles and loads them, and
``features`` reads what the CPU can do. Nothing here imports the engine."""
