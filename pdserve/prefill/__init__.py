"""The prefill role: an engine whose connector produces KV for remote decode engines.

It computes a prompt's KV and first token, then holds the blocks under a lease until the
decode engine that pulls them says it is done (``pdserve.connector.pd_connector``).
"""
