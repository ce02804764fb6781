"""Graph analysis: read a model's exported graph, never change a model.

Example inputs (:mod:`.inputs`), the trace (:mod:`.trace`), the graph view and its op tables
(:mod:`.graph`), head layouts (:mod:`.layout`), parameters behind projections (:mod:`.params`),
the attention rules (:mod:`.rules`) and the match (:mod:`.match`). Nothing here imports
:mod:`kha_compile.model`: analysis says *where*; the handlers say *how*.
"""
