"""Deterministic synthetic token data and verl's data loader (torchdata StatefulDataLoader, drop_last)."""

from __future__ import annotations

from harness.config import TrainConfig

WINDOW_SLACK = 4  # extra tokens per sample: each rank picks a window offset from its numpy and python RNGs


class SyntheticTokens:
    """Arithmetic token progressions mod V with 10 % noise: learnable, so the loss curve falls, and a pure
    function of (seed, index), so every restart sees the same sample for the same index."""

    def __init__(self, *, size: int, seq_len: int, vocab: int, seed: int) -> None:
        self.size, self.length, self.vocab, self.seed = size, seq_len + WINDOW_SLACK, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        low = 4  # ids below 4 are the tokenizer's special tokens
        start = torch.randint(low, self.vocab, (1,), generator=g)
        stride = torch.randint(1, 8, (1,), generator=g)
        seq = low + (start - low + stride * torch.arange(self.length)) % (self.vocab - low)
        noise = torch.rand(self.length, generator=g) < 0.1
        return torch.where(noise, torch.randint(low, self.vocab, (self.length,), generator=g), seq)


def build_loader(cfg: TrainConfig):
    """One loader on rank 0, as verl's driver holds one; its state_dict() is data.pt."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    dataset = SyntheticTokens(size=cfg.dataset_size, seq_len=cfg.seq_len, vocab=cfg.vocab, seed=cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    return StatefulDataLoader(
        dataset,
        batch_size=cfg.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=cfg.num_workers,
        generator=generator,
    )


class BatchStream:
    """Endless batches over epochs; rank 0 reads the loader, every rank receives the same global batch."""

    def __init__(self, cfg: TrainConfig, rank: int, device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.loader = build_loader(cfg) if rank == 0 else None
        self._it = None

    def next_global(self):
        import torch
        import torch.distributed as dist

        buf = torch.empty(self.cfg.batch_size, self.cfg.seq_len + WINDOW_SLACK, dtype=torch.int64)
        if self.loader is not None:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:  # epoch boundary: a new epoch reshuffles from the sampler's saved generator
                self._it = iter(self.loader)
                batch = next(self._it)
            buf.copy_(batch)
        buf = buf.to(self.device)
        dist.broadcast(buf, src=0)
        return buf

    def state_dict(self):
        return self.loader.state_dict() if self.loader is not None else None

    def load_state_dict(self, state) -> None:
        if self.loader is not None:
            self.loader.load_state_dict(state)
            self._it = None
