"""A small GPT on real text: nanoGPT's shape, byte-level, on the Python standard library's source.

The model is nanoGPT's (Karpathy, github.com/karpathy/nanoGPT, model.py): token and position
embeddings, pre-norm blocks of causal self-attention (``F.scaled_dot_product_attention``) and
a GELU MLP, a final LayerNorm and a head whose weight is the token embedding's (weight tying),
initialised N(0, 0.02) with the residual projections at 0.02 / sqrt(2 * n_layer). Batches are
random windows of the training split, a pure function of ``(seed, step)``.

The mitigations of the large-scale instabilities that Wortsman et al. 2023 (*Small-scale proxies
for large-scale Transformer training instabilities*, arXiv 2309.14322) reproduce in small models
are options of ``GPTTask``, each off by default (off, the model and its records are today's):

- ``qk_norm``: LayerNorm on each head's queries and keys before the dot product (Dehghani et al.
  2023, *Scaling Vision Transformers to 22 Billion Parameters*; OLMo 2 uses it);
- ``z_loss``: PaLM's auxiliary loss ``coef * mean(log(Z)**2)`` on the output logits (Chowdhery et
  al. 2022, 1e-4), which pulls log Z, the log of the softmax's normaliser, towards 0;
- ``logit_softcap`` and ``attn_softcap``: ``cap * tanh(x / cap)`` on the output logits and on
  the attention logits (Gemma 2: 30 and 50);
- ``attention="explicit"``: the attention logits ``q @ k.T / sqrt(d)`` formed as a tensor
  (nanoGPT's path without flash attention) instead of SDPA's fused kernel. Under fp16 autocast
  that tensor is fp16 and overflows past 65504; SDPA's CPU and flash kernels accumulate in fp32
  and do not;
- ``tie_head=False``: an output head with its own weight, as in Wortsman et al.'s models (§2.1:
  "We do not use weight tying of the first and last layer"), the setting of their output-logit
  divergence (§3.1.2). Tied (nanoGPT's default), the head is the token embedding, whose rows
  every input also pulls on.

Every training forward also measures, on the device and without a gradient, what those
mitigations act on: the largest attention logit of each layer (the max of ``q.k / sqrt(d)``
before the softmax), the attention entropy of each layer's worst (most peaked) head, and the
mean log Z of the output logits. ``LogitMonitor`` writes them onto each ``StepRecord``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed import all_reduce_, is_distributed
from ..hooks import Hook
from ..records import Field, put
from ..validate import check_int
from .perturb import perturb_
from .text import TextCorpus

__all__ = ["ATTENTION", "GPT", "GPTTask", "LogitMonitor", "cross_entropy", "cross_entropy_with_z_loss",
           "softcap"]

ATTENTION = ("sdpa", "explicit")


def softcap(x: Tensor, cap: float) -> Tensor:
    """Return ``cap * tanh(x / cap)``: ``x`` where ``|x| << cap``, never beyond ``cap`` (Gemma 2).

    >>> softcap(torch.tensor([1.0, 1e4, -1e4]), 30.0)
    tensor([  0.9996,  30.0000, -30.0000])
    """
    return cap * torch.tanh(x / cap)


def _causal(T: int, device: torch.device) -> Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril_()


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, qk_norm: bool = False, softcap: float | None = None,
                 attention: str = "sdpa") -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        # LayerNorm over each head's dimension (Dehghani et al. 2023): the logits are then bounded
        # by the norms' gains, which grow slowly, instead of by the weights' product
        self.q_norm = nn.LayerNorm(n_embd // n_head) if qk_norm else None
        self.k_norm = nn.LayerNorm(n_embd // n_head) if qk_norm else None
        self.softcap, self.attention = softcap, attention
        self.measure = True
        self.stats: Tensor | None = None  # [largest logit, worst head's entropy] since the last read

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        measure = self.measure and self.training
        if self.attention == "explicit":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # nanoGPT's order: scaled after
            if self.softcap is not None:
                att = softcap(att, self.softcap)
            att = att.masked_fill(~_causal(T, x.device), float("-inf"))
            probs = F.softmax(att, dim=-1)
            if measure:
                self._observe(att, probs)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if measure:
                # SDPA keeps its logits inside the kernel: form them again on the side, in fp32
                # (an extra q @ k.T and softmax per layer, no gradient); the forward is untouched
                with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                    att = (q.float() @ k.float().transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
                    att = att.masked_fill(~_causal(T, x.device), float("-inf"))
                    self._observe(att, F.softmax(att, dim=-1))
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))

    @torch.no_grad()
    def _observe(self, att: Tensor, probs: Tensor) -> None:
        # the largest logit over every head and unmasked position (NaN and inf show as they are);
        # each head's entropy averaged over batch and positions, of the most peaked head
        top = att.amax().float()
        entropy = torch.special.entr(probs.float()).sum(-1).mean((0, 2)).amin()
        now = torch.stack([top, entropy])
        if self.stats is None:
            self.stats = now
        else:  # several forwards between two reads (gradient accumulation): the worst of them
            before = self.stats
            self.stats = torch.stack([torch.maximum(before[0], now[0]), torch.minimum(before[1], now[1])])


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, **attention: Any) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, **attention)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer: token ids ``(B, T)`` in, next-token logits ``(B, T, vocab)`` out.

    ``measurements()`` returns what the training forwards since the last call measured.

    >>> m = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> m(torch.zeros(3, 5, dtype=torch.long)).shape
    torch.Size([3, 5, 10])
    >>> m.measurements().shape  # per layer: largest logit, worst head's entropy; then log Z, log Z**2
    torch.Size([4])
    """

    def __init__(
        self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, *,
        qk_norm: bool = False, attn_softcap: float | None = None, logit_softcap: float | None = None,
        attention: str = "sdpa", tie_head: bool = True,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head}).")
        _check_attention(attention, attn_softcap)
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        options = {"qk_norm": qk_norm, "softcap": attn_softcap, "attention": attention}
        self.h = nn.ModuleList(Block(n_embd, n_head, **options) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_head:
            self.lm_head.weight = self.wte.weight  # tied: one tensor, its gradient the sum of both uses
        self.logit_softcap = logit_softcap
        # the norms' gains (dim 1) keep their 1: no draw, same init; an untied head comes last in
        # named_parameters, so its N(0, 0.02) draw leaves every other weight as the tied model's
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
        # [sum of mean log Z, sum of mean log Z**2, forwards] since the last read
        self.log_z: Tensor | None = None
        self._measure = True

    @property
    def measure(self) -> bool:
        """Whether training forwards measure the logits (on by default; off, they cost nothing)."""
        return self._measure

    @measure.setter
    def measure(self, on: bool) -> None:
        self._measure = bool(on)
        for block in self.h:
            block.attn.measure = self._measure

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if self.block_size < T:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.block_size}.")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if self.logit_softcap is not None:
            logits = softcap(logits, self.logit_softcap)
        if self.training and self._measure:
            with torch.no_grad():  # one logsumexp over (B, T, vocab) in fp32, what the loss computes too
                lse = logits.float().logsumexp(-1)
                now = torch.stack([lse.mean(), lse.square().mean(), torch.ones((), device=lse.device)])
                self.log_z = now if self.log_z is None else self.log_z + now
        return logits

    def measurements(self, reset: bool = True) -> Tensor:
        """Return one float32 tensor: per layer the largest attention logit, per layer the worst head's
        entropy (nats), then the mean log Z and the mean log Z**2 of the output logits.

        Over the training forwards since the last call (the max and min of several, the mean of
        log Z); NaN where none measured. Stays on the device: read it once (``.tolist()``).
        """
        blocks = [b.attn for b in self.h]
        nan = torch.full((2,), math.nan, device=self.wte.weight.device)
        per_layer = torch.stack([a.stats if a.stats is not None else nan for a in blocks])
        log_z = self.log_z[:2] / self.log_z[2] if self.log_z is not None else nan
        if reset:
            self.reset_measurements()
        return torch.cat([per_layer[:, 0], per_layer[:, 1], log_z.to(per_layer)])

    def reset_measurements(self) -> None:
        """Forget what the training forwards measured since the last read (no device work)."""
        for block in self.h:
            block.attn.stats = None
        self.log_z = None


