"""The checks every attention form must pass, in a model of two blocks, for both KHA configs.

Example::

    check_form(lambda: TwoBlocks(MyAttention), (x,), v="linear")
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import kha_compile as kc
from helpers import kha_params, perturb


def check_form(
    make: Callable[[], nn.Module],
    args: tuple,
    v: str,
    sites: int = 2,
    anchor: str = "",
    kwargs: dict | None = None,
    grad: bool = True,
    output: Callable = lambda y: y,
    reference: Callable[[nn.Module], torch.Tensor] | None = None,
    qk: bool = False,
    kept: tuple[str, ...] = (),
) -> nn.Module:
    """apply -> every site matched, exact identity at init, perturbation moves, exact fold (linear).

    ``grad=False`` runs the model under no_grad (forms whose backward this platform lacks);
    ``output`` picks the tensor to compare from what the model returns (e.g. ``y["logits"]``);
    ``reference(model)``: an independent per-head computation from the stored parameters and the
    KHA weights; the perturbed output, and the folded one, must equal it. ``qk``: linear KHA on
    q and k too. ``kept``: roles whose transforms sit on the attention's arguments (roles that read
    the same features of one projection): they do not fold, ``kc.fold(strict=False)`` keeps them.
    """
    kwargs = kwargs or {}
    torch.manual_seed(0)
    model = make().eval()
    ctx = torch.enable_grad if grad else torch.no_grad

    def run():
        return output(model(*args, **kwargs))

    with ctx():
        ref = run().detach()
    cfg = kc.KHAConfig(q="linear", k="linear", v=v) if qk else kc.KHAConfig(v=v)
    kc.apply(model, cfg, example_args=args, example_kwargs=kwargs)
    report = kc.inspect(model, example_args=args, example_kwargs=kwargs)
    assert len(report.matched) == sites and not report.skipped, str(report)
    if anchor:
        assert {s.anchor for s in report.matched} == {anchor}, str(report)
    assert all(s.transforms.get(r) == kind for s in report.matched for r, kind in cfg.roles().items()), str(report)
    assert kha_params(model)
    with ctx():
        assert torch.equal(run(), ref)  # identity at init, exactly
    perturb(model)
    with ctx():
        moved = run().detach()
    assert (moved - ref).abs().max() > 1e-3
    expected = None
    if reference is not None:
        with torch.no_grad():
            expected = reference(model)
        torch.testing.assert_close(moved, expected, rtol=1e-4, atol=1e-5)
    if v == "linear":
        kc.fold(model, strict=not kept)
        assert {n.partition(".kha.")[2].partition(".")[0] for n in kha_params(model)} == set(kept)
        with ctx():
            folded = run()
        torch.testing.assert_close(folded, moved, rtol=1e-5, atol=1e-5)
        if expected is not None:
            torch.testing.assert_close(folded.detach(), expected, rtol=1e-4, atol=1e-5)
    return model


def check_save_and_reload(make: Callable[[], nn.Module], model: nn.Module, args: tuple, directory) -> None:
    """kc.save_pretrained of ``model`` (KHA applied and perturbed), then kc.load_pretrained into a fresh
    ``make()`` holding ``model``'s other weights: the same outputs, and the per-head reference's.

    Example::

        check_save_and_reload(MyNet, model, (x,), tmp_path)
    """
    kc.save_pretrained(model, directory)
    again = make()
    again.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in f".{k}"})
    kc.load_pretrained(again, directory, example_args=args)
    with torch.no_grad():
        assert torch.equal(again(*args), model(*args))
        torch.testing.assert_close(again(*args), model.reference(*args), rtol=1e-4, atol=1e-5)
