"""The ``mixprec demo``: train a small language model in every precision mode and report.

See :mod:`mixprec.demo.train` for the modes and :mod:`mixprec.demo.report` for the report.
"""
