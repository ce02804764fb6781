"""kha_compile as a transformers quantization method: ``from_pretrained`` of a KHA directory loads its KHA.

``model.save_pretrained`` of a KHA model records the KHA config as its ``quantization_config``, under
``"quant_method": "kha_compile"`` (:mod:`kha_compile.store.hf`). Importing kha_compile registers that
method with transformers (``register_quantization_config`` and ``register_quantizer``), so every
``from_pretrained`` of such a directory (each Auto class, the concrete classes, and whatever calls
them: ``pipeline(model=dir)``, PEFT, lm-evaluation-harness) runs this quantizer's two hooks:

- before the weights load (the model built on the meta device): ``kc.apply`` with the recorded
  config, a check of the recorded architecture and KHA sites (``check_identity``: a Qwen3's KHA is
  refused by a Llama), and a check that the weight files hold every KHA tensor the model now
  has, by name and shape (an incomplete directory is refused with the names);
- after the weights load (the KHA tensors loaded with the others, in the model's dtype, on its
  device): the quantizer takes itself off again, so the model is what ``kc.apply`` leaves: not
  "quantized" for transformers (the Trainer trains it in full, ``.half()`` and ``save_pretrained``
  work as usual), its config recording the KHA as ``kc.apply`` records it.

On a quantized base (``quantization_config`` names kha_compile's method with the real one's config
inside it, ``"wraps"``: bitsandbytes, torchao, ...), the quantizer transformers builds is the real
method's own quantizer, extended (:func:`_around`): the real hooks run first (the base's layers replaced
by quantized ones), then ``kc.apply`` on the quantized base and the checks; after loading, the model
stays quantized for transformers (the Trainer trains it the QLoRA way, PEFT prepares it), its config the
real method's config object that records the KHA too (:mod:`kha_compile.store.wrapped`).

Directories saved by earlier versions, whose ``quant_method`` is a sentence (:data:`LEGACY_HINTS`),
load the same way: the sentences are registered as names of the same configuration.

The registration imports nothing: transformers' quantizer registry costs seconds to import, so
:func:`install` (run by ``import kha_compile``) registers at once when ``transformers.quantizers.auto``
is already imported, and otherwise right after it is (``core.optional.when_imported``). Either import
order works; only a process that never imports kha_compile loads such a directory without its KHA
(transformers then warns "Unknown quantization type, got kha_compile").

Example::

    import kha_compile as kc                                   # registers the quantizer
    model = AutoModelForCausalLM.from_pretrained("trained_kha_dir")     # KHA applied and loaded
"""

from __future__ import annotations

import logging
import pathlib
from types import ModuleType
from typing import Any

import torch

from ..core.errors import CheckpointError, KHAError
from ..core.optional import loaded, when_imported
from ..model.carrier import kha_modules
from ..model.config import KHAConfig, config_of
from ..model.sharded import adopt_sharded_projections
from ..passes.apply import apply
from ..passes.checkpoint import check_identity
from ..store.format import checkpoint_misfit
from ..store.hf import (
    CONFIG_KEY,
    HINT_KEY,
    LEGACY_HINTS,
    QUANT_METHOD,
    kha_entry,
    kha_shapes_in,
    record_config,
    wrapped_quantization,
)
from ..store.identity import recorded_identity
from ..store.names import align_names, is_kha_key

__all__ = ["REGISTRY_MODULE", "install", "prepare_model", "release_model"]

log = logging.getLogger(__name__)

REGISTRY_MODULE = "transformers.quantizers.auto"  # where register_quantization_config / register_quantizer live
_ANYWAY = (
    "to load it anyway, build this model without KHA (from_config, then load_state_dict of its weight files) and "
    "call kc.load_pretrained(model, directory, strict=False)"
)


def install() -> None:
    """Register kha_compile's quantizer with transformers, now or once its quantizer registry is imported.

    Example::

        install()       # import kha_compile runs it; a second call changes nothing
    """
    when_imported(REGISTRY_MODULE, _register)


