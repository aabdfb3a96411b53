"""Plan: what runs a model on this machine, before any download.

``hosts`` classifies the machine and fits devices; ``selection`` holds the host rules as
data and picks engine, format, quant and device; ``plan`` is ``localrun.plan()``: the
selection plus the Hub's variant and the memory fit.
"""
