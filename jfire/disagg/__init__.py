"""Prefill/decode disaggregation: prefill and decode groups in their own processes, each a
JAX mesh running only its own programs, the KV cache moving between them over JAX's transfer
server, coordinated with jax.distributed; a frontend routes requests across the groups."""
