"""Backends implementing jax_ep's ops: ``xla`` (portable) and ``cuda`` (kernels)."""
