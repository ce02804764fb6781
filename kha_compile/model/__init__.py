"""The model's runtime: code that lives inside the user's model once KHA is in.

Transform kinds (:mod:`.transforms`), head slots (:mod:`.slots`), the fold primitive
(:mod:`.rows`), the carrier modules with their own weight-side fold (:mod:`.carrier`,
:mod:`.mha`, :mod:`.parametrized`), the execution strategy (:mod:`.strategy`), sharded variants
(:mod:`.sharded`) and the config (:mod:`.config`). Nothing here reads graphs: :mod:`kha_compile.analysis`
and this package never import each other; they meet in :mod:`kha_compile.handlers`.
"""
