"""Core: what every layer may use and that uses nothing of kha_compile above it.

Errors (:mod:`.errors`), the closed vocabularies (:mod:`.kinds`), the one ordered registry
(:mod:`.registry`), the report of a pass (:mod:`.report`), run-time class making
(:mod:`.mixins`), the version (:mod:`.version`), the optional third-party imports
(:mod:`.optional`) and the device of the library's own tensors (:mod:`.devices`).
"""
