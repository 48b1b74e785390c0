"""LABKIT_PERTURB: every built-in task's fresh model nudged by 2^-20 relative, seeded, nothing else moved.

The oracle for "unset changes nothing" is the weights a seed gave before the switch existed: the
GPT kept verbatim in gpt_before_options.py, and the toy's network built on the seed as ToyTask did.
"""

import pytest
import torch
from gpt_before_options import GPTTask as GPTTaskBefore

from labkit.tasks.gpt import GPTTask
from labkit.tasks.perturb import PERTURB_ENV, RELATIVE
from labkit.tasks.toy import ToyTask

SIZE = dict(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=2, seed=3)
TASKS = {"toy": lambda: ToyTask(seed=3), "gpt": lambda: GPTTask(**SIZE)}


def weights_before(name):
    """The weights seed 3 gave before LABKIT_PERTURB existed."""
    if name == "gpt":
        return GPTTaskBefore(**SIZE).model().state_dict()
    torch.manual_seed(3)
    return ToyTask(seed=3)._net().state_dict()


def weights(name):
    return TASKS[name]().model().state_dict()


@pytest.mark.parametrize("name", TASKS)
@pytest.mark.parametrize("unset", ["delete", "", "  "])
def test_unset_or_empty_gives_bitwise_the_weights_of_before(name, unset, monkeypatch):
    if unset == "delete":
        monkeypatch.delenv(PERTURB_ENV, raising=False)
    else:
        monkeypatch.setenv(PERTURB_ENV, unset)
    before, now = weights_before(name), weights(name)
    assert list(now) == list(before)
    assert all(torch.equal(now[k], before[k]) for k in before)


@pytest.mark.parametrize("name", TASKS)
def test_each_entry_moves_by_about_two_to_the_minus_20_relative(name, monkeypatch):
    monkeypatch.setenv(PERTURB_ENV, "1")
    before, now = weights_before(name), weights(name)
    old = torch.cat([t.flatten() for t in before.values()])
    new = torch.cat([t.flatten() for t in now.values()])
    nonzero = old != 0
    relative = ((new - old).abs() / old.abs())[nonzero]
    # |noise| of a standard normal stays below 6 over these few thousand draws (P ~ 1e-5 for all of
    # them together), and two float32 roundings add at most 2^-23 relative
    assert relative.max() <= 6 * RELATIVE + 2.0**-23
    # the size the docstring promises, not a smaller one: the median |z| of a normal is 0.674
    assert 0.4 * RELATIVE < relative.median() < 1.0 * RELATIVE
    assert (relative > 0).float().mean() > 0.9  # all but the entries a tiny z rounds back to themselves
    assert torch.equal(new[~nonzero], old[~nonzero])  # a zero (LayerNorm's bias) stays zero


@pytest.mark.parametrize("name", TASKS)
def test_every_model_of_a_task_gets_the_same_nudge_and_each_seed_its_own(name, monkeypatch):
    monkeypatch.setenv(PERTURB_ENV, "1")
    task = TASKS[name]()
    first, second, other_task = task.model().state_dict(), task.model().state_dict(), weights(name)
    assert all(torch.equal(first[k], second[k]) and torch.equal(first[k], other_task[k]) for k in first)
    monkeypatch.setenv(PERTURB_ENV, "2")
    seed_2 = weights(name)
    assert all(not torch.equal(first[k], seed_2[k]) for k in first if first[k].count_nonzero() > 1)


@pytest.mark.parametrize("name", TASKS)
def test_the_global_rng_is_untouched(name, monkeypatch):
    monkeypatch.delenv(PERTURB_ENV, raising=False)
    torch.manual_seed(123)
    TASKS[name]().model()
    unperturbed_next = torch.rand(4)
    monkeypatch.setenv(PERTURB_ENV, "1")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    TASKS[name]().model()
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(4), unperturbed_next)


@pytest.mark.parametrize("value", ["1.5", "one", "1e3", "0x10"])
@pytest.mark.parametrize("name", TASKS)
def test_a_value_that_is_not_an_integer_says_how_to_set_it(name, value, monkeypatch):
    monkeypatch.setenv(PERTURB_ENV, value)
    how = rf"LABKIT_PERTURB must be an integer seed \(e\.g\. LABKIT_PERTURB=1\), or unset; got '{value}'"
    with pytest.raises(ValueError, match=how):
        TASKS[name]().model()
