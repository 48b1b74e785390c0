"""labkit/tasks/gpt.py as it was before the stability options (main at 1372201), kept verbatim as an oracle.

tests/test_instabilities.py runs it next to today's GPTTask: with every option off, the records must be
bitwise the same. Only the import of TextCorpus is absolute. Do not edit.
"""
# ruff: noqa: E501


from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from labkit.tasks.text import TextCorpus

__all__ = ["GPT", "GPTTask"]


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer: token ids ``(B, T)`` in, next-token logits ``(B, T, vocab)`` out.

    >>> m = GPT(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8)
    >>> m(torch.zeros(3, 5, dtype=torch.long)).shape
    torch.Size([3, 5, 10])
    """

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head}).")
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, its gradient the sum of both uses
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if self.block_size < T:
            raise ValueError(f"sequence of length {T} is longer than block_size={self.block_size}.")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy, computed in float32 (the fp16 logits are upcast, as nanoGPT's are)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass(frozen=True)
class GPTTask:
    """Next-byte prediction on the stdlib's source: ``model(device)``, ``batch(step, device)``, ``loss_fn``.

    The defaults fit the CPU: fp16 has no native arithmetic on most CPUs (a matmul is tens of
    times slower than in fp32), so the model is tiny; ``GPTTask.for_device("cuda")`` is bigger.

    >>> task = GPTTask(seed=0)
    >>> x, y = task.batch(0); tuple(x.shape), bool((x[:, 1:] == y[:, :-1]).all())
    ((8, 32), True)
    >>> torch.equal(task.batch(5)[0], GPTTask(seed=0).batch(5)[0])
    True
    """

    name: ClassVar[str] = "gpt"
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32
    batch_size: int = 8
    seed: int = 0
    corpus: TextCorpus = field(default_factory=TextCorpus)

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
        """Return a freshly initialised GPT; the same seed gives the same weights."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            net = GPT(self.corpus.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd)
        return net.to(device)

    @property
    def loss_fn(self):  # type: ignore[no-untyped-def]
        return cross_entropy

    def batch(self, step: int, device: str | torch.device = "cpu", split: str = "train") -> tuple[Tensor, Tensor]:
        """Return ``(inputs, targets)``: ``batch_size`` windows of ``block_size`` bytes, targets shifted by one."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}.")
        data = self.corpus.train if split == "train" else self.corpus.val
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + (0 if split == "train" else 500_000_009))
        starts = torch.randint(0, len(data) - self.block_size - 1, (self.batch_size,), generator=g)
        offsets = starts[:, None] + torch.arange(self.block_size + 1)
        windows = data[offsets]
        return windows[:, :-1].to(device), windows[:, 1:].to(device)

    @torch.no_grad()
    def val_loss(self, model: nn.Module, device: str | torch.device | None = None, batches: int = 4) -> float:
        """Return the mean loss on ``batches`` fixed validation batches, in fp32 (one host sync)."""
        device = device if device is not None else next(model.parameters()).device
        was_training = model.training
        model.eval()
        total = sum(self.loss_fn(model(x), y) for x, y in (self.batch(i, device, "val") for i in range(batches)))
        model.train(was_training)
        return float(total) / batches
