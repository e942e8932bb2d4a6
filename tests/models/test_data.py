import pytest
import torch

from autosp.harness.config import ConfigError, DataConfig
from autosp.models.data import Batch, make_batch

PLAIN = DataConfig()


def batch(data=PLAIN, batch_size=3, seq_len=64, seed=0):
    return make_batch(data, batch_size=batch_size, seq_len=seq_len, vocab_size=100, seed=seed)


def runs(row_mask):
    """Lengths of the runs of True in a 1-D bool tensor."""
    lengths, current = [], 0
    for value in row_mask.tolist() + [False]:
        if value:
            current += 1
        elif current:
            lengths.append(current)
            current = 0
    return lengths


def test_plain_batch_is_seeded_and_labels_equal_inputs():
    a, b, c = batch(seed=1), batch(seed=1), batch(seed=2)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert torch.equal(a.labels, a.input_ids)
    assert a.position_ids is None and a.attention_mask is None
    assert set(a.model_kwargs()) == {"input_ids", "labels"}
    assert int(a.input_ids.max()) < 100


def test_ignore_fraction_makes_uneven_runs():
    b = batch(DataConfig(ignore_fraction=0.25), seq_len=128)
    ignored = b.labels == -100
    assert ignored.sum(dim=1).tolist() == [32, 32, 32]
    lengths = [n for row in ignored for n in runs(row)]
    assert len(set(lengths)) > 1  # uneven
    assert not torch.equal(ignored[0], ignored[1])


def test_packed_documents_restart_positions():
    b = batch(DataConfig(packed_documents=4), seq_len=64)
    starts = b.position_ids == 0
    assert starts.sum(dim=1).tolist() == [4, 4, 4] and starts[:, 0].all()
    steps = b.position_ids[:, 1:] - b.position_ids[:, :-1]
    assert ((steps == 1) | (b.position_ids[:, 1:] == 0)).all()
    assert (b.labels[starts] == -100).all()  # a document's first token is not predicted from the previous one
    assert b.attention_mask is None


def test_right_padding_masks_and_ignores():
    b = batch(DataConfig(pad_fraction=0.25), seq_len=64)
    assert (b.attention_mask[:, :48] == 1).all() and (b.attention_mask[:, 48:] == 0).all()
    assert (b.labels[:, 48:] == -100).all() and (b.labels[:, :48] != -100).all()
    assert b.position_ids is None


def test_num_valid_labels_counts_shifted_labels():
    labels = torch.tensor([[-100, 1, 2, -100], [3, -100, -100, 4]])
    b = Batch(input_ids=labels.clamp(min=0), labels=labels)
    assert b.num_valid_labels() == 3  # labels[:, 0] is never a target
    padded = batch(DataConfig(pad_fraction=0.5), batch_size=2, seq_len=10)
    assert padded.num_valid_labels() == 2 * 4


def test_rows_and_to_keep_every_field():
    b = batch(DataConfig(packed_documents=2, pad_fraction=0.1), batch_size=4)
    part = b.rows(1, 3).to("cpu")
    assert part.input_ids.shape == (2, 64)
    assert torch.equal(part.position_ids, b.position_ids[1:3])
    assert torch.equal(part.attention_mask, b.attention_mask[1:3])
    assert set(part.model_kwargs()) == {"input_ids", "labels", "position_ids", "attention_mask"}


@pytest.mark.parametrize(
    "data, match",
    [
        (DataConfig(ignore_fraction=1.0), "ignore_fraction"),
        (DataConfig(pad_fraction=-0.1), "pad_fraction"),
        (DataConfig(packed_documents=0), "packed_documents"),
        (DataConfig(packed_documents=100), "packed_documents"),
    ],
)
def test_bad_options_raise_config_error(data, match):
    with pytest.raises(ConfigError, match=match):
        batch(data)
