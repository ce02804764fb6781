"""The library's advice, said in the command line's words: flags instead of Python arguments.

Library errors end with what to do in Python (``Pass strict=False``, ``Use kc.fold(model, strict=False)``,
``without past=True``). A user of ``kha-compile`` needs the flag (or the command) that does it instead;
:func:`for_command` rewrites the sentences it knows, per command.

Example::

    for_command(FoldError("cannot fold: ... Use kc.fold(model, strict=False) to fold ..."), "fold")
    # "cannot fold: ... `kha-compile fold` writes a vanilla model, so it folds linear KHA only: ..."
"""

from __future__ import annotations

import re

__all__ = ["for_command"]

_PARTIAL_FOLD = (
    r"Use kc\.fold\(model, strict=False\) to fold only the linear transforms that fold, "
    r"and kc\.export_onnx\(\.\.\.\) to ship the rest as ops\."
)
_ONCE = (
    r"apply\(\) runs once per model\. Use kc\.fold\(model\) or kc\.remove\(model\) first, or start from a fresh model\."
)
_STRICT = r"\nPass strict=False to return the model unchanged instead\."

# per command: (the library's words, the command line's); "" applies to every command
_RULES: dict[str, tuple[tuple[str, str], ...]] = {
    "fold": (
        (
            _PARTIAL_FOLD,
            "`kha-compile fold` writes a vanilla model, so it folds linear KHA only: ship this KHA with "
            "`kha-compile export MODEL OUT.onnx --kha DIR` (or OUT.pt2), which folds the linear transforms in "
            "a copy and keeps the others as ops.",
        ),
    ),
    "apply": (
        (_ONCE, "MODEL already carries KHA (its directory records it): give `kha-compile apply` the base model."),
        (_STRICT, "\nThere is no KHA to add to this model, so `kha-compile apply` has nothing to save."),
    ),
    "export": (
        (
            _ONCE,
            "MODEL already carries KHA (its directory records it, or --kha loaded it): drop --mlp / --linear "
            "to export it with the KHA it carries.",
        ),
        (_STRICT, "\nExport it without --mlp / --linear."),
    ),
    "": (
        (r"without past=True / generation=True", "without --genai / --generation"),
        (r"export_onnx\(past=True\)", "--genai"),
        (r"export_aoti\(generation=True\)", "--generation"),
        (r"export with dynamic=False", "export with --static"),
        (r"pass generation=True", "add --generation"),
    ),
}


def for_command(exc: BaseException, command: str | None) -> str:
    """The message of ``exc`` with the advice a user of ``kha-compile <command>`` can follow.

    Example::

        for_command(exc, "export")     # "... Export it without --genai / --generation."
    """
    text = str(exc)
    for pattern, words in (*_RULES.get(command or "", ()), *_RULES[""]):
        text = re.sub(pattern, words.replace("\\", "\\\\"), text)
    return text