def _register(auto: ModuleType) -> None:
    """Register the config class and the quantizer under ``"kha_compile"`` (and the legacy sentences)."""
    if QUANT_METHOD in auto.AUTO_QUANTIZER_MAPPING:
        return  # registered already (kha_compile imported twice, or another copy of it)
    config_cls, quantizer_cls = _classes()
    for name in (QUANT_METHOD, *LEGACY_HINTS):
        if name not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
            auto.register_quantization_config(name)(config_cls)
    auto.register_quantizer(QUANT_METHOD)(quantizer_cls)
    log.debug("registered the transformers quantization method %r", QUANT_METHOD)


def _classes() -> tuple[type, type]:
    """kha_compile's transformers quantization config and quantizer (transformers is imported by now)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    class KHAQuantizationConfig(QuantizationConfigMixin):
        """The ``quantization_config`` of a KHA directory: ``quant_method`` and the KHA entry beside it.

        Example::

            KHAQuantizationConfig(version=3, v="mlp").to_dict()   # {"quant_method": "kha_compile", "version": 3, ...}
        """

        def __init__(self, quant_method: str = QUANT_METHOD, **entry: Any) -> None:
            self.quant_method = QUANT_METHOD  # type: ignore[assignment]  # a legacy sentence reads as the short name
            for key, value in entry.items():
                setattr(self, key, value)

    class KHAQuantizer(HfQuantizer):
        """Applies KHA before the weights load and takes itself off after (see :mod:`.hf_quantizer`).

        Example::

            AutoModelForCausalLM.from_pretrained("trained_kha_dir")     # transformers runs it
        """

        requires_calibration = False

        def __new__(cls, quantization_config: Any, **kwargs: Any) -> Any:
            real = wrapped_quantization(quantization_config)
            if real is None:
                return super().__new__(cls)
            return _around(real, quantization_config, kwargs)  # not a KHAQuantizer: __init__ is not run again

        def validate_environment(self, *args: Any, **kwargs: Any) -> None:
            return None

        def _process_model_before_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            prepare_model(model, self.quantization_config, kwargs.get("checkpoint_files"))
            return model

        def _process_model_after_weight_loading(self, model: Any, **kwargs: Any) -> Any:
            release_model(model)
            return model

        def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:
            return True

    return KHAQuantizationConfig, KHAQuantizer


def _around(real: dict, kha_config: Any, kwargs: dict) -> Any:
    """The real quantization method's quantizer for ``real`` (its config dict), extended to apply KHA too."""
    from transformers.quantizers.auto import AutoHfQuantizer, AutoQuantizationConfig

    real_config = AutoQuantizationConfig.from_dict(dict(real))
    inner = AutoHfQuantizer.from_config(real_config, **kwargs)
    cls = type(inner)
    around = _AROUND.get(cls)
    if around is None:
        around = _AROUND[cls] = type(cls.__name__, (cls,), dict(_AROUND_METHODS, __module__=cls.__module__))
    inner.__class__ = around
    inner.kha_config = kha_config
    return inner


def _before(self: Any, model: Any, **kwargs: Any) -> Any:
    super(type(self), self)._process_model_before_weight_loading(model, **kwargs)  # some return None
    model.config.quantization_config = self.quantization_config  # the real config object, as transformers set it
    prepare_model(model, self.kha_config, kwargs.get("checkpoint_files"))
    return model


def _after(self: Any, model: Any, **kwargs: Any) -> Any:
    super(type(self), self)._process_model_after_weight_loading(model, **kwargs)
    record_config(model)  # the real config object, recording the KHA too
    adopt_sharded_projections(model)
    log.info(
        "loaded %s with its KHA (%s) on its quantized base", type(model).__name__, getattr(model.config, CONFIG_KEY)
    )
    return model


_AROUND: dict[type, type] = {}
_AROUND_METHODS = {"_process_model_before_weight_loading": _before, "_process_model_after_weight_loading": _after}


