"""What a point of the sweep is: Wortsman et al.'s recipe, the mitigations, the learning-rate grid.

``Recipe`` is Wortsman et al.'s (2023) training recipe on a small ``GPTTask`` (every point of a
sweep shares it), ``VARIANTS`` the mitigations each point turns on, ``lr_grid`` the log-spaced
learning rates, and ``Point`` one run's settings and what it ended with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...names import FP16_MAX

if TYPE_CHECKING:
    from ...tasks.gpt import GPTTask
    from ..experiment import ExperimentConfig

__all__ = ["SCHEDULES", "VARIANTS", "Point", "Recipe", "lr_grid"]

# name -> (qk_norm, z_loss): the mitigations each variant turns on (z-loss at the recipe's coefficient)
VARIANTS: dict[str, tuple[bool, bool]] = {
    "baseline": (False, False),
    "qk_norm": (True, False),
    "z_loss": (False, True),
    "qk_norm+z_loss": (True, True),
}
SCHEDULES = ("cosine", "constant")


def lr_grid(low: float, high: float, count: int) -> list[float]:
    """Return ``count`` log-spaced learning rates from ``low`` to ``high``, rounded to 3 digits.

    >>> lr_grid(1e-4, 1, 9)
    [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0]
    """
    good_count = isinstance(count, int) and not isinstance(count, bool) and count >= 2
    if not (0 < low < high and math.isfinite(high)) or not good_count:
        raise ValueError(f"need 0 < low < high and count >= 2, got low={low!r}, high={high!r}, "
                         f"count={count!r}.")
    step = math.log10(high / low) / (count - 1)
    # 10**(k/2) is 3.16: a grid of two points a decade reads as 1, 3, 10 (the paper's plots do too)
    return [float(f"{_round3(low * 10 ** (i * step)):.3g}") for i in range(count)]


def _round3(x: float) -> float:
    mantissa = x / 10 ** math.floor(math.log10(x))
    return 3 * 10 ** math.floor(math.log10(x)) if abs(mantissa - math.sqrt(10)) < 1e-6 else x



@dataclass(frozen=True)
class Recipe:
    """What every point of a sweep shares: the model's size, steps, precision and optimizer.

    The optimizer is Wortsman et al.'s (§2.1): AdamW with beta1 0.9, beta2 0.95, eps 1e-8,
    *independent* weight decay 1e-4 (not multiplied by the peak lr: torch's ``weight_decay`` is
    ``1e-4 / lr``), linear warm-up then cosine decay, the global gradient norm clipped at 1; the
    z-loss variants use their (and PaLM's) coefficient 1e-4. Where the defaults differ from §2.1,
    on purpose or by size (each but the model's size is a field or a ``GPTTask`` option):

    - warm-up 10 % of the steps (theirs: 5e3 of 1e5 steps, 5 %; ``warmup=0.05``), and the cosine
      decays to 0 (theirs: to a minimum lr of 1e-5; over the last steps of a 300-step run the
      two differ by at most 1e-5 in the lr);
    - neither qk-layernorm nor z-loss unless the variant turns it on (their default model has
      both, and each figure ablates one: Fig. 1 is with and without qk-layernorm, z-loss on in
      both; Fig. 3 with and without z-loss, qk-layernorm on and no weight decay);
    - nanoGPT's model (``GPTTask``): biases in every linear layer and LayerNorm (theirs: none),
      a head tied to the token embedding (theirs untied: ``tie_head=False``), learned position
      embeddings (theirs: rotary), N(0, 0.02) init (theirs: the embedding N(0, 1/d), the rest a
      truncated normal of std 1/sqrt(fan-in)), LayerNorm eps 1e-5 (theirs 1e-6);
    - bytes of the stdlib's source, a 162-symbol vocabulary (theirs: C4, 32101 SentencePiece
      tokens), fp32 on a CPU (theirs: bf16 on TPUs), and a model and run far smaller: 2 layers,
      width 64, 4 heads, a 64-byte context, batches of 16, 300 steps (theirs: millions to billions
      of non-embedding parameters, Fig. 4's 2.4M to §3.3's 4.8B, batches of 256 x 512 tokens,
      1e5 steps).

    ``schedule="constant"`` holds the lr after the warm-up (their output-logit divergence comes
    "towards the end of training" of models with no weight decay, §3.1.2: ``weight_decay=0``,
    ``tie_head=False`` and many steps). ``attention="explicit"`` forms the attention logits as a
    tensor (in fp16, where they can overflow). ``triage=True`` tells a non-finite loss apart
    (``forward_overflow`` or ``nonfinite_input``, ``labkit.triage``); off by default, as the
    README's grid was run.

    >>> Recipe().config("qk_norm", lr=0.1, seed=1).task.qk_norm, Recipe().config("baseline", 0.1).weight_decay
    (True, 0.001)
    >>> paper = Recipe(tie_head=False, weight_decay=0.0, schedule="constant", warmup=0.05)
    >>> paper.config("qk_norm", 0.3).scheduler is None, paper.task("qk_norm").tie_head
    (True, False)
    """

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    batch_size: int = 16
    steps: int = 300
    precision: str = "fp32"
    attention: str = "sdpa"
    warmup: float = 0.1
    beta2: float = 0.95
    weight_decay: float = 1e-4
    max_norm: float | None = 1.0
    z_loss: float = 1e-4
    init_scale: float = 2.0**16
    val_batches: int = 16
    device: str | None = None
    triage: bool = False  # True: a non-finite loss reads forward_overflow or nonfinite_input (labkit.triage)
    tie_head: bool = True  # False: the head has its own weight, as in Wortsman et al.'s models
    schedule: str = "cosine"  # or "constant": the lr held after the warm-up

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}.")
        self.config("baseline", 1e-3)  # a bad setting raises here, in ExperimentConfig's and GPTTask's words
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"warmup is a fraction of the steps in [0, 1), got {self.warmup!r}.")
        n = self.val_batches
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"val_batches must be an int >= 1, got {self.val_batches!r}.")

    @classmethod
    def lesson(cls, device: str | None = None) -> Recipe:
        """Return the recipe lesson 07 trains live: on a CPU the GPT of lesson 04 (2 layers, width 32, 2
        heads of dimension 16, a 32-byte context, batches of 8), 250 steps; on a GPU this default size."""
        import torch

        if torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda":
            return cls(device=device)
        return cls(n_head=2, n_embd=32, block_size=32, batch_size=8, steps=250, device=device)

    @property
    def fp16_logit_limit(self) -> float:
        """The attention logit at which ``q.k`` passes fp16's 65504: ``65504 / sqrt(head dim)``.

        nanoGPT's explicit attention scales after the matmul (``(q @ k.T) / sqrt(d)``), so the
        product overflows first. SDPA's kernels scale before, and accumulate in fp32.

        >>> Recipe.lesson("cpu").fp16_logit_limit
        16376.0
        """
        return FP16_MAX / math.sqrt(self.n_embd // self.n_head)

    def task(self, variant: str, seed: int = 0) -> GPTTask:
        """Return the ``GPTTask`` of ``variant`` (a ``VARIANTS`` name) at this size and ``seed``."""
        from ...tasks import GPTTask

        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}.")
        qk_norm, z_loss = VARIANTS[variant]
        return GPTTask(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                       block_size=self.block_size, batch_size=self.batch_size, seed=seed,
                       attention=self.attention, qk_norm=qk_norm, z_loss=self.z_loss if z_loss else 0.0,
                       tie_head=self.tie_head)

    def config(self, variant: str, lr: float, seed: int = 0) -> ExperimentConfig:
        """Return the ``ExperimentConfig`` of one point of the grid."""
        from ..experiment import ExperimentConfig

        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < math.inf):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}.")
        return ExperimentConfig(
            task=self.task(variant, seed), precision=self.precision, optimizer="adamw", lr=lr,
            betas=(0.9, self.beta2), weight_decay=self.weight_decay / lr,
            warmup=int(self.warmup * self.steps),
            scheduler="cosine" if self.schedule == "cosine" else None, max_norm=self.max_norm,
            steps=self.steps, seed=seed, device=self.device,
            init_scale=self.init_scale, growth_interval=2000,
            triage=self.triage,
        )


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its settings and what it ended with.

    ``final_loss`` is the validation cross-entropy of the trained model, ``init_loss`` that of
    the untrained one; ``attn_logit_max`` the largest attention logit of the whole run (any
    layer, any step; ``inf`` if an fp16 forward overflowed), ``attn_logit_final`` that of the
    last step; ``log_z_final`` the last step's mean log Z.
    """

    variant: str
    lr: float
    seed: int
    final_loss: float
    init_loss: float
    train_loss: float
    attn_logit_max: float
    attn_logit_final: float
    log_z_final: float
    skipped: int
    first_skip: int
    clip_rate: float
    seconds: float

    @classmethod
    def from_row(cls, row: Mapping[str, str]) -> Point:
        """Read a point back from its ``sweep.csv`` row (strings)."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        def read(name: str, kind: str) -> Any:
            return row[name] if kind == "str" else int(row[name]) if kind == "int" else float(row[name])

        return cls(**{name: read(name, kind) for name, kind in kinds.items()})

