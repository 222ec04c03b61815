"""``pdserve bench perplexity``: pdserve's perplexity of a GGUF file against llama.cpp's
``llama-perplexity`` on the same file and text, by llama.cpp's own scheme (issue 41).

- ``driver``: the command line (``main``): the models in turn, the table, JSON and plot;
- ``scheme``: llama.cpp's chunks, BOS replacement, scored positions and running sums;
- ``pdserve_run``: those chunks through a loaded model's serving path;
- ``llamacpp_run``: ``llama-perplexity`` and ``llama-tokenize`` (the peers' llama.cpp build);
- ``report``: the table's rows and the plot.
"""
