"""The public surface: ``__all__`` is honest and every name is documented."""

import inspect

import labkit


def test_all_lists_exactly_the_public_names_sorted():
    # dir(), not vars(): the names are imported on first use (labkit/__init__.py's _EXPORTS)
    public = {n for n in dir(labkit) if not n.startswith("_") and not inspect.ismodule(getattr(labkit, n))}
    assert labkit.__all__ == sorted(labkit.__all__)
    assert set(labkit.__all__) == public


def test_every_public_name_has_a_one_line_imperative_summary():
    for name in labkit.__all__:
        doc = inspect.getdoc(getattr(labkit, name))
        assert doc, f"{name} has no docstring"
        assert doc.splitlines()[0].endswith("."), f"{name}: the first line should be one sentence"


def test_signatures_match_torch_where_labkit_is_a_drop_in():
    import torch

    ours = inspect.signature(labkit.clip_grad_norm_).parameters
    theirs = inspect.signature(torch.nn.utils.clip_grad_norm_).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]
    scaler_ours = list(inspect.signature(labkit.GradScaler).parameters)
    scaler_theirs = list(inspect.signature(torch.amp.GradScaler).parameters)
    assert scaler_ours[: len(scaler_theirs)] == scaler_theirs
    for method in ("scale", "unscale_", "step", "update", "get_scale", "state_dict", "load_state_dict",
                   "is_enabled", "get_growth_factor", "set_growth_factor", "get_backoff_factor",
                   "set_backoff_factor", "get_growth_interval", "set_growth_interval"):
        assert callable(getattr(labkit.GradScaler, method)), method