def _recorded_entry(model: Any, quantization_config: Any) -> dict:
    """The KHA entry the loaded config.json records (the ``kha_compile`` entry, else the quantization config's)."""
    to_dict = getattr(quantization_config, "to_dict", None)
    data = {
        CONFIG_KEY: getattr(model.config, CONFIG_KEY, None),
        HINT_KEY: to_dict() if callable(to_dict) else quantization_config,
    }
    entry = kha_entry(data)
    if entry is None:
        raise CheckpointError(
            f"this {type(model).__name__} checkpoint names {QUANT_METHOD!r} as its quantization method, but its "
            f"config.json records no KHA config (neither a {CONFIG_KEY!r} entry nor the config beside quant_method); "
            "save it again from the model with KHA (model.save_pretrained after kc.apply)."
        )
    return entry


def prepare_model(model: Any, quantization_config: Any, checkpoint_files: list[str] | None) -> None:
    """Before the weights load: apply the recorded KHA to ``model`` and check it against the checkpoint.

    Refuses (:class:`CheckpointError`) a checkpoint saved from another architecture or with other KHA
    sites, and weight files that lack some of the KHA tensors the model now has (named).

    Example::

        prepare_model(model, model.config.quantization_config, ["out/model.safetensors"])
    """
    entry = _recorded_entry(model, quantization_config)
    directory = pathlib.Path(checkpoint_files[0]).parent if checkpoint_files else model.config.name_or_path
    try:
        cfg = KHAConfig.from_dict(entry)
    except (KHAError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{str(directory)!r} records an invalid KHA config in config.json: {exc}") from exc
    if kha_modules(model):  # KHA applied already (a subclass that calls kc.apply in __init__): it must agree
        have = KHAConfig.from_dict(config_of(model)).roles()
        if have != cfg.roles():
            raise CheckpointError(
                f"{type(model).__name__} already carries KHA {have} when it is built, but {str(directory)!r} records "
                f"KHA {cfg.roles()}; build the model without KHA (kha_compile applies the recorded config while "
                "loading), or apply the recorded config."
            )
    else:
        with torch.device("cpu"):  # transformers builds the model under torch.device("meta"): inputs must be real
            apply(model, cfg)
    if checkpoint_files:  # else a state_dict passed to from_pretrained: transformers reports what is missing
        _check_stored(model, cfg, directory, checkpoint_files)
    check_identity(model, directory, recorded_identity(entry), advice=_ANYWAY)


def _check_stored(model: Any, cfg: KHAConfig, directory: object, checkpoint_files: list[str]) -> None:
    """Refuse weight files that lack (or shape otherwise) a KHA tensor ``model`` has, naming them."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if is_kha_key(k)}
    have = kha_shapes_in(checkpoint_files)
    names = align_names(want, have)  # a causal LM's checkpoint loaded into its base model: another prefix
    if names is not None:
        have = {names[k]: v for k, v in have.items()}
    misfit = checkpoint_misfit(want, have)
    if misfit:
        raise CheckpointError(
            f"{str(directory)!r} records KHA ({cfg.roles()}) in config.json, but its weight files do not hold the "
            f"KHA tensors {type(model).__name__} needs: {misfit}. The checkpoint is incomplete, or its files come "
            "from different saves; save it again from the trained model."
        )


def release_model(model: Any) -> None:
    """After the weights load: take the quantizer off, leaving the model as ``kc.apply`` leaves it.

    Example::

        release_model(model)
        model.is_quantized, getattr(model, "hf_quantizer", None)    # False, None
    """
    transformers = loaded("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", ()) if transformers is not None else ()
    for module in model.modules():
        if isinstance(module, pretrained) and getattr(module.config, "_is_quantized", False):
            module.config._is_quantized = False
    for attr in ("hf_quantizer", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    model.is_quantized = False
    if hasattr(model.config, HINT_KEY):
        delattr(model.config, HINT_KEY)
    record_config(model)  # the kha_compile entry and quantization_config as kc.apply writes them
    # transformers shards the model (tp_plan / distributed_config) before this hook: the KHA projections take
    # their local heads now, so inference (no_grad, on local tensors) needs no first training forward
    adopt_sharded_projections(model)
    log.info("loaded %s with its KHA (%s)", type(model).__name__, getattr(model.config, CONFIG_KEY, {}))
