"""Honest student answers to problem sets 2, 3 and 4: correct ones written another way, and classic bugs.

Each is the source of an answer cell (keyed by its grade_id), as a student would hand it in.
``BUGS`` maps a name to (answer grade_id, source, test grade_id it loses, a phrase of the hint it
must get). The grading tests (checks in process, the sandboxed grader, nbgrader's autograde) and
the grading benchmark share them.
"""

import json
from pathlib import Path

EXERCISES = Path(__file__).parents[1] / "notebooks" / "exercises"
PS2 = EXERCISES / "ps2_instabilities_and_spikes.ipynb"
PS3 = EXERCISES / "ps3_precision_beyond_fp16.ipynb"
PS4 = EXERCISES / "ps4_optimizer_spikes.ipynb"
# autograded part -> points, per set
PARTS = {
    PS2: {"read_run_tests": 3, "fp16_range_tests": 2, "zclip_tests": 3, "detector_tests": 2,
          "clip_effect_tests": 2},
    PS3: {"stale_tests": 2, "kahan_tests": 2, "fp8_tests": 3, "delayed_tests": 2},
    PS4: {"rms_tests": 2, "stable_tests": 3, "spike_tests": 2},
}
# the function or class each test cell checks, by answer cell
NAMES = {"read_run_answer": "read_run", "fp16_range_answer": "fp16_range", "zclip_answer": "ZScoreClipper",
         "detector_answer": "RollingDetector", "clip_effect_answer": "clip_effect",
         "stale_answer": "lost_fraction", "kahan_answer": "kahan_update", "fp8_answer": "quantize_tiles",
         "delayed_answer": "saturation", "rms_answer": "update_rms_per_tensor",
         "stable_answer": "stable_adamw_step", "spike_answer": "find_spike"}


