"""One vocabulary: the precisions, fp16's max and a parameter's module, spelled once in labkit.names."""

import re
from pathlib import Path

import pytest
import torch

from labkit import names
from labkit.lab import sweep
from labkit.step import PRECISIONS as DTYPES


def test_fp16_max_is_torchs():
    assert torch.finfo(torch.float16).max == names.FP16_MAX


def test_the_steps_dtype_map_is_keyed_by_the_names():
    assert tuple(DTYPES) == names.PRECISIONS
    assert {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16} == DTYPES


def test_the_sweep_cli_offers_the_names_precisions():
    (action,) = [a for a in sweep.build_parser()._actions if a.dest == "precision"]
    assert tuple(action.choices) == names.PRECISIONS
    with pytest.raises(SystemExit) as e:
        sweep.build_parser().parse_args(["--precision", "fp8"])
    assert e.value.code == 2


def test_a_root_parameter_belongs_to_the_root_module_as_torch_names_it():
    model = torch.nn.Linear(3, 2)  # parameters "weight" and "bias", both the root module's
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        assert names.module_of(name) == "" and modules[names.module_of(name)] is model
    nested = torch.nn.Sequential(torch.nn.Linear(3, 2))
    modules = dict(nested.named_modules())
    assert {names.module_of(n) for n, _ in nested.named_parameters()} == {"0"} and "0" in modules


# an assignment to FP16_MAX (alone or unpacked), the precisions as a literal list, another module_of
AGAIN = re.compile(r"^\s*[\w, ]*\bFP16_MAX\b[\w, ]*=(?!=)|\[\"fp32\", \"bf16\", \"fp16\"\]|def _?module_of\b")


def test_no_module_spells_the_vocabulary_again():
    root = Path(names.__file__).parent
    again = [f"{p.relative_to(root)}:{i}" for p in sorted(root.rglob("*.py")) if p.name != "names.py"
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if AGAIN.search(line)]
    assert again == []
