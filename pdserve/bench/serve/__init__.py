"""``pdserve bench serve``: P/D against colocated serving on the same cores, under an open-loop
load, measured from the client.

- ``driver``: the setups' processes, the run over rates and repeats, the command line (``main``);
- ``workload``: the requests (``RequestSpec``), their lengths, arrivals and token ids;
- ``client``: the open loop through the router's gRPC API or its OpenAI API (``sse_client``);
- ``report``: each request's record, each run's row, the spread over repeats, the verdicts, the
  tables and plots;
- ``chunk_sweep``: the step budget of the ``colocated-chunked`` setup, measured in a pinned child.

The package re-exports nothing: ``pdserve bench serve`` runs ``driver.main`` (``python -m
pdserve.bench.serve`` too).
"""
