"""The reference every pdserve-vs-transformers benchmark compares against: the same weights in
Hugging Face transformers (``pdserve bench engine``, ``pdserve bench throughput``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_transformers_reference(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The same weights in Hugging Face transformers, in eval mode: the reference every
    pdserve-vs-transformers benchmark compares against.

    ``path`` is what pdserve loads: a GGUF file (transformers dequantises it with the same
    ``gguf`` routine pdserve uses) or an HF checkpoint directory such as the tiny test model.
    """
    from transformers import AutoModelForCausalLM

    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        )
    return model.eval()
