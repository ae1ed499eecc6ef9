"""jax_ep benchmarks: ``python -m jax_ep.launch -n 2 -m jax_ep.bench --mode ll|ht``."""
