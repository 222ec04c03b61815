"""What every benchmark shares, whatever it measures.

- ``report``: how every benchmark ends: a table on the terminal, a JSON file and a PNG plot;
- ``machine``: what a benchmark records of the machine it ran on;
- ``hf_reference``: the same weights in transformers, the reference pdserve is compared with.

Nothing here knows a benchmark. This package re-exports nothing: each benchmark imports the
module it needs, so importing one never imports another.
"""
