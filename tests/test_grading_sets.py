"""Problem sets 2, 3 and 4: their sources and releases, and their checks on honest answers, in process.

Correct answers written another way pass every hidden seed tried; each classic bug fails its
part on every hidden seed tried (so nbgrader's in-kernel autograde, with a fresh seed, fails it
too) and gets its own hint; the other mistakes each part's judge knows are named as well; the
library functions a part asks for are trapped however they are reached. The sandboxed grader
and nbgrader's autograde of whole submissions: tests/test_grading_nbgrader.py.
"""

import functools
import math
import re
import statistics
import sys
from pathlib import Path

import nbformat
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import labkit
from labkit.grading import checks
from labkit.grading.notebook import TEXT_STUB, grade, plan, release, validate

sys.path.insert(0, str(Path(__file__).parent))
from grading_answers import BUGS, NAMES, OTHER_FORMS, PARTS, PS2, PS3, PS4, solutions  # noqa: E402
from test_grading import sandboxed  # noqa: E402
from test_grading_checks import undo_bans  # noqa: E402,F401 (an autouse fixture: the ban wrappers go after)

CHECK = {"read_run_answer": checks.check_read_run, "fp16_range_answer": checks.check_fp16_range,
         "zclip_answer": checks.check_zscore_clipper, "detector_answer": checks.check_spike_detector,
         "clip_effect_answer": checks.check_clip_effect, "stale_answer": checks.check_stale_fraction,
         "kahan_answer": checks.check_kahan_update, "fp8_answer": checks.check_fp8_tiles,
         "delayed_answer": checks.check_delayed_scaling, "rms_answer": checks.check_update_rms,
         "stable_answer": checks.check_update_clipping, "spike_answer": checks.check_find_spike}
# a GPT run or forty ZClip steps per case: a few seeds each; the others are cheap
SEEDS = {"read_run_answer": 2, "zclip_answer": 2, "clip_effect_answer": 2, "spike_answer": 2}


def load(source, name):
    """Run an answer cell's source as the notebook would (after its setup cell); return what it defines."""
    namespace = {"math": math, "statistics": statistics, "torch": torch, "labkit": labkit}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


def fails(check, fn, seed=None, hidden=True):
    with pytest.raises(AssertionError) as err:
        check(fn, hidden=hidden, seed=seed)
    return str(err.value)


def visible(check, fn):
    """The message of the visible cases' failure."""
    return fails(check, fn, hidden=False)


# ---------------------------------------------------------------- the sources and their releases


@pytest.mark.parametrize("path", [PS2, PS3, PS4], ids=["ps2", "ps3", "ps4"])
def test_each_set_is_valid_nbgrader_with_its_parts_points_and_one_written_question(path):
    nb = nbformat.read(path, as_version=4)
    validate(nb)
    planned = plan(nb)
    assert {p.grade_id: p.points for p in planned if not p.manual} == PARTS[path]
    kinds = {c.metadata.get("nbgrader", {}).get("grade_id"): c.cell_type for c in nb.cells}
    assert [(p.points, kinds[p.grade_id]) for p in planned if p.manual] == [(2, "markdown")]
    for p in planned:  # every autograded part: its visible check, then the same check with hidden cases
        if not p.manual:
            assert [c.hidden for c in p.calls] == [False, True] and p.calls[0].check == p.calls[1].check
    student = release(nb)
    sources = [c.source for c in student.cells]
    assert not any("BEGIN SOLUTION" in s or "hidden=True" in s for s in sources)
    answers = solutions(path)
    for cell in student.cells:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if gid in answers:  # the signature (and a class's settings) stay; each marked region is a stub
            assert "# YOUR CODE HERE" in cell.source
            assert cell.source.split("\n")[0] == answers[gid].split("\n")[0]
        elif gid in ("why_rewind", "why_e5m2", "why_update_clip"):
            assert cell.source == TEXT_STUB


# ---------------------------------------------------------------- correct answers written another way