def solutions(path: Path) -> dict[str, str]:
    """The instructor's answers of a source notebook, as a student would hand them in (markers gone)."""
    nb = json.loads(path.read_text())
    out = {}
    for cell in nb["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("solution") and cell["cell_type"] == "code":
            source = "".join(cell["source"])
            out[meta["grade_id"]] = "\n".join(line for line in source.split("\n") if "### " not in line)
    return out


OTHER_FORMS = {
    # statistics and a deque; backoffs read from consecutive records' scales the right way round
    "read_run_answer": '''
from collections import deque
import statistics


def read_run(records, window, k):
    backoffs = []
    for r in records:
        if r.next_scale < r.scale:
            backoffs.append((r.step, r.reason))
    history, flagged = deque(maxlen=window), []
    for r in records:
        if len(history) == window and math.isfinite(r.grad_norm):
            mean, std = statistics.fmean(history), statistics.pstdev(history)
            if (std > 0 and (r.grad_norm - mean) / std > k) or (std == 0 and r.grad_norm > mean):
                flagged.append(r.step)
        if r.skipped or not math.isfinite(r.grad_norm):
            continue
        history.append(r.grad_norm)
    return backoffs, flagged
''',
    # counts per tensor, as tensors
    "fp16_range_answer": '''
def fp16_range(grads, scale):
    total = flushed = overflowed = 0
    for g in grads:
        h = (g.float() * scale).to(torch.float16)
        flushed += torch.count_nonzero((h == 0) & (g != 0))
        overflowed += torch.count_nonzero(h.isinf())
        total += g.numel()
    return flushed / total, overflowed / total
''',
    # float64 statistics, a mask per step, the warm-up stats computed from a masked sum
    "zclip_answer": '''
class ZScoreClipper:
    def __init__(self, alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6):
        self.alpha, self.z_thresh, self.warmup, self.eps = alpha, z_thresh, warmup, eps
        zero = torch.tensor(0.0, dtype=torch.float64)
        self.state = {"mu": zero, "var": zero.clone(), "seen": torch.zeros(warmup, dtype=torch.float64),
                      "n": torch.tensor(0)}

    def clip_(self, parameters):
        params = [p for p in parameters if p.grad is not None]
        total = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
        s = self.state
        ok = total.isfinite()
        ready = s["n"] >= self.warmup
        sigma = s["var"].sqrt()
        z = (total - s["mu"]) / (sigma + self.eps)
        cut = ok & ready & (z > self.z_thresh)
        target = torch.where(cut, s["mu"] + (self.z_thresh ** 2 / z) * sigma, total)
        factor = torch.where(cut, (target / (total + 1e-6)).clamp(max=1.0), torch.ones_like(total))
        for p in params:
            p.grad.mul_(factor.to(p.grad.dtype))
        v = torch.where(ok, target, torch.zeros_like(target))
        filling = ok & ~ready
        seen = torch.where(filling & (torch.arange(self.warmup) == s["n"]), v, s["seen"])
        n = s["n"] + filling.long()
        done = filling & (n == self.warmup)
        mu_b = seen.sum() / self.warmup
        var_b = ((seen - mu_b) ** 2).sum() / self.warmup
        mu_e = self.alpha * s["mu"] + (1 - self.alpha) * v
        var_e = self.alpha * s["var"] + (1 - self.alpha) * (v - mu_e) ** 2
        step = ok & ready
        self.state = {"mu": torch.where(done, mu_b, torch.where(step, mu_e, s["mu"])),
                      "var": torch.where(done, var_b, torch.where(step, var_e, s["var"])),
                      "seen": seen, "n": n}
        return total.float()

    def state_dict(self):
        return {key: value.clone() for key, value in self.state.items()}

    def load_state_dict(self, state):
        self.state = {key: value.clone() for key, value in state.items()}
''',
    # deques and the statistics module
    "detector_answer": '''
from collections import deque
import statistics


class RollingDetector:
    def __init__(self, window=128, skip_z=6.0, clip_z=None):
        self.window, self.skip_z, self.clip_z = window, skip_z, clip_z
        self.losses, self.norms = deque(maxlen=window), deque(maxlen=window)

    def z(self, values, x):
        if len(values) < self.window // 2:
            return float("nan")
        mean, std = statistics.fmean(values), statistics.pstdev(values)
        if std == 0:
            return 0.0 if x == mean else (float("inf") if x > mean else float("-inf"))
        return (x - mean) / std

    def decide(self, loss, norm):
        if math.isnan(loss) or math.isnan(norm) or math.isinf(loss) or math.isinf(norm):
            return ("skip", None)
        zl, zn = self.z(self.losses, loss), self.z(self.norms, norm)
        if self.skip_z is not None and max(zl, zn) > self.skip_z:
            return ("skip", None)
        if self.clip_z is not None and zn > self.clip_z:
            limit = statistics.fmean(self.norms) + self.clip_z * statistics.pstdev(self.norms)
            self.losses.append(loss)
            self.norms.append(limit)
            return ("clip", limit)
        self.losses.append(loss)
        self.norms.append(norm)
        return ("log", None)
''',
    # torch's clip and parameters_to_vector
    "clip_effect_answer": '''
def clip_effect(fresh, loss_fn, inputs, targets, max_norm):
    from torch.nn.utils import clip_grad_norm_, parameters_to_vector

    def update(clip):
        model, optimizer = fresh()
        start = parameters_to_vector(model.parameters()).detach().clone()
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        if clip:
            clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        return (parameters_to_vector(model.parameters()).detach() - start).norm()

    return float(update(True) / update(False))
''',
    # the midpoint between the weight and its neighbour, against the exact sum in float64
    "stale_answer": '''
def lost_fraction(update, weight):
    up = torch.nextafter(weight, torch.full_like(weight, math.inf))
    down = torch.nextafter(weight, torch.full_like(weight, -math.inf))
    neighbour = torch.where(update > 0, up, down)
    midpoint = (weight.double() + neighbour.double()) / 2
    exact = weight.double() + update.double()
    inside = (exact - weight.double()).abs() < (midpoint - weight.double()).abs()
    tie = (exact == midpoint) & (weight.view(torch.int16) & 1 == 0)
    nonzero = update != 0
    n = int(nonzero.sum())
    return float(((inside | tie) & nonzero).sum()) / n if n else 0.0
''',
    # torch.add and .to(dtype)
    "kahan_answer": '''
def kahan_update(weight, update, compensation):
    y = torch.add(update.to(torch.float32), compensation.to(torch.float32))
    w32 = weight.to(torch.float32)
    new = torch.add(w32, y).to(weight.dtype)
    return new, torch.sub(y, torch.sub(new.to(torch.float32), w32)).to(compensation.dtype)
''',
    # multiplies by the reciprocal; unflatten; saturated from x / scale against the tile's amax
    "fp8_answer": '''
def quantize_tiles(x, previous_scale):
    t = x.unflatten(-1, (-1, 128))
    amax = t.abs().amax(-1, keepdim=True)
    if torch.isnan(amax).any() or torch.isinf(amax).any():
        raise ValueError("NaN or inf in a tile: refusing the FP8 cast")
    scale = torch.where(amax > 0, amax / 448.0, previous_scale.unsqueeze(-1))
    data = torch.clamp(t * (1.0 / scale), -448.0, 448.0).flatten(-2).to(torch.float8_e4m3fn)
    flushed = torch.logical_and(x != 0, data.to(torch.float32) == 0).sum() / x.numel()
    saturated = (t.abs() > amax).sum() / x.numel()
    return data, scale.squeeze(-1), saturated, flushed
''',
    # labkit-free max over a list of floats; counts with torch.count_nonzero
    "delayed_answer": '''
def saturation(steps, history):
    past, delayed, current = [], [], []
    for x in steps:
        amax = float(x.abs().max())
        scale_amax = max(past) if past else amax
        delayed.append(int(torch.count_nonzero(x.abs() > scale_amax)))
        current.append(int(torch.count_nonzero(x.abs() > amax)))
        past = (past + [amax])[-history:]
    return delayed, current
''',
    # the state read by (group, parameter) index, Python floats, torch.maximum for the floor
    "rms_answer": '''
def update_rms_per_tensor(optimizer):
    values = []
    for k in range(len(optimizer.param_groups)):
        group = optimizer.param_groups[k]
        for p in group["params"]:
            if p.grad is None:
                values.append(float("nan"))
                continue
            t = float(optimizer.state[p]["step"])
            v_hat = optimizer.state[p]["exp_avg_sq"] / (1.0 - group["betas"][1] ** t)
            floor = torch.full_like(v_hat, group["eps"] ** 2)
            values.append(float(torch.sqrt(torch.mean(p.grad * p.grad / torch.maximum(v_hat, floor)))))
    return values
''',
    # torch's own AdamW steps (its state handed over), then each tensor is moved back by max(1, RMS_t)
    "stable_answer": '''
def stable_adamw_step(params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps, weight_decay):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    for p, g, m, v in zip(ps, grads, exp_avgs, exp_avg_sqs):
        p.grad = g.clone()
        opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    opt.step()
    out = []
    for p, old, g in zip(ps, params, grads):
        v_hat = opt.state[p]["exp_avg_sq"] / (1 - betas[1] ** step)
        rms = torch.sqrt(torch.mean(g**2 / torch.clamp(v_hat, min=eps**2)))
        out.append(old + (p.detach() - old) / torch.clamp(rms, min=1.0))
    return out, [opt.state[p]["exp_avg"] for p in ps], [opt.state[p]["exp_avg_sq"] for p in ps]
''',
    # one pass, a sorted window for the median, the RMS fields read through record.get
    "spike_answer": '''
def find_spike(records, threshold, factor, window):
    rms_at = loss_at = None
    for i, r in enumerate(records):
        peak = r.get("update_rms_max")
        if rms_at is None and peak is not None and not math.isnan(peak) and peak > threshold:
            rms_at = (r.get("update_rms_peak"), r.get("update_step"))
        if loss_at is None and i >= window:
            past = sorted(q.loss for q in records[i - window:i])
            middle = past[window // 2] if window % 2 else (past[window // 2 - 1] + past[window // 2]) / 2
            if r.loss > factor * middle:
                loss_at = r.step
    tensor, rms_step = rms_at if rms_at else (None, None)
    return tensor, rms_step, loss_at, bool(rms_at and loss_at is not None and rms_step < loss_at)
''',
}

BUGS = {
    # ps2
    "counts every skip as a backoff": ("read_run_answer", '''
def read_run(records, window, k):
    backoffs = [(r.step, r.reason) for r in records if r.skipped]
    norms, flagged = [], []
    for r in records:
        recent = norms[-window:]
        if len(recent) == window and math.isfinite(r.grad_norm):
            mean = sum(recent) / window
            std = math.sqrt(sum((v - mean) ** 2 for v in recent) / window)
            if std > 0 and (r.grad_norm - mean) / std > k:
                flagged.append(r.step)
        if not r.skipped and math.isfinite(r.grad_norm):
            norms.append(r.grad_norm)
    return backoffs, flagged
''', "read_run_tests", "A backoff is next_scale < scale, not skipped=True"),
    "subnormals counted as flushed": ("fp16_range_answer", '''
def fp16_range(grads, scale):
    g = torch.cat([t.flatten() for t in grads]) * scale
    flushed = ((g != 0) & (g.abs() < 2.0**-14)).float().mean().item()
    overflowed = torch.isinf(g.half()).float().mean().item()
    return flushed, overflowed
''', "fp16_range_tests", "you counted fp16's subnormals as flushed"),
    "a NaN enters the z-score statistics": ("zclip_answer", '''
class ZScoreClipper:
    def __init__(self, alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6):
        self.alpha, self.z_thresh, self.warmup, self.eps = alpha, z_thresh, warmup, eps
        self.mean, self.var = torch.zeros(()), torch.zeros(())
        self.buffer, self.count = torch.zeros(warmup), torch.zeros((), dtype=torch.long)

    def clip_(self, parameters):
        parameters = [p for p in parameters if p.grad is not None]
        norm = labkit.grad_norm(parameters)
        warm = self.count >= self.warmup
        std = self.var.sqrt()
        z = (norm - self.mean) / (std + self.eps)
        clip = warm & (z > self.z_thresh)
        limit = torch.where(clip, self.mean + self.z_thresh**2 / z * std, norm)
        coef = torch.where(clip, torch.clamp(limit / (norm + 1e-6), max=1.0), torch.ones_like(norm))
        for p in parameters:
            p.grad.mul_(coef)
        slot = torch.arange(self.warmup) == self.count
        self.buffer = torch.where(slot & ~warm, limit, self.buffer)
        count = self.count + 1
        full = ~warm & (count == self.warmup)
        ema_mean = self.alpha * self.mean + (1 - self.alpha) * limit
        ema_var = self.alpha * self.var + (1 - self.alpha) * (limit - ema_mean) ** 2
        buffer_mean = self.buffer.mean()
        self.mean = torch.where(full, buffer_mean, torch.where(warm, ema_mean, self.mean))
        buffer_var = ((self.buffer - buffer_mean) ** 2).mean()
        self.var = torch.where(full, buffer_var, torch.where(warm, ema_var, self.var))
        self.count = torch.where(warm, self.count, count)
        return norm

    def state_dict(self):
        return {"mean": self.mean, "var": self.var, "buffer": self.buffer, "count": self.count}

    def load_state_dict(self, state):
        self.mean, self.var = state["mean"], state["var"]
        self.buffer, self.count = state["buffer"], state["count"]
''', "zclip_tests", "statistics moved on a NaN/inf step"),
    "skipped spikes enter the window": ("detector_answer", '''
class RollingDetector:
    def __init__(self, window=128, skip_z=6.0, clip_z=None):
        self.window, self.skip_z, self.clip_z = window, skip_z, clip_z
        self.losses, self.norms = [], []

    def decide(self, loss, norm):
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return "skip", None
        z_loss, z_norm = self._z(self.losses, loss), self._z(self.norms, norm)
        action, limit = "log", None
        if self.skip_z is not None and (z_loss > self.skip_z or z_norm > self.skip_z):
            action = "skip"
        elif self.clip_z is not None and z_norm > self.clip_z:
            values = self.norms[-self.window:]
            mean = sum(values) / len(values)
            limit = mean + self.clip_z * math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            action, norm = "clip", limit
        self.losses.append(loss)
        self.norms.append(norm)
        return action, limit

    def _z(self, history, x):
        values = history[-self.window:]
        if len(values) < self.window // 2:
            return math.nan
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if std == 0:
            return 0.0 if x == mean else math.copysign(math.inf, x - mean)
        return (x - mean) / std
''', "detector_tests", "a skipped spike entered your window"),
    "measures the gradient, not the update": ("clip_effect_answer", '''
def clip_effect(fresh, loss_fn, inputs, targets, max_norm):
    model, optimizer = fresh()
    optimizer.zero_grad()
    loss_fn(model(inputs), targets).backward()
    before = labkit.grad_norm(model.parameters())
    labkit.clip_grad_norm_(model.parameters(), max_norm)
    return (labkit.grad_norm(model.parameters()) / before).item()
''', "clip_effect_tests", "that is what clipping did to the gradient"),
    # ps3
    "a tie never rounds away": ("stale_answer", '''
def lost_fraction(update, weight):
    toward = torch.where(update >= 0, math.inf, -math.inf).to(weight.dtype)
    half = (torch.nextafter(weight, toward).double() - weight.double()).abs() / 2
    lost = update.double().abs() < half
    moving = update != 0
    return (lost & moving).sum().item() / max(moving.sum().item(), 1)
''', "stale_tests", "a tie rounds to even: it is lost when the weight's last bit is even"),
    "the compensation's sign is flipped": ("kahan_answer", '''
def kahan_update(weight, update, compensation):
    y = update.float() + compensation.float()
    new = (weight.float() + y).to(torch.bfloat16)
    return new, ((new.float() - weight.float()) - y).to(torch.bfloat16)
''', "kahan_tests", "the compensation has the wrong sign"),
    "one scale for the whole tensor": ("fp8_answer", '''
def quantize_tiles(x, previous_scale):
    amax = x.abs().max()
    if not torch.isfinite(amax):
        raise ValueError("NaN or inf")
    scale = torch.full(previous_scale.shape, (amax / 448).item())
    data = (x / (amax / 448)).clamp(-448, 448).to(torch.float8_e4m3fn)
    flushed = ((x != 0) & (data.float() == 0)).float().mean().item()
    return data, scale, 0.0, flushed
''', "fp8_tests", "one scale for the whole tensor"),
    "this step's amax is already in the history": ("delayed_answer", '''
def saturation(steps, history):
    amaxes, delayed, current = [], [], []
    for x in steps:
        amax = x.abs().max()
        amaxes.append(amax)
        limit = max(amaxes[-history:])
        delayed.append(int((x.abs() > limit).sum()))
        current.append(int((x.abs() > amax).sum()))
    return delayed, current
''', "delayed_tests", "this step's amax was already in the history"),
    # ps4
    "v_hat without its bias correction": ("rms_answer", '''
def update_rms_per_tensor(optimizer):
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                out.append(math.nan)
                continue
            v = optimizer.state[p]["exp_avg_sq"]
            out.append((p.grad**2 / v.clamp(min=group["eps"] ** 2)).mean().sqrt())
    return out
''', "rms_tests", "v_hat is the bias-corrected second moment"),
    "the weight decay with the unclipped lr": ("stable_answer", '''
def stable_adamw_step(params, grads, exp_avgs, exp_avg_sqs, step, lr, betas, eps, weight_decay):
    beta1, beta2 = betas
    out = ([], [], [])
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
        rms = (g * g / v_hat.clamp(min=eps**2)).mean().sqrt()
        p = p * (1 - lr * weight_decay) - lr / rms.clamp(min=1.0) * m_hat / (v_hat.sqrt() + eps)
        for kept, t in zip(out, (p, m, v)):
            kept.append(t)
    return out
''', "stable_tests", "the weight decay is scaled by the clipped lr too"),
    "the RMS spike read at record.step": ("spike_answer", '''
def find_spike(records, threshold, factor, window):
    first = next((r for r in records if r.update_rms_max > threshold), None)
    tensor, rms_step = (first.update_rms_peak, first.step) if first else (None, None)
    losses = [r.loss for r in records]
    loss_step = next((records[i].step for i in range(window, len(records))
                      if losses[i] > factor * statistics.median(losses[i - window:i])), None)
    both = rms_step is not None and loss_step is not None
    return tensor, rms_step, loss_step, both and rms_step < loss_step
''', "spike_tests", "the monitor's fields are one record late"),
}
