"""mixprec inside the frameworks people train with.

Each integration is its own module, imported on demand, so that ``import mixprec`` never imports
a framework:

- :mod:`mixprec.integrations.lightning`: ``MixprecPrecision``, a PyTorch Lightning precision
  plugin (``pip install lightning``).
- :mod:`mixprec.integrations.accelerate`: ``prepare(accelerator, policy=...)`` for HF Accelerate
  and ``MixprecTrainer`` for the HF ``Trainer`` (``pip install accelerate transformers``).

See ``docs/integrations.md``.
"""
