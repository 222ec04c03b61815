"""``pdserve bench models``: the GGUF files (and one HF directory) the benchmarks of issue 41 run
on, made reproducibly by llama.cpp's own tools into a cache outside the project
(``~/.cache/pdserve/models`` unless ``--cache`` or ``$PDSERVE_MODELS_CACHE``).

- ``driver``: the command line (``main``): which files, made or kept, one line for each;
- ``recipes``: the files, what each needs, the key that decides when it is remade, how it is made;
- ``llamacpp_tools``: ``llama-quantize`` (the peers' llama.cpp build) and ``convert_hf_to_gguf.py``
  (from the same release's sdist);
- ``llama_shaped``: the Llama-3.2-1B-shaped HF checkpoint with random weights;
- ``manifest``: what was made, from what, by which commands, with checksums;
- ``tensor_types``: a file's tensor bytes by type and the share line printed for it;
- ``paths``: the cache and ``model_path(name)``, for other commands to find a file by name.

The package re-exports nothing (``python -m pdserve.bench.models.llama_shaped`` runs in a child
process, and should not import the rest first): ``from pdserve.bench.models.paths import
model_path``.
"""