@pytest.mark.parametrize("gid", OTHER_FORMS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_correct_answer_written_another_way_passes_every_hidden_seed(gid, seed):
    # the instructor's answers: nbval runs the sources' test cells, hidden cases included, on a fresh seed
    fn = load(OTHER_FORMS[gid], NAMES[gid])
    CHECK[gid](fn)
    for k in range(SEEDS.get(gid, 6) // 2):
        CHECK[gid](fn, hidden=True, seed=seed + k)


# ---------------------------------------------------------------- classic bugs: each fails its part


@pytest.mark.parametrize("bug", BUGS)
def test_each_classic_bug_fails_its_part_on_every_seed_with_its_hint(bug):
    gid, source, _, hint = BUGS[bug]
    fn = load(source, NAMES[gid])
    for seed in range(SEEDS.get(gid, 6)):
        message = fails(CHECK[gid], fn, seed)
        assert hint in message and f"(seed={seed})" in message, message


def test_a_bug_only_the_hidden_cases_show_passes_the_visible_tests():
    # what nbgrader's agreement shows: its 0 on these parts means it ran the hidden cases
    for bug in ("counts every skip as a backoff", "a tie never rounds away"):
        gid, source, _, _ = BUGS[bug]
        CHECK[gid](load(source, NAMES[gid]))


# ---------------------------------------------------------------- the other mistakes each judge names

SOLVED = {gid: src for path in (PS2, PS3, PS4) for gid, src in solutions(path).items()}


def mistake(gid, old, new, count=1):
    """The instructor's answer with one line changed: a mistake a student makes."""
    source = SOLVED[gid]
    assert source.count(old) >= count, old
    return load(source.replace(old, new), NAMES[gid])


def test_reading_a_run_names_a_late_backoff_and_each_window_mistake():
    late = mistake("read_run_answer",
                   "backoffs = [(r.step, r.reason) for r in records if r.next_scale < r.scale]",
                   "backoffs = [(b.step, b.reason) for a, b in zip(records, records[1:]) if b.scale < "
                   "a.scale]")
    assert "each backoff is found one step late" in visible(checks.check_read_run, late)
    current = mistake("read_run_answer", "recent = norms[-window:]",
                      "recent = (norms + [r.grad_norm])[-window:] if math.isfinite(r.grad_norm) else []")
    assert "the current norm is in its own window" in visible(checks.check_read_run, current)
    nonfinite = mistake("read_run_answer", "if not r.skipped and math.isfinite(r.grad_norm):", "if True:")
    assert "a skipped step's norm is inf or NaN" in visible(checks.check_read_run, nonfinite)
    skipped = mistake("read_run_answer", "if not r.skipped and math.isfinite(r.grad_norm):",
                      "if math.isfinite(r.grad_norm):")
    # a spike detector's skip has a finite norm: the hidden run with a detector in the loop shows it
    assert any("a step the run skipped" in fails(checks.check_read_run, skipped, seed) for seed in range(3))


def test_fp16_range_names_each_mistake():
    zeros = mistake("fp16_range_answer", "((g != 0) & (half == 0))", "(half == 0)")
    assert "you counted gradients that were 0 already" in visible(checks.check_fp16_range, zeros)
    strict = mistake("fp16_range_answer", "torch.isinf(half)", "((g * scale).abs() > 65504)")
    assert "only from 65520 on do they become inf" in visible(checks.check_fp16_range, strict)
    floor = mistake("fp16_range_answer", "((g != 0) & (half == 0))",
                    "((g != 0) & ((g * scale).abs() < 2.0**-24))")
    assert "rounds up to 2**-24, it is not lost" in fails(checks.check_fp16_range, floor, seed=3)
    unscaled = mistake("fp16_range_answer", "half = (g * scale).half()", "half = g.half()")
    assert "multiplied by the loss scale before the cast" in visible(checks.check_fp16_range, unscaled)


def test_the_zscore_clipper_names_each_mistake_and_traps_a_host_sync():
    raw = mistake("zclip_answer", "value = torch.where(finite, limit, self.mean)",
                  "value = torch.where(finite, norm, self.mean)")
    assert "ZClip feeds it the clipped value" in visible(checks.check_zscore_clipper, raw)
    old_mean = mistake("zclip_answer", "(value - ema_mean) ** 2", "(value - self.mean) ** 2")
    assert "updated around the new mean" in visible(checks.check_zscore_clipper, old_mean)
    threshold = mistake("zclip_answer", "self.mean + self.z_thresh**2 / z * std",
                        "self.mean + self.z_thresh * std")
    assert "not to the threshold mean + z_thresh * std" in visible(checks.check_zscore_clipper, threshold)
    counted = mistake("zclip_answer", "count = self.count + finite.long()", "count = self.count + 1")
    assert "your warm-up counted a NaN/inf step" in visible(checks.check_zscore_clipper, counted)
    forgetful = mistake("zclip_answer", '"buffer": self.buffer.clone(),\n                ', "")
    assert "raised KeyError: 'buffer'" in visible(checks.check_zscore_clipper, forgetful)
    no_buffer = mistake("zclip_answer", "self.buffer, self.count = state[\"buffer\"].clone(), "
                                        "state[\"count\"].clone()",
                        "self.count = state[\"count\"].clone()")
    assert "did not resume bit for bit" in fails(checks.check_zscore_clipper, no_buffer, seed=2)
    synced = mistake("zclip_answer", "finite = "
                                     "torch.isfinite(norm)", "finite = "
                                                             "torch.tensor(bool(torch.isfinite(norm)))")
    message = visible(checks.check_zscore_clipper, synced)
    assert "synced with the host: it used a tensor as a Python bool" in message and "torch.where" in message
    nan_grads = mistake("zclip_answer", "torch.where(clip, torch.clamp(limit / (norm + 1e-6), max=1.0), "
                        "torch.ones_like(norm))", "torch.clamp(limit / (norm + 1e-6), max=1.0)")
    assert "a non-finite norm must leave them untouched" in visible(checks.check_zscore_clipper, nan_grads)


def test_the_detector_names_each_mistake():
    current = mistake("detector_answer", "values = "
                                         "history[-self.window:]", "values = (history + [x])[-self.window:]")
    assert "leave the current one out of its window" in visible(checks.check_spike_detector, current)
    both_ways = mistake("detector_answer", "return (x - mean) / std", "return abs(x - mean) / std")
    assert "only increases count" in visible(checks.check_spike_detector, both_ways)
    early = mistake("detector_answer", "if len(values) < self.window // 2:", "if len(values) < 2:")
    assert "inactive until the window holds window // 2 values" in visible(checks.check_spike_detector, early)
    nan_in = mistake("detector_answer", "if not (math.isfinite(loss) and math.isfinite(norm)):\n            "
                     "return \"skip\", None", "if not (math.isfinite(loss) and math.isfinite(norm)):\n"
                     "            self.losses.append(loss)\n            self.norms.append(norm)\n"
                     "            return \"skip\", None")
    assert "a NaN/inf entered your window" in visible(checks.check_spike_detector, nan_in)


def test_clip_effect_names_each_mistake():
    same = mistake("clip_effect_answer", "        model, optimizer = fresh()\n",
                   "        model, optimizer = fresh() if not sizes else (model, optimizer)\n")
    assert "the second step started where the first one ended" in visible(checks.check_clip_effect, same)
    inverse = mistake("clip_effect_answer", "(sizes[1] / sizes[0])", "(sizes[0] / sizes[1])")
    assert "that is the inverse" in visible(checks.check_clip_effect, inverse)


def test_stale_updates_name_each_mistake():
    zeros = mistake("stale_answer", "moving = update != 0",
                    "moving = torch.ones_like(update, dtype=torch.bool)")
    assert "a zero update has nothing to lose" in visible(checks.check_stale_fraction, zeros)
    upward = mistake("stale_answer", "toward = torch.where(update >= 0, math.inf, "
                                     "-math.inf).to(weight.dtype)",
                     "toward = torch.full_like(weight, math.inf)")
    assert "the one in the update's direction" in visible(checks.check_stale_fraction, upward)
    le = mistake("stale_answer", "(size < half) | ((size == half) & even)", "size <= half")
    assert "it survives when the weight's last bit is odd" in fails(checks.check_stale_fraction, le, seed=4)
    float32 = mistake("stale_answer", "lost = (size < half) | ((size == half) & even)",
                      "lost = (weight.float() + update).bfloat16() == weight")
    assert "adding in float32 first rounds twice" in fails(checks.check_stale_fraction, float32, seed=5)
    relative = mistake("stale_answer", "lost = (size < half) | ((size == half) & even)",
                       "lost = update.abs() < weight.float().abs() * 2.0**-9")
    assert "half the gap only *below* a power of two" in visible(checks.check_stale_fraction, relative)


def test_the_kahan_update_names_each_mistake():
    forgot = mistake("kahan_answer", "y = update.float() + compensation.float()", "y = update.float()")
    assert "the compensation was never added back" in visible(checks.check_kahan_update, forgot)
    rounded = mistake("kahan_answer", "y = update.float() + compensation.float()",
                      "y = (update.float() + compensation.float()).bfloat16().float()")
    assert "rounded to bf16 before the add" in fails(checks.check_kahan_update, rounded, seed=1)
    frozen = mistake("kahan_answer", "return new, carry.to(torch.bfloat16)", "return new, compensation")
    assert "the compensation never changes" in visible(checks.check_kahan_update, frozen)
    wide = mistake("kahan_answer", "return new, carry.to(torch.bfloat16)", "return new.float(), carry")
    assert "both stay bf16" in visible(checks.check_kahan_update, wide)


def test_fp8_tiles_name_each_mistake():
    late = mistake("fp8_answer", "    if not torch.isfinite(amax).all():\n        raise ValueError("
                   "\"a tile holds a NaN or inf: refusing to cast it to FP8\")\n", "")
    assert "check every tile's amax *before* the cast" in visible(checks.check_fp8_tiles, late)
    zero = mistake("fp8_answer", "torch.where(amax > 0, amax / 448, previous_scale)", "amax / 448")
    assert "keep the previous step's scale for it" in visible(checks.check_fp8_tiles, zero)
    one = mistake("fp8_answer", "torch.where(amax > 0, amax / 448, previous_scale)",
                  "torch.where(amax > 0, amax / 448, torch.ones_like(amax))")
    assert "keeps the previous step's scale (previous_scale)" in visible(checks.check_fp8_tiles, one)
    inverse = mistake("fp8_answer", "return data, scale, saturated, flushed",
                      "return data, 1 / scale, saturated, flushed")
    assert "that is the inverse" in visible(checks.check_fp8_tiles, inverse)
    at_448 = mistake("fp8_answer", "(tiles.abs() > "
                                   "amax.unsqueeze(-1))", "(tiles.abs() >= amax.unsqueeze(-1))")
    assert "that is the scale working, not saturating" in visible(checks.check_fp8_tiles, at_448)
    columns = mistake("fp8_answer", "return data, scale, saturated, flushed",
                      "return data, scale.t(), saturated, flushed")
    assert "tiles are 1x128" in visible(checks.check_fp8_tiles, columns)


def test_delayed_scaling_names_each_mistake():
    mean = mistake("delayed_answer", "max(amaxes[-history:])", "sum(amaxes[-history:]) / "
                                                               "len(amaxes[-history:])")
    assert "not their mean" in visible(checks.check_delayed_scaling, mean)
    longer = mistake("delayed_answer", "max(amaxes[-history:])", "max(amaxes[-history - 1:])")
    assert "not one more" in fails(checks.check_delayed_scaling, longer, seed=2)
    first = mistake("delayed_answer", "if amaxes else amax", "if amaxes else 0.0")
    assert "use this step's own amax" in visible(checks.check_delayed_scaling, first)


def test_update_rms_names_each_mistake():
    beta1 = mistake("rms_answer", 'beta2, eps = group["betas"][1], group["eps"]',
                    'beta2, eps = group["betas"][0], group["eps"]')
    assert "uses beta2 (betas[1]), not beta1" in visible(checks.check_update_rms, beta1)
    mean_abs = mistake("rms_answer", "(p.grad.square() / v_hat.clamp(min=eps**2)).mean().sqrt()",
                       "(p.grad.abs() / v_hat.clamp(min=eps**2).sqrt()).mean()")
    assert "that is the mean of |g| / sqrt(v_hat)" in visible(checks.check_update_rms, mean_abs)
    first_group = mistake("rms_answer", 'beta2, eps = group["betas"][1], group["eps"]',
                          'one = optimizer.param_groups[0]\n        beta2, eps = one["betas"][1], one["eps"]')
    assert "of its own param group" in fails(checks.check_update_rms, first_group, seed=0)
    shared = mistake("rms_answer", 'state["step"].double()',
                     'max(float(s["step"]) for s in optimizer.state.values())')
    assert "each tensor has its own step count" in fails(checks.check_update_rms, shared, seed=1)
    no_floor = mistake("rms_answer", "v_hat.clamp(min=eps**2)", "v_hat")
    assert "is 0 / 0: divide by max(v_hat, eps**2)" in fails(checks.check_update_rms, no_floor, seed=2)
    plus_eps = mistake("rms_answer", "(p.grad.square() / v_hat.clamp(min=eps**2)).mean().sqrt()",
                       "(p.grad / (v_hat.sqrt() + eps)).square().mean().sqrt()")
    assert "not by (sqrt(v_hat) + eps)**2" in fails(checks.check_update_rms, plus_eps, seed=3)
    zero = mistake("rms_answer", "out.append(math.nan)", "out.append(0.0)")
    assert "return NaN for it" in fails(checks.check_update_rms, zero, seed=4)


def test_update_clipping_names_each_mistake_and_keeps_adamw_where_nothing_clips():
    adamw = mistake("stable_answer", "eta = lr / rms.clamp(min=1.0)", "eta = lr")
    assert "no tensor was clipped: that is AdamW's step" in visible(checks.check_update_clipping, adamw)
    always = mistake("stable_answer", "eta = lr / rms.clamp(min=1.0)", "eta = lr / rms")
    assert "divide by max(1, RMS_t), not by RMS_t" in visible(checks.check_update_clipping, always)
    stale = mistake("stable_answer", "rms = (g * g / v_hat.clamp(min=eps**2)).mean().sqrt()",
                    "old = exp_avg_sqs[len(new_m)] / (1 - beta2**step)\n"
                    "        rms = (g * g / old.clamp(min=eps**2)).mean().sqrt()")
    assert "the second moment *after* this step's update" in visible(checks.check_update_clipping, stale)
    one_rms = mistake("stable_answer", "rms = (g * g / v_hat.clamp(min=eps**2)).mean().sqrt()",
                      "rms = torch.cat([(gg * gg / (beta2 * vv + (1 - beta2) * gg * gg).div(1 - beta2**step)"
                      ".clamp(min=eps**2)).flatten() for gg, vv in zip(grads, exp_avg_sqs)]).mean().sqrt()")
    assert "RMS_t is per tensor" in fails(checks.check_update_clipping, one_rms, seed=0)
    single = mistake("stable_answer", "new_params.append(p - eta * weight_decay * p - eta * m_hat / "
                     "(v_hat.sqrt() + eps))", "new_params.append((p - eta * weight_decay * p - eta * m_hat / "
                     "(v_hat.sqrt() + eps)).float())")
    assert "keep their dtype" in visible(checks.check_update_clipping, single)
    moments = mistake("stable_answer", "new_v.append(v)", "new_v.append(v / (1 - beta2**step))")
    assert "moments after step 1 are wrong" in visible(checks.check_update_clipping, moments)


def test_reading_a_monitored_run_names_each_mistake():
    first = ("        if r.update_rms_max > threshold:  # NaN on the first record: never above\n"
             "            tensor, rms_step = r.update_rms_peak, r.update_step\n            break\n")
    largest = mistake("spike_answer", first,
                      "        x = r.update_rms_max\n"
                      "        if x > threshold and (tensor is None or x > top):\n"
                      "            tensor, rms_step, top = r.update_rms_peak, r.update_step, x\n")
    assert "not at the run's largest RMS" in visible(checks.check_find_spike, largest)
    same = mistake("spike_answer", "rms_step < loss_step", "rms_step <= loss_step")
    assert "at the same step the loss was already up" in fails(checks.check_find_spike, same, seed=0)


# ---------------------------------------------------------------- bans: trapped however they are reached


def test_the_library_functions_a_part_asks_for_are_trapped_however_reached():
    from labkit.clippers import ZClip
    from labkit.formats.fp8 import Fp8Guard, quantize
    from labkit.lab.defenses import Defenses

    class Subclassed(ZClip):  # a subclass runs ZClip's constructor
        def __init__(self, alpha, z_thresh, warmup, eps):
            super().__init__(alpha, z_thresh, warmup, eps, max_consecutive_clips=None)

    def through_the_lab(alpha, z_thresh, warmup, eps):  # labkit's own code builds it
        return Defenses(method="zclip", threshold=z_thresh, window=warmup, feed="clipped",
                        max_consecutive_clips=None).clipper()

    for fn, what in ((ZClip, "labkit.clippers.ZClip"), (Subclassed, "labkit.clippers.ZClip"),
                     (through_the_lab, "labkit.clippers.ZClip")):
        assert f"called {what}: this part asks you to write the clipper yourself" in fails(
            checks.check_zscore_clipper, fn, hidden=False)

    def swallowed(x, previous_scale):  # the trap raised inside a try that swallows everything still counts
        try:
            q = quantize(x, "e4m3", "tile128")
        except BaseException:
            return None
        return q.data, q.scale, q.saturated, q.flushed

    tiles = functools.partial(quantize, fmt="e4m3")  # the library's function itself, as the answer
    assert "called labkit.formats.fp8.quantize: this part asks you to write the cast yourself" in fails(
        checks.check_fp8_tiles, swallowed, hidden=False)
    assert "called labkit.formats.fp8.quantize" in visible(checks.check_fp8_tiles, tiles)

    def guarded(steps, history):
        guard = Fp8Guard(history=history)
        return [round(guard(x) and guard.records[-1].saturated * x.numel()) for x in steps], [0] * len(steps)

    assert "called labkit.formats.fp8.Fp8Guard: this part asks you to keep the history yourself" in fails(
        checks.check_delayed_scaling, guarded, hidden=False)
    assert "called labkit.formats.bf16.stale_fraction" in fails(
        checks.check_stale_fraction, lambda u, w: labkit.formats.bf16.stale_fraction(u, w, mask=u != 0),
        hidden=False)
    # outside the part, the library works as ever
    assert ZClip(warmup=2).warmup == 2
    assert quantize(torch.ones(1, 128), "e4m3", "tile128").scale.shape == (1, 1)


# ---------------------------------------------------------------- the releases score 0, in the sandbox


@pytest.mark.parametrize("path", [PS2, PS3, PS4], ids=["ps2", "ps3", "ps4"])
def test_the_release_scores_zero_and_every_part_says_it_is_not_implemented(path):
    sandboxed()
    report = grade(nbformat.read(path, as_version=4), release(nbformat.read(path, as_version=4)), timeout=60)
    assert report.score() == 0 and report.max_score() == sum(PARTS[path].values())
    assert report.tampering == [] and report.warnings == []
    for part in report.parts:
        if part.manual:
            assert part.message == "not answered"
        else:
            assert part.message.endswith("is not implemented yet: replace `raise NotImplementedError()` "
                                         "with your code."), part.message


def test_ps4s_oracle_is_trapped_however_it_is_reached():
    from labkit.optim import StableAdamW, read_update_rms
    from labkit.update_monitor import UpdateMonitor

    def through_the_monitor(optimizer):  # labkit's own hook calls read_update_rms for the student
        monitor = UpdateMonitor(optimizer, threshold=None)
        named = [(str(i), p) for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])]
        monitor.post_step(None, named, None)
        return list(monitor.post_backward(None, 0).values())

    for fn in (read_update_rms, through_the_monitor):  # a reference taken before the first ban reaches the
        message = fails(checks.check_update_rms, fn, hidden=False)  # function it calls, update_rms, itself
        assert re.search(r"called labkit\.optim\.((read_)?update_rms|_update_rms_together): "
                         r"this part asks you to compute the RMS yourself", message), message

    def clipped_by_labkit(params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps, weight_decay):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        StableAdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        return ps, exp_avgs, exp_avg_sqs

    message = fails(checks.check_update_clipping, clipped_by_labkit, hidden=False)
    assert "called labkit.optim.StableAdamW: this part asks you to write the update-clipped step" in message
    # outside the parts, the library works as ever
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    opt = StableAdamW([w])
    opt.step()
    assert read_update_rms(opt)[0].item() == pytest.approx(1.0)
