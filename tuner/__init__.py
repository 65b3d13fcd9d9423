"""Optuna autotuner over the kernel registry; the ``dsa-tune`` command line."""
