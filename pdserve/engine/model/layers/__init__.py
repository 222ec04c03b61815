"""The layers a model family is built from: dense and packed linear, quantized linear and
embedding, paged attention, RMSNorm and RoPE.

A leaf: these modules import ``pdserve.kernels``, ``engine.kv_layout`` and ``model.arch`` at most,
never a model family (``llama.py``), the loaders or ``weights.py``, which import them
(``tests/engine/model/test_layering.py`` holds them to it). A layer acts on its own weights
through its methods (``QuantLinear.from_linear``, ``QuantLinear.interleave``, ...); the walks over
a whole model that call them are in ``weights.py``.
"""
