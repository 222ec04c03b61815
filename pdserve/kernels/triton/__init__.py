"""The Triton backend (CUDA; the tests run it in Triton's CPU interpreter): the paged KV-cache
write, decode attention and block copy, launched through ``ops``."""
