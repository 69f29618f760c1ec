"""Reference models (GPT, MLP) and the byte-level data pipeline."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from fzero.data import VOCAB_SIZE, batch_at, batches, load_corpus, train_val_split
from fzero.models import GPT, MLP, GPTConfig, gpt_loss, num_params


@pytest.fixture(scope="module")
def corpus() -> torch.Tensor:
    return load_corpus(max_bytes=2 * 2**20)


def _gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**overrides))


# --------------------------------------------------------------------------------------------- GPT


def test_gpt_logits_shape_and_dtype():
    model = _gpt()
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)  # shorter than seq_len is fine
    assert model(idx).dtype == torch.float32


def test_gpt_forward_errors():
    model = _gpt()
    with pytest.raises(ValueError, match=r"GPT.forward: sequence length 17 exceeds cfg.seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"GPT.forward: idx must be \(batch, time\).*\(16,\)"):
        model(torch.zeros(16, dtype=torch.long))
    with pytest.raises(TypeError, match=r"GPT\(cfg\): expected a GPTConfig, got dict"):
        GPT({"n_layer": 2})


def test_gpt_config_validation():
    with pytest.raises(ValueError, match=r"d_model=30 is not divisible by n_head=4"):
        GPTConfig(n_layer=1, n_head=4, d_model=30)
    with pytest.raises(ValueError, match=r"n_layer=0 must be a positive int"):
        GPTConfig(n_layer=0, n_head=1, d_model=8)
    with pytest.raises(TypeError):
        GPTConfig(256, 128, 2, 2, 32)  # keyword-only
    cfg = GPTConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layer = 3
    assert GPTConfig.tiny(n_layer=3).n_layer == 3


def test_gpt_reference_configs():
    with torch.device("meta"):  # no memory: the reference model is 218M parameters
        big = GPT(GPTConfig.ref218m())
    assert num_params(big) == 218_260_480
    cfg = big.cfg
    assert (cfg.n_layer, cfg.d_model, cfg.vocab_size, cfg.seq_len) == (12, 1024, 32768, 128)
    assert num_params(GPT(GPTConfig.tiny())) < 50_000
    assert num_params(GPT(GPTConfig.small())) < 2_000_000


def test_gpt_is_causal():
    model = _gpt()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    t = 9
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])  # and the change does reach positions >= t


def test_gpt_head_is_tied_to_token_embedding():
    model = _gpt()
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and not any("lm_head" in n for n in names)
    assert len(names) == len(set(id(p) for p in model.parameters()))
    assert list(model.state_dict()) == names  # no buffers, no duplicate key for the head
    # Both uses (input embedding and head) send gradient into the one parameter.
    loss = gpt_loss(model(torch.tensor([[1, 2] * 8, [3, 4] * 8])), torch.randint(0, 256, (2, 16)))
    loss.backward()
    # Only 4 of 256 rows are looked up as inputs, but as the head every row gets gradient.
    assert (model.tok_emb.weight.grad.abs().sum(dim=1) > 0).all()

    untied = _gpt(tie_embeddings=False)
    assert num_params(untied) == num_params(model) + 256 * 32
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_gpt_init_is_deterministic_and_scaled():
    a, b, c = _gpt(0), _gpt(0), _gpt(1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)

    torch.manual_seed(0)
    small = GPT(GPTConfig.small())  # large enough for the sample std to be close
    residual = 0.02 / math.sqrt(2 * small.cfg.n_layer)
    assert small.blocks[0].attn.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert small.blocks[0].mlp.down.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert small.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(small.ln_f.weight, torch.ones(128))


def test_gpt_runs_under_functional_call_and_func_grad():
    # fzero.apply is built on functional_call over a params dict keyed like named_parameters().
    model = _gpt()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))

    def loss_fn(p):
        return gpt_loss(torch.func.functional_call(model, p, (x,)), y)

    grads = torch.func.grad(loss_fn)(params)
    loss = gpt_loss(model(x), y)
    loss.backward()
    torch.testing.assert_close(loss_fn(params), loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_gpt_trains_on_stdlib_corpus(corpus):
    torch.manual_seed(0)
    cfg = GPTConfig.tiny()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _, batch in zip(range(30), batches(corpus, batch_size=16, seq_len=cfg.seq_len, seed=0)):
        loss = gpt_loss(model(batch["x"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB_SIZE), abs=0.3)  # uniform at init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


# --------------------------------------------------------------------------------------------- MLP


def test_mlp_structure_and_forward():
    torch.manual_seed(0)
    model = MLP([8, 16, 16, 4])
    kinds = [type(m) for m in model.layers]
    assert kinds == [nn.Linear, nn.GELU, nn.Linear, nn.GELU, nn.Linear]
    assert model(torch.randn(5, 8)).shape == (5, 4)
    assert num_params(model) == (8 * 16 + 16) + (16 * 16 + 16) + (16 * 4 + 4)

    tanh = MLP([8, 4], bias=False, activation=nn.Tanh)
    assert [type(m) for m in tanh.layers] == [nn.Linear] and tanh.layers[0].bias is None
    assert [type(m) for m in MLP((3, 5, 2), activation=nn.Tanh).layers] == [nn.Linear, nn.Tanh, nn.Linear]

    torch.manual_seed(0)
    again = MLP([8, 16, 16, 4])
    for pa, pb in zip(model.parameters(), again.parameters()):
        assert torch.equal(pa, pb)


def test_mlp_errors():
    with pytest.raises(ValueError, match=r"MLP\(sizes=\[8\]\): need at least an input and an output size"):
        MLP([8])
    with pytest.raises(ValueError, match=r"sizes must be positive ints; offending: \[0\]"):
        MLP([8, 0, 4])


# -------------------------------------------------------------------------------------------- data


def test_load_corpus_stdlib_is_deterministic_and_bounded(corpus):
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1
    assert len(corpus) == 2 * 2**20  # the stdlib is much larger than this, so the cap is hit exactly
    small = load_corpus(max_bytes=1000)
    assert torch.equal(small, corpus[:1000])
    assert b"import" in bytes(corpus[:100_000].tolist())


def test_load_corpus_from_file(tmp_path):
    f = tmp_path / "tiny.txt"
    f.write_bytes(b"hello, world\n" * 10)
    data = load_corpus(f)
    assert bytes(data.tolist()) == b"hello, world\n" * 10
    assert len(load_corpus(str(f), max_bytes=5)) == 5


def test_load_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"load_corpus\(path='.*nope.txt'\): does not exist; pass"):
        load_corpus(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match=r"is a directory"):
        load_corpus(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"load_corpus\(path='.*empty.txt'\): the corpus is empty"):
        load_corpus(empty)
    with pytest.raises(ValueError, match=r"load_corpus\(max_bytes=0\): must be a positive int"):
        load_corpus(max_bytes=0)


def test_train_val_split():
    data = torch.arange(100, dtype=torch.uint8)
    train, val = train_val_split(data, val_fraction=0.1)
    assert torch.equal(train, data[:90]) and torch.equal(val, data[90:])
    assert len(train_val_split(data)[1]) == 5
    with pytest.raises(ValueError, match=r"train_val_split\(val_fraction=1.5\): must be strictly between"):
        train_val_split(data, val_fraction=1.5)
    with pytest.raises(ValueError, match=r"a corpus of 10 bytes gives 0 validation bytes"):
        train_val_split(data[:10], val_fraction=0.01)


def test_batches_shapes_and_targets(corpus):
    batch = next(batches(corpus, batch_size=4, seq_len=32, seed=0))
    assert set(batch) == {"x", "y"}
    assert batch["x"].shape == batch["y"].shape == (4, 32)
    assert batch["x"].dtype == batch["y"].dtype == torch.int64
    assert torch.equal(batch["x"][:, 1:], batch["y"][:, :-1])  # y is x shifted by one


def test_batches_are_deterministic_and_resumable(corpus):
    kw = dict(batch_size=4, seq_len=16, seed=7)
    run = [b for _, b in zip(range(6), batches(corpus, **kw))]
    again = [b for _, b in zip(range(6), batches(corpus, **kw))]
    resumed = [b for _, b in zip(range(2), batches(corpus, start_step=4, **kw))]
    for a, b in zip(run, again):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    for a, b in zip(run[4:], resumed):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    assert torch.equal(batch_at(corpus, 3, **kw)["x"], run[3]["x"])
    assert not torch.equal(run[0]["x"], run[1]["x"])  # steps differ
    assert not torch.equal(run[0]["x"], next(batches(corpus, batch_size=4, seq_len=16, seed=8))["x"])
    # The global RNG is neither read nor advanced.
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    next(batches(corpus, **kw))
    assert torch.equal(torch.rand(1), expected)


def test_batches_cover_the_whole_corpus_edges():
    data = torch.arange(9, dtype=torch.uint8)  # exactly seq_len + 1: one possible window
    batch = batch_at(data, 0, batch_size=3, seq_len=8, seed=0)
    assert torch.equal(batch["x"], torch.arange(8).expand(3, 8))
    assert torch.equal(batch["y"], torch.arange(1, 9).expand(3, 8))


def test_batches_errors():
    data = torch.zeros(10, dtype=torch.uint8)
    # Checked when batches() is called, not at the first next().
    with pytest.raises(ValueError, match=r"batches\(seq_len=16\): data has 10 tokens .* seq_len \+ 1 = 17"):
        batches(data, batch_size=2, seq_len=16, seed=0)
    with pytest.raises(ValueError, match=r"batches\(batch_size=0\): must be an int >= 1"):
        batches(data, batch_size=0, seq_len=4, seed=0)
    with pytest.raises(ValueError, match=r"batches\(start_step=-1\): must be an int >= 0"):
        batches(data, batch_size=2, seq_len=4, seed=0, start_step=-1)
    with pytest.raises(ValueError, match=r"batch_at\(step=1.5\): must be an int >= 0"):
        batch_at(data, 1.5, batch_size=2, seq_len=4, seed=0)
    with pytest.raises(ValueError, match=r"batches: data must be a 1-D tensor"):
        batches(data.view(2, 5), batch_size=2, seq_len=4, seed=0)
