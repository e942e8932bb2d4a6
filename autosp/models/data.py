"""Seeded synthetic token batches (nothing can be downloaded), with the awkward cases real training data has.

Labels equal input_ids: the model shifts them inside, as HF does. The options produce what breaks naive
sequence sharding: ignored labels in uneven runs (shards hold different numbers of valid tokens), packed
documents (positions restart mid-row) and right or left padding (an attention mask).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from autosp.errors import ConfigError
from autosp.models.llama import IGNORE_INDEX

PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class DataConfig:
    """Synthetic token data (no dataset can be downloaded): seeded, reproducible on every rank."""

    ignore_fraction: float = 0.0  # fraction of label positions set to -100, in uneven runs
    packed_documents: int = 1  # >1: each row holds this many documents, position_ids restart per document
    pad_fraction: float = 0.0  # fraction of each row that is right padding (attention_mask 0, labels -100)
    pad_side: str = "right"  # right | left: where the padding of pad_fraction goes


@dataclass
class Batch:
    input_ids: Tensor  # [B, S] int64
    labels: Tensor  # [B, S] int64, unshifted, -100 = ignored
    position_ids: Tensor | None = None  # [B, S], restarting at 0 per packed document
    attention_mask: Tensor | None = None  # [B, S] int64, 0 = padding

    def to(self, device: str | torch.device) -> Batch:
        return Batch(**{k: None if v is None else v.to(device) for k, v in self._fields().items()})

    def rows(self, start: int, stop: int) -> Batch:
        """Rows start:stop, e.g. one data-parallel replica's share of the global batch."""
        return Batch(**{k: None if v is None else v[start:stop] for k, v in self._fields().items()})

    def num_valid_labels(self) -> int:
        """Tokens the shifted loss averages over: labels[:, 1:] that are not -100."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    def model_kwargs(self) -> dict[str, Tensor]:
        """Keyword arguments for model(...): only the fields that are set."""
        return {k: v for k, v in self._fields().items() if v is not None}

    def _fields(self) -> dict[str, Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _validate(data: DataConfig, batch_size: int, seq_len: int, vocab_size: int) -> int:
    """Check the options; return the number of padding tokens per row."""
    if batch_size < 1 or seq_len < 2 or vocab_size < 2:
        raise ConfigError(
            f"batch_size={batch_size}, seq_len={seq_len}, vocab_size={vocab_size}: need batch_size >= 1, "
            "seq_len >= 2 and vocab_size >= 2"
        )
    if not 0.0 <= data.ignore_fraction < 1.0:
        raise ConfigError(
            f"ignore_fraction={data.ignore_fraction} must be in [0, 1): some labels must remain"
        )
    if not 0.0 <= data.pad_fraction < 1.0:
        raise ConfigError(f"pad_fraction={data.pad_fraction} must be in [0, 1)")
    if data.pad_side not in ("right", "left"):
        raise ConfigError(f"pad_side={data.pad_side!r} must be 'right' or 'left'")
    num_pad = round(data.pad_fraction * seq_len)
    real_len = seq_len - num_pad
    if real_len < 2:
        raise ConfigError(f"pad_fraction={data.pad_fraction} leaves {real_len} real tokens per row; lower it")
    if not 1 <= data.packed_documents <= real_len:
        raise ConfigError(
            f"packed_documents={data.packed_documents} must be between 1 and the {real_len} real tokens per row"
        )
    return num_pad


def _ignored_runs(num_ignored: int, length: int, generator: torch.Generator) -> Tensor:
    """Bool [length] with exactly num_ignored True positions, laid out as runs of random, uneven lengths."""
    ignored = torch.zeros(length, dtype=torch.bool)
    while (count := int(ignored.sum())) < num_ignored:
        # A run never exceeds what is still missing, so overlaps can only undershoot, never overshoot.
        run = int(torch.randint(1, num_ignored - count + 1, (1,), generator=generator))
        start = int(torch.randint(0, length, (1,), generator=generator))
        ignored[start : start + run] = True
    return ignored


def _packed_positions(num_docs: int, real_len: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """Positions of one row holding num_docs documents of random lengths; padding continues the last one."""
    cuts = (torch.randperm(real_len - 1, generator=generator)[: num_docs - 1] + 1).sort().values.tolist()
    starts = [0, *cuts]
    ends = [*cuts, seq_len]
    return torch.cat([torch.arange(end - start) for start, end in zip(starts, ends, strict=True)])


def make_batch(data: DataConfig, *, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> Batch:
    """A reproducible batch: the same arguments give the same tensors on every rank and machine."""
    num_pad = _validate(data, batch_size, seq_len, vocab_size)
    real_len = seq_len - num_pad
    generator = torch.Generator(device="cpu").manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels = input_ids.clone()
    batch = Batch(input_ids=input_ids, labels=labels)

    if data.ignore_fraction > 0:
        num_ignored = round(data.ignore_fraction * real_len)
        for row in range(batch_size):
            labels[row, :real_len][_ignored_runs(num_ignored, real_len, generator)] = IGNORE_INDEX

    if data.packed_documents > 1:
        position_ids = torch.stack(
            [
                _packed_positions(data.packed_documents, real_len, seq_len, generator)
                for _ in range(batch_size)
            ]
        )
        labels[position_ids == 0] = (
            IGNORE_INDEX  # no loss for predicting a document's first token from the last one
        )
        batch = replace(batch, position_ids=position_ids)

    if num_pad > 0:
        input_ids[:, real_len:] = PAD_TOKEN_ID
        labels[:, real_len:] = IGNORE_INDEX
        attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        attention_mask[:, real_len:] = 0
        batch = replace(batch, attention_mask=attention_mask)
        if data.pad_side == "left":  # the same rows with the padding moved to the front
            batch = Batch(**{k: None if v is None else v.roll(num_pad, dims=1) for k, v in batch._fields().items()})
    return batch
