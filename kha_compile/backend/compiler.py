"""The compiler entry: :class:`KHABackend` runs the rules on each Dynamo graph, then Inductor.

Errors raised while compiling pass through Dynamo unwrapped: Dynamo wraps what a backend raises
in ``BackendCompilerFailed`` except its own ``ShortenTraceback`` family, so a ``KHAError`` is
re-raised as a subclass of both, and ``except kc.KHAError`` catches it.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx, nn

from ..core.errors import BackendOptionError, DeployError, KHAError
from .deploy import DeployPlan
from .graph import BackendOptions, GraphContext, copy_graph, is_mlp_value_op, param_names, touches_kha
from .rules import RULES, Rule, RuleSetup
from .runtime import Runner
from .stats import BackendStats, GraphStats

__all__ = ["COMPILERS", "NAME", "KHABackend", "create", "kha", "last_stats", "reset"]

log = logging.getLogger(__name__)

NAME = "kha"
COMPILERS = ("inductor", "eager")

_Compiler = str | Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


_SURFACED: dict[type, type] = {}


def _surface(exc: KHAError) -> KHAError:
    """The same error, made to pass through Dynamo unwrapped (see the module docs)."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # pragma: no cover
        return exc
    base = type(exc)
    if issubclass(base, ShortenTraceback):
        return exc
    cls = _SURFACED.get(base)
    if cls is None:
        try:
            cls = type(
                base.__name__,
                (base, ShortenTraceback),
                {"__module__": base.__module__, "__qualname__": base.__qualname__},
            )
        except TypeError:  # pragma: no cover - incompatible layouts
            return exc
        _SURFACED[base] = cls
    new = cls(*exc.args, first_useful_frame=None)
    return new.with_traceback(exc.__traceback__)


def _mlp_value_ops(node: fx.Node) -> int:
    """kha::mlp_value ops a node runs: 1 for the op, the count of a deploy transform call, else 0."""
    if is_mlp_value_op(node):
        return 1
    return int(getattr(node.target, "kha_mlp_value_ops", 0)) if node.op == "call_function" else 0


_LAST: KHABackend | None = None


