"""``pdserve bench throughput``: offline throughput on a mixed workload, pdserve against
transformers' static batching, measured in the same run.

- ``driver``: both engines on the same workload, the report and the command line (``main``);
- ``workload``: the offline workload (``OfflineWorkload``): ShareGPT-like lengths, seeded prompts;
- ``static_batching``: transformers' length-sorted, left-padded ``generate`` batches, swept over
  batch sizes.

The package re-exports nothing: ``pdserve bench throughput`` runs ``driver.main`` (``python -m
pdserve.bench.throughput`` too).
"""
