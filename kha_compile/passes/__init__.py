"""The passes: the verbs that change a model (or read it whole) — apply, inspect, remove, fold,
save and load.

:mod:`.apply` runs analysis (trace, match) and the handlers (plan, insert); :mod:`.fold` folds
linear KHA through each carrier's handler; :mod:`.checkpoint` saves and loads KHA weights through
:mod:`kha_compile.store`.
"""