class KHABackend:
    """A torch.compile backend: KHA rewrites on the Dynamo graph, then Inductor.

    ``stats`` holds what it did (per graph and summed). Options:

    - ``from_pretrained``: a ``kc.save_pretrained`` directory; deploy mode.
    - ``model``, ``example_args``, ``example_kwargs``: the model to deploy into, analysed and
      validated against the checkpoint right away (a misfit raises ``KHAError`` here, before any
      compile). Without ``model`` the backend places the transforms where the checkpoint's
      recorded plan says, finding each projection in the graph by its weight's name, and validates
      when it compiles (the ``KHAError`` then surfaces from the first call). A checkpoint without a
      plan (older kha_compile, or the model's own ``save_pretrained``) needs ``model``.
    - ``fold`` (True): fold linear KHA into the projections when gradients are off.
    - ``fuse_mlp`` (True): rewrite the decomposed MLP-value form into ``kha::mlp_value``.
    - ``compiler`` ("inductor"): "inductor", "eager" (run the rewritten graph as is) or a backend callable.

    Example::

        be = kc.backend(fold=True)
        y = torch.compile(model, backend=be)(x)
        be.stats.rewrites
    """

    def __init__(
        self,
        from_pretrained: str | os.PathLike[str] | None = None,
        *,
        model: nn.Module | None = None,
        example_args: Any = (),
        example_kwargs: dict[str, Any] | None = None,
        fold: bool = True,
        fuse_mlp: bool = True,
        compiler: _Compiler = "inductor",
    ):
        if not (callable(compiler) or compiler in COMPILERS):
            raise BackendOptionError(
                f"compiler={compiler!r} is not allowed; use one of "
                f"{', '.join(map(repr, COMPILERS))} or a torch.compile backend callable."
            )
        for name, flag in (("fold", fold), ("fuse_mlp", fuse_mlp)):
            if not isinstance(flag, bool):
                raise BackendOptionError(f"{name} must be True or False, got {flag!r}.")
        if model is not None and from_pretrained is None:
            raise BackendOptionError(
                "model= is only used with from_pretrained= (deploy mode): "
                "kc.backend(from_pretrained=ckpt_dir, model=model)."
            )
        self.__name__ = NAME  # Dynamo names the backend in its messages by __name__
        self.options: BackendOptions = {"fold": fold, "fuse_mlp": fuse_mlp}
        self.compiler = compiler
        self.stats = BackendStats()
        self._deploy = (
            DeployPlan(from_pretrained, example_args, example_kwargs, model_given=model is not None)
            if from_pretrained is not None
            else None
        )
        self._model = weakref.ref(model) if model is not None else None
        self._placed: set[str] = set()  # deploy mode: projections placed so far, over all graphs
        self._quiet: set[tuple[str, ...]] = set()  # the graphs already reported as having no KHA, by parameter names
        if model is not None and self._deploy is not None:
            self._deploy.entries(model)  # validate now: a misfit raises before anything compiles

    def reset(self) -> None:
        """Forget the stats and which graphs were already reported as having no KHA."""
        self.stats = BackendStats()
        self._quiet.clear()

    def __repr__(self) -> str:
        mode = f"from_pretrained={self._deploy.directory!r}, " if self._deploy else ""
        return (
            f"KHABackend({mode}fold={self.options['fold']}, fuse_mlp={self.options['fuse_mlp']}, "
            f"compiler={self.compiler!r})"
        )

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        global _LAST
        _LAST = self
        try:
            return self._compile(gm, example_inputs)
        except KHAError as exc:
            raise _surface(exc) from None

    def _rules(self) -> list[Rule]:
        entries = None
        if self._deploy is not None:
            if self._model is None:
                entries = self._deploy.planned()
            else:
                model = self._model()
                if model is None:
                    raise DeployError(
                        "deploy: the model given to kc.backend(from_pretrained=..., model=model) no longer "
                        "exists; make a new backend for the model you compile."
                    )
                entries = self._deploy.entries(model)
        directory = self._deploy.directory if self._deploy is not None else ""
        setup = RuleSetup(self.options, entries, directory, self._placed)
        return [rule for cls in RULES if (rule := cls.create(setup)) is not None]

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        original, gm = gm, copy_graph(gm)  # Dynamo keeps using the graph it passed (its placeholders)
        stats = GraphStats(len(self.stats.graphs))
        self.stats.graphs.append(stats)
        ctx = GraphContext(gm, example_inputs, stats, self.options)
        had_kha = any(touches_kha(n) for n in gm.graph.nodes)
        for rule in self._rules():
            rule.run(ctx)
        stats.mlp_value_ops = sum(_mlp_value_ops(n) for n in gm.graph.nodes)
        stats.has_kha = had_kha or any(stats.rewrites.values()) or stats.mlp_value_ops > 0
        if not stats.has_kha:
            # once per backend and model: graphs over the same parameters (recompiles, other shapes) stay quiet
            key = tuple(sorted(param_names(original).values()))
            log.log(
                logging.DEBUG if key in self._quiet else logging.INFO,
                "kha backend: no KHA transforms in graph %d (%d parameters); compiling it unchanged with %s",
                stats.index,
                len(key),
                self._compiler_name(),
            )
            self._quiet.add(key)
            return self._inner(original, list(example_inputs))
        gm.graph.lint()
        gm.recompile()
        log.info(
            "kha backend: graph %d: %d kha::mlp_value op(s) (%d fused from the decomposed form), "
            "%d linear transform(s) folded, %d inserted from a checkpoint, %d declined",
            stats.index,
            stats.mlp_value_ops,
            stats.count("fuse_mlp_value"),
            stats.count("fold_linear"),
            stats.count("deploy"),
            len(stats.declined),
        )
        compiled = self._inner(gm, ctx.example_inputs)
        if ctx.constants:
            return Runner(compiled, ctx.constants, ctx.switches)
        return compiled

    def _compiler_name(self) -> str:
        return (
            self.compiler if isinstance(self.compiler, str) else getattr(self.compiler, "__name__", "a custom backend")
        )

    def _inner(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if self.compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx

            compiled: Callable[..., Any] = compile_fx(gm, example_inputs)  # type: ignore[assignment]
            return compiled
        if self.compiler == "eager":
            return gm.forward
        assert callable(self.compiler)
        return self.compiler(gm, example_inputs)


def create(from_pretrained: str | os.PathLike[str] | None = None, **options: Any) -> KHABackend:
    """A :class:`KHABackend` (``kha_compile.backend(...)`` calls this).

    Example::

        torch.compile(model, backend=kc.backend())                                   # same as "kha"
        torch.compile(vanilla, backend=kc.backend(from_pretrained="kha_ckpt"))       # deploy
        kc.backend(from_pretrained="kha_ckpt", model=vanilla)    # validates the checkpoint now
    """
    return KHABackend(from_pretrained, **options)


_DEFAULT: KHABackend | None = None


def _default() -> KHABackend:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = KHABackend()
    return _DEFAULT


def kha(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The backend registered as ``"kha"``: a shared default :class:`KHABackend`.

    Example::

        torch.compile(model, backend="kha")      # calls this
    """
    return _default()(gm, example_inputs)


def last_stats() -> BackendStats:
    """Stats of the backend that compiled most recently (the ``"kha"`` default one if none has).

    Example::

        kc.backend.last_stats().rewrites      # {'deploy': 0, 'fuse_mlp_value': 0, 'fold_linear': 6}
    """
    return (_LAST or _default()).stats


def reset() -> None:
    """Reset the stats of the default ``"kha"`` backend (and of the last one used)."""
    _default().reset()
    if _LAST is not None:
        _LAST.reset()
