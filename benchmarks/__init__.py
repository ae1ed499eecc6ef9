"""The lab around jax_ep's bench (python -m jax_ep.bench), not part of the package:
charts and medians drawn from its JSON, and the bench run with probes that look
inside each timing. Each module runs from the repository's root as
``python -m benchmarks.<module>`` (benchmarks/README.md)."""
