import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autosp.harness.config import DataConfig
from autosp.models import build_model, get_preset
from autosp.models.data import make_batch
from autosp.compiler.sp.attention.masked_attention import run_program
from autosp.models.llama import (
    ATTENTION_MASK_PROGRAM,
    LlamaForCausalLM,
    attention_from_mask_rows,
    attention_mask_rows,
    build_attention_mask,
    sdpa_attention,
)

SEQ = 32

PLAIN = DataConfig()


def tiny_batch(data=PLAIN, seed=0):
    return make_batch(data, batch_size=2, seq_len=SEQ, vocab_size=512, seed=seed)


def test_loss_is_hf_style_shifted_token_mean():
    model = build_model("tiny")
    b = tiny_batch(DataConfig(ignore_fraction=0.3))
    out = model(**b.model_kwargs())
    assert out.logits.shape == (2, SEQ, 512)
    # By hand: position t predicts label t+1; -100 targets are dropped; mean over the rest.
    logits, targets = out.logits[:, :-1].reshape(-1, 512), b.labels[:, 1:].reshape(-1)
    keep = targets != -100
    per_token = F.cross_entropy(logits[keep], targets[keep], reduction="none")
    assert keep.sum() == b.num_valid_labels() < 2 * (SEQ - 1)
    torch.testing.assert_close(out.loss, per_token.mean())
    # Sum over the valid tokens divided by a caller's count (the global token count under SP/DP).
    summed = model(**b.model_kwargs(), num_items_in_batch=torch.tensor(7)).loss
    torch.testing.assert_close(summed, per_token.sum() / 7)
    assert model(b.input_ids).loss is None


def test_seeded_init_is_deterministic_and_dtype_keeps_rope_fp32():
    a, b, c = build_model("tiny", seed=3), build_model("tiny", seed=3), build_model("tiny", seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        assert name.endswith("norm.weight") or not torch.equal(pa, pc)
    assert a.model.layers[0].input_layernorm.weight.eq(1).all()
    assert a.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    half = build_model("tiny", seed=3, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(half.lm_head.weight.float(), a.lm_head.weight, atol=1e-3, rtol=1e-2)


def test_tied_embeddings_share_one_tensor():
    model = LlamaForCausalLM(dataclasses.replace(get_preset("tiny"), tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert build_model("llama-3.2-1b", device="meta").lm_head.weight.is_meta


def test_tiny_loss_falls_with_adamw():
    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    b = tiny_batch()
    losses = []
    for _ in range(5):
        loss = model(**b.model_kwargs()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_packed_row_equals_documents_run_alone():
    model = build_model("tiny-mha").eval()
    ids = torch.randint(0, 512, (1, SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(12), torch.arange(SEQ - 12)])[None]
    packed = model(ids, position_ids=positions).logits
    first, second = model(ids[:, :12]).logits, model(ids[:, 12:]).logits
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1), atol=1e-5, rtol=1e-5)


def test_right_padding_leaves_real_tokens_unchanged():
    model = build_model("tiny").eval()
    b = tiny_batch(DataConfig(pad_fraction=0.25))
    real = SEQ - 8
    padded = model(b.input_ids, attention_mask=b.attention_mask).logits[:, :real]
    alone = model(b.input_ids[:, :real]).logits
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "data", [DataConfig(), DataConfig(packed_documents=3), DataConfig(pad_fraction=0.25, ignore_fraction=0.2)]
)
def test_compiles_fullgraph_with_aot_eager(data):
    torch._dynamo.reset()
    model = build_model("tiny", seed=1)
    b = tiny_batch(data)
    eager = model(**b.model_kwargs())
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**b.model_kwargs())
    torch.testing.assert_close(compiled.loss, eager.loss)
    torch.testing.assert_close(compiled.logits, eager.logits)
    compiled.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_attention_from_mask_rows_is_attention_under_the_dense_mask(pad_side):
    """The O(S) rows + ATTENTION_MASK_PROGRAM (what hand-written SP baselines run) give the dense mask's attention."""
    b = tiny_batch(DataConfig(packed_documents=3, pad_fraction=0.25, pad_side=pad_side))
    rows = attention_mask_rows(b.position_ids, b.attention_mask)
    dense = build_attention_mask(b.position_ids, b.attention_mask)
    assert torch.equal(run_program(ATTENTION_MASK_PROGRAM, rows), dense) and max(r.numel() for r in rows) == 2 * SEQ
    q, k, v = torch.randn(2, 4, SEQ, 16), torch.randn(2, 2, SEQ, 16), torch.randn(2, 2, SEQ, 16)
    torch.testing.assert_close(attention_from_mask_rows(q, k, v, rows), sdpa_attention(q, k, v, dense))
