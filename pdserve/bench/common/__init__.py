"""What every benchmark shares, whatever it measures.

- ``stats``: percentile, median, spread and CDF, each with the one convention every report uses;
- ``report``: how every benchmark ends: a table on the terminal, a JSON file and a PNG plot;
- ``machine``: what a benchmark records of the machine it ran on;
- ``hf_reference``: the same weights in transformers, the reference pdserve is compared with.

Nothing here knows a benchmark: no module of this package imports one. The package re-exports
nothing; a benchmark imports the modules it needs.
"""
