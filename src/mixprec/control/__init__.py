"""Precision control: what moves a layer or a GEMM between formats, and when.

The Guard (``_guard``), the Controller's stateful shell (``_controller``) over its pure parts:
forecasts (``_trend``), the ladder of rungs and the probe (``_ladder``), decisions (``_decide``);
the collectives every rank runs alike (``_collective``) and module conversion (``_convert``).
Imports only :mod:`mixprec.formats` (and the settings values of :mod:`mixprec.policy`'s leaf).

Not public API: users reach it through :mod:`mixprec.fp8` and ``mixprec.Controller``.
"""
