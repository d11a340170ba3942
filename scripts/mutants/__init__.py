"""Mutation testing of mixprec: ``python -m scripts.mutants`` (docs/mutants.md)."""
