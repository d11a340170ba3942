"""The ``mixprec demo``: train a small language model in every precision mode and report.

In parts: :mod:`~mixprec.demo.settings` (what to train), :mod:`~mixprec.demo.modes` (the registry
of precision modes), :mod:`~mixprec.demo.environment` (versions, native fp16/bf16, threads),
:mod:`~mixprec.demo.results` (result types, checks, statistics), :mod:`~mixprec.demo.estimate`
(the time estimate), :mod:`~mixprec.demo.speed` (the speed panel), :mod:`~mixprec.demo.train`
(the training loop), and :mod:`~mixprec.demo.verdict`, :mod:`~mixprec.demo.progress` and
:mod:`~mixprec.demo.report`, which read results only.
"""
