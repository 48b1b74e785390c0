"""A model shaped as nanoGPT's ``model.py`` is, and nanoGPT's ``train.py`` loop, for the tests and benchmarks.

``NanoGPT.forward(idx, targets)`` returns ``(logits, loss)`` with the loss computed inside, as
nanoGPT's does; ``configure_optimizers`` builds nanoGPT's AdamW with two parameter groups
(weight decay on the >= 2-dim tensors only); ``textbook_step`` is ``train.py``'s inner loop
(``loss / G``, ``scaler.scale(loss).backward()``, ``unscale_``, ``clip_grad_norm_`` over
``model.parameters()``, ``step``, ``update``, ``zero_grad``), with DDP's
``require_backward_grad_sync`` on the last micro-step only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from labkit.tasks.gpt import GPT

SIZE = {"vocab_size": 65, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 64}  # the 2 x 64
BATCH, G, GRAD_CLIP = 4, 4, 1.0


class NanoGPT(nn.Module):
    """nanoGPT's interface on labkit's GPT (nanoGPT's blocks): ``(idx, targets) -> (logits, loss)``."""

    def __init__(self, seed: int = 0, **size: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.transformer = GPT(**{**SIZE, **size})
        self.transformer.measure = False  # labkit's logit measurements: nanoGPT has none

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.transformer(idx)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float = 0.1, lr: float = 1e-3,
                             betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def get_batch(step: int, micro: int, rank: int = 0, batch: int = BATCH) -> dict[str, Tensor]:
    """nanoGPT's ``get_batch``: random windows of token ids, seeded by (step, micro-step, rank)."""
    gen = torch.Generator().manual_seed(100_003 * step + 1009 * micro + rank)
    data = torch.randint(SIZE["vocab_size"], (batch, SIZE["block_size"] + 1), generator=gen)
    return {"idx": data[:, :-1].contiguous(), "targets": data[:, 1:].contiguous()}


def textbook_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                  batches: list[dict[str, Tensor]], precision: str, no_sync: bool = True) -> float:
    """One optimizer step of nanoGPT's ``train.py``; return the last micro-step's loss as it logs it.

    ``no_sync=False`` leaves DDP's gradient sync on at every micro-step (what nanoGPT avoids).
    """
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    ddp = hasattr(model, "require_backward_grad_sync")
    for micro, b in enumerate(batches):
        if ddp:
            model.require_backward_grad_sync = micro == len(batches) - 1 or not no_sync
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            _, loss = model(b["idx"], b["targets"])
            loss = loss / len(batches)
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item() * len(batches)
