"""The one-command GPU check (``bench/gpu/run.sh``): kernel correctness and speed against
the device's measured ceilings, then engine throughput against transformers."""
