"""mixprec's benchmarks. ``python -m benchmarks [--quick]`` runs them all (see ``run.py``);
``benchmarks/gpu.py`` is the GPT-2-small training benchmark for a GPU."""