def _check_attention(attention: str, attn_softcap: float | None) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {list(ATTENTION)}, got {attention!r}.")
    if attn_softcap is not None and attention != "explicit":
        raise ValueError("attn_softcap caps the attention logits, which SDPA's fused kernel never forms: "
                         "pass attention='explicit' with it.")


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy, computed in float32 (the fp16 logits are upcast, as nanoGPT's are)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def cross_entropy_with_z_loss(logits: Tensor, targets: Tensor, coef: float) -> Tensor:
    """Return the cross-entropy plus PaLM's z-loss ``coef * mean(log(Z)**2)`` (Chowdhery et al. 2022, §5).

    ``log Z = logsumexp(logits)`` is the log of the softmax's normaliser. The cross-entropy does
    not depend on it (a constant added to every logit cancels), so nothing stops it drifting; the
    z-loss pulls it to 0, where the logits are the log-probabilities. PaLM and Wortsman et al. use 1e-4.

    >>> logits, targets = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    >>> z = logits.float().logsumexp(-1).square().mean()
    >>> with_z = cross_entropy_with_z_loss(logits, targets, 1e-4)
    >>> torch.allclose(with_z, cross_entropy(logits, targets) + 1e-4 * z)
    True
    """
    flat = logits.flatten(0, 1).float()
    return F.cross_entropy(flat, targets.flatten()) + coef * flat.logsumexp(-1).square().mean()


class LogitMonitor(Hook):
    """Put a GPT's logit measurements on each ``StepRecord``: a hook, ``TrainStep(hooks=[monitor])``.

    ``post_backward`` returns what the step's training forwards measured (``model.measurements()``)
    as record fields: ``attn_logit_max`` and ``attn_entropy`` per layer (``{"h.<i>": value}``),
    ``log_z`` and ``log_z_sq``. They are 0-dim device tensors that the step reads with its own
    numbers (``2 * n_layer + 2`` more in its one host read, no sync of their own). ``on_record``
    sets ``ce_loss``, the loss less its z-loss term ``z_loss * log_z_sq`` (host arithmetic; the
    loss itself without z-loss). Every step is measured, a skipped one too: an attention logit of
    ``inf`` on a step whose loss is not finite is an fp16 forward overflow. ``pre_step`` forgets
    what forwards outside the step measured. Under ``torch.distributed`` every rank records the
    same: the largest logit (that of the global batch), the lowest entropy (the most peaked head
    of any rank's shard) and the mean log Z, reduced over the ranks in two all-reduces.

    >>> task = GPTTask(n_layer=1, n_embd=16, block_size=8, batch_size=2); model = task.model()
    >>> _ = model(task.batch(0)[0])  # a training forward measures, on the device
    >>> sorted(LogitMonitor(model).post_backward(None, 0))
    ['attn_entropy/h.0', 'attn_logit_max/h.0', 'log_z', 'log_z_sq']
    """

    # per layer the largest attention logit and the entropy of the most peaked head, the output logits'
    # mean log Z and mean log Z**2 (the z-loss term is its coefficient times that), and the cross-entropy
    # (the loss less its z-loss term); None or empty when not measured
    record_fields = {"attn_logit_max": Field({}, per_layer=True), "attn_entropy": Field({}, per_layer=True),
                     "log_z": Field(None), "log_z_sq": Field(None), "ce_loss": Field(None)}

    def __init__(self, model: GPT, z_loss: float = 0.0, process_group: Any = None) -> None:
        if not isinstance(model, GPT):
            raise TypeError(f"LogitMonitor measures a labkit GPT (GPTTask.model()), got "
                            f"{type(model).__name__}.")
        self.model, self.z_loss, self.process_group = model, z_loss, process_group
        n = len(model.h)
        self.names = [*(f"attn_logit_max/h.{i}" for i in range(n)),
                      *(f"attn_entropy/h.{i}" for i in range(n)), "log_z", "log_z_sq"]

    def pre_step(self, trainer: Any, step: int) -> None:
        self.model.reset_measurements()

    def post_backward(self, trainer: Any, step: int) -> dict[str, Tensor]:
        # Costs no host sync: 0-dim device tensors that the step copies with its own numbers in its one
        # read (``2 * n_layer + 2`` floats more). The device work is the forwards' (under SDPA a q @ k.T
        # and a softmax per layer again in fp32, and a logsumexp of the logits) and a cat here.
        values = self.model.measurements()
        if is_distributed():  # the worst over the ranks and the mean log Z: two small all-reduces
            n = len(self.model.h)
            worst = torch.cat([values[:n], -values[n:2 * n]])  # a min is the max of the negated
            all_reduce_(worst, "max", self.process_group)
            means = all_reduce_(values[2 * n:].clone(), "sum", self.process_group)
            values = torch.cat([worst[:n], -worst[n:], means / dist.get_world_size(self.process_group)])
        return dict(zip(self.names, values.unbind()))

    def on_record(self, trainer: Any, record: Any) -> None:
        z = record.log_z_sq
        put(record.fields, "ce_loss",
            record.loss - self.z_loss * z if self.z_loss and z is not None else record.loss)


@dataclass(frozen=True)
class GPTTask:
    """Next-byte prediction on the stdlib's source: ``model(device)``, ``batch(step, device)``, ``loss_fn``.

    The defaults fit the CPU: fp16 has no native arithmetic on most CPUs (a matmul is tens of
    times slower than in fp32), so the model is tiny; ``GPTTask.for_device("cuda")`` is bigger.
    ``qk_norm``, ``z_loss``, ``logit_softcap``, ``attn_softcap``, ``attention`` and ``tie_head``
    are the stability options (see the module's docstring), each off by default (``tie_head=True``:
    nanoGPT's tied head); ``measure=False``
    leaves the logit measurements out (they never change the forward's values).

    >>> task = GPTTask(seed=0)
    >>> x, y = task.batch(0); tuple(x.shape), bool((x[:, 1:] == y[:, :-1]).all())
    ((8, 32), True)
    >>> torch.equal(task.batch(5)[0], GPTTask(seed=0).batch(5)[0])
    True
    >>> GPTTask(qk_norm=True, z_loss=1e-4).model().h[0].attn.q_norm
    LayerNorm((16,), eps=1e-05, elementwise_affine=True, bias=True)
    >>> untied = GPTTask(tie_head=False).model(); untied.lm_head.weight is untied.wte.weight
    False
    """

    name: ClassVar[str] = "gpt"
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32
    batch_size: int = 8
    seed: int = 0
    corpus: TextCorpus = field(default_factory=TextCorpus)
    qk_norm: bool = False
    z_loss: float = 0.0
    logit_softcap: float | None = None
    attn_softcap: float | None = None
    attention: str = "sdpa"
    tie_head: bool = True
    measure: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size"):
            check_int(name, getattr(self, name), 1)
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}).")
        for name in ("qk_norm", "tie_head", "measure"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        z = self.z_loss
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not (math.isfinite(z) and z >= 0):
            raise ValueError(f"z_loss is the coefficient of PaLM's z-loss, a finite number >= 0 (1e-4 in "
                             f"PaLM; 0 turns it off), got {z!r}.")
        for name in ("logit_softcap", "attn_softcap"):
            cap = getattr(self, name)
            if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float))
                                    or not (math.isfinite(cap) and cap > 0)):
                raise ValueError(f"{name} must be None (off) or a finite number > 0 (Gemma 2: 30 for the "
                                 f"output logits, 50 for attention), got {cap!r}.")
        _check_attention(self.attention, self.attn_softcap)

    @classmethod
    def for_device(cls, device: str | torch.device = "cpu", seed: int = 0) -> GPTTask:
        """Return the default size for ``device``: tiny on a CPU, nanoGPT's small char model on a GPU."""
        if torch.device(device).type == "cuda":
            return cls(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32, seed=seed)
        return cls(seed=seed)

    @property
    def fingerprint(self) -> str:
        """The corpus's sha256: record it with every run (``ExperimentConfig`` runs print it)."""
        return self.corpus.sha256

    def model(self, device: str | torch.device = "cpu") -> GPT:
        """Return a freshly initialised GPT; the same seed gives the same weights (qk_norm or not; and see
        ``LABKIT_PERTURB`` in ``labkit.tasks.perturb``)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = GPT(self.corpus.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd,
                      qk_norm=self.qk_norm, attn_softcap=self.attn_softcap, logit_softcap=self.logit_softcap,
                      attention=self.attention, tie_head=self.tie_head)
        net.measure = self.measure
        return perturb_(net).to(device)

    def monitor(self, model: GPT) -> LogitMonitor | None:
        """Return the hook that records ``model``'s logit measurements (None with ``measure=False``)."""
        return LogitMonitor(model, self.z_loss) if self.measure else None

    @property
    def loss_fn(self):  # type: ignore[no-untyped-def]
        if not self.z_loss:
            return cross_entropy
        return functools.partial(cross_entropy_with_z_loss, coef=self.z_loss)

    def batch(self, step: int, device: str | torch.device = "cpu",
              split: str = "train") -> tuple[Tensor, Tensor]:
        """Return ``(inputs, targets)``: ``batch_size`` windows of ``block_size`` bytes, targets one later."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}.")
        data = self.corpus.train if split == "train" else self.corpus.val
        offset = 0 if split == "train" else 500_000_009
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + offset)
        starts = torch.randint(0, len(data) - self.block_size - 1, (self.batch_size,), generator=g)
        offsets = starts[:, None] + torch.arange(self.block_size + 1)
        windows = data[offsets]
        return windows[:, :-1].to(device), windows[:, 1:].to(device)

    @torch.no_grad()
    def val_loss(self, model: nn.Module, device: str | torch.device | None = None, batches: int = 4) -> float:
        """Return the mean cross-entropy on ``batches`` fixed validation batches, in fp32 (one host sync).

        The cross-entropy alone, whatever the training loss adds (``z_loss``): the number to compare.
        """
        device = device if device is not None else next(model.parameters()).device
        was_training = model.training
        model.eval()
        batches_ = (self.batch(i, device, "val") for i in range(batches))
        total = sum(cross_entropy(model(x), y) for x, y in batches_)
        model.train(was_training)
        return float(total) / batches
