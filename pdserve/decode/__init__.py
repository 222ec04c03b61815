"""The decode role: an engine whose connector pulls prompts' KV from prefill engines.

A request arriving with ``do_remote_prefill`` waits in ``WAITING_FOR_REMOTE_KVS`` while its
blocks are pulled, then decodes; a short prompt without remote KV is prefilled locally
(conditional disaggregation).
"""
