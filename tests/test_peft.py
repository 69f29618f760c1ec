"""LoRA fine-tuning with Hugging Face's peft: trains as plain PyTorch trains the same peft model, and the adapter
comes out as peft's own tools read it (docs/migrating.md, section 5, "LoRA with peft").

``fzero.params_of(peft_model)`` is the adapter (and peft's ``modules_to_save`` copies): the frozen base model stays
in the module, which ``fzero.apply`` reads. Asserted with the zoo's reference (tests/zoo.py: torch.optim.AdamW,
DDP's semantics on two ranks) at every stage: tiny random-init Llama (``q_proj``/``v_proj``, dropout,
``bias="lora_only"``), GPT-2 (``c_attn``, a Conv1D) and a BERT classifier whose head peft trains beside the adapter;
the trained adapter written by ``save_pretrained`` and read back by ``PeftModel.from_pretrained``, merged by
``merge_and_unload``; a checkpoint resumed at another stage and world size; stage 3's units; and Hugging Face's
reentrant gradient checkpointing refused (it trained nothing, silently) where the non-reentrant default trains.

Warnings: peft 0.21 reads transformers 5's deprecated ``is_gradient_checkpointing`` when it wraps a model (a
``FutureWarning`` from peft's own code), filtered here by its text; nothing else is.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import fzero
from zoo import STEPS, Entry, _hf_loss, _seeded, _tokens, check, fzero_run, gpt2, llama, reference_run

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")]

STAGES = (0, 1, 2, 3)
MESHES = (1, 2)


def _lora_llama(**settings):
    def build():
        return peft.get_peft_model(llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **settings))
    return build


def _lora_gpt2():
    return peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))


def _lora_bert_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=64, max_position_embeddings=32, num_labels=3))
    return peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"],
                                                      lora_dropout=0.1, modules_to_save=["classifier"]))


def _classes():
    gen = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(0, 128, (4, 8), generator=gen), "labels": torch.randint(0, 3, (4,), generator=gen)}
            for _ in range(STEPS)]


ENTRIES = {
    "llama": Entry(_seeded(_lora_llama(lora_dropout=0.1, bias="lora_only")), _tokens(128, seed=1), _hf_loss, hf=True),
    "gpt2": Entry(_seeded(_lora_gpt2), _tokens(128, seed=1), _hf_loss, hf=True),
    "bert_classifier": Entry(_seeded(_lora_bert_classifier), _classes, _hf_loss, hf=True),
}


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("name", list(ENTRIES))
def test_lora_trains_as_pytorch(name, stages, ranks):
    """4 AdamW steps: the adapter (and the classifier peft trains beside it) within 1e-5 of plain PyTorch after each,
    the loss of each step, the user's module untouched, ``step.state_dict`` against ``model.state_dict()``."""
    entry = ENTRIES[name]
    ref = reference_run(entry, ranks)
    run = fzero_run(entry, stages=stages, ranks=ranks)
    assert set(run.params[0]) == {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert all(".lora_" in n or ".modules_to_save." in n for n in run.params[0])  # the base stays in the module
    check(entry, ref, run)


def _vera_llama():  # VeRA's random projections: buffers shared by every adapted layer (one tensor, many names)
    return peft.get_peft_model(llama(), peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("ranks", MESHES)
@pytest.mark.parametrize("stages", [0, 3])
def test_vera_whose_projections_are_tied_buffers_trains_as_pytorch(stages, ranks):
    """VeRA failed at every stage: its shared ``vera_A``/``vera_B`` were a copy per name in the state, which torch's
    functional_call refuses for tied names. The trained vectors and the state_dict (its tied projections too) against
    plain PyTorch."""
    entry = Entry(_seeded(_vera_llama), _tokens(128, seed=1), _hf_loss, hf=True)
    ref = reference_run(entry, ranks)
    run = fzero_run(entry, stages=stages, ranks=ranks)
    assert {n.rsplit(".", 2)[-2] for n in run.params[0]} == {"vera_lambda_b", "vera_lambda_d"}
    assert sum(".vera_A." in k for k in run.state_dict) > 1  # tied: one tensor under several names
    check(entry, ref, run)


def _trained(model, *, stages, ranks, steps=slice(0, STEPS), state=None, step=None):
    step = step or fzero.compile(lambda p, b: fzero.apply(model, p, input_ids=b["input_ids"], labels=b["labels"]).loss,
                                 optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(ranks))
    state = state if state is not None else step.init(fzero.params_of(model))
    for batch in _tokens(128, seed=1)()[steps]:
        state, _ = step(state, batch)
    return step, state


def test_the_trained_adapter_is_what_save_pretrained_writes_and_merge_and_unload_folds_in(tmp_path):
    """The loop after training: the state's values into the module, then peft's ``save_pretrained`` writes them
    (adapter_model.safetensors), ``PeftModel.from_pretrained`` reads them onto a fresh base, and
    ``merge_and_unload`` gives the base with the adapter folded in (the same logits)."""
    from safetensors.torch import load_file

    model = _seeded(_lora_llama())()
    step, state = _trained(model, stages=3, ranks=2)
    trained = step.gather(state)
    assert not any(torch.equal(v, model.state_dict(keep_vars=True)[k]) for k, v in trained.items() if "lora_B" in k)  # it trained
    model.load_state_dict(step.state_dict(state, model))
    model.save_pretrained(tmp_path / "adapter")
    written = load_file(os.path.join(tmp_path, "adapter", "adapter_model.safetensors"))
    assert written.keys() == {k.replace(".default.", ".") for k in trained}
    assert all(torch.equal(written[k.replace(".default.", ".")], v) for k, v in trained.items())
    reloaded = peft.PeftModel.from_pretrained(_seeded(llama)(), tmp_path / "adapter")
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in trained.items())
    x = _tokens(128, seed=2)()[0]["input_ids"]
    with torch.no_grad():
        expected = model.eval()(input_ids=x).logits
        merged = model.merge_and_unload()(input_ids=x).logits
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)


def test_a_lora_checkpoint_resumes_at_another_stage_and_world_size(tmp_path):
    """Saved at stage 3 on two ranks after 2 steps (the adapter and its optimizer state, not the base: a LoRA
    checkpoint is small), resumed at stage 0 on one: the 2 more steps end where 4 uninterrupted ones do."""
    step, state = _trained(_seeded(_lora_llama())(), stages=0, ranks=1)
    straight = step.gather(state)
    model = _seeded(_lora_llama())()
    step, state = _trained(model, stages=3, ranks=2, steps=slice(0, 2))
    fzero.checkpoint.save(tmp_path / "ckpt", state)
    resumed_model = _seeded(_lora_llama())()
    like, _ = _trained(resumed_model, stages=0, ranks=1, steps=slice(0, 0))
    step, state = _trained(resumed_model, stages=0, ranks=1, steps=slice(2, STEPS), step=like,
                           state=fzero.checkpoint.load(tmp_path / "ckpt", like=like))
    got = step.gather(state)
    assert got.keys() == straight.keys()
    for k, v in straight.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_stage_3_units_are_the_decoder_layers_under_peft_s_prefix():
    """The default units and ``fzero.units_of`` of a peft model: the base model's layers, under peft's
    ``base_model.model.`` prefix, each holding its layer's adapter."""
    model = _seeded(_lora_llama())()
    units = fzero.units_of(model)
    assert units == tuple(f"base_model.model.{u}" for u in fzero.units_of(model.get_base_model()))
    assert units == ("base_model.model.model.layers.0", "base_model.model.model.layers.1")
    step = fzero.compile(lambda p, b: fzero.apply(model, p, input_ids=b["input_ids"], labels=b["labels"]).loss,
                         optimizer=fzero.optim.adamw(1e-3), stages=3, mesh=fzero.local_mesh(2), units=units)
    state = step.init(fzero.params_of(model))
    state, _ = step(state, _tokens(128, seed=1)()[0])


def _checkpointed_lora(kwargs):
    def build():
        base = llama()
        if hasattr(base, "activation_checkpointing_enable"):  # transformers 5.2x's name
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # earlier releases (5.17 on the GPU machine)
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return build


def _no_cache_loss(call, b):
    return call(input_ids=b["input_ids"], labels=b["labels"], use_cache=False).loss


@pytest.mark.parametrize("stages", [0, 3])
def test_lora_under_hugging_face_gradient_checkpointing(stages):
    """Non-reentrant (transformers 5's default) trains as plain PyTorch. Reentrant (``{"use_reentrant": True}``, or
    ``{}``, which torch runs reentrant; peft's ``prepare_model_for_kbit_training`` passes ``{}``): the checkpointed
    layers' backward never ran under fzero (nothing before them trains), so the adapter got no gradient where plain
    PyTorch trains it (only a ZeroGradientWarning blaming a detached loss); now refused before any update, naming
    the adapter's params and the fix."""
    entry = Entry(_seeded(_checkpointed_lora(None)), _tokens(128, seed=1), _no_cache_loss, hf=True)
    check(entry, reference_run(entry, 1), fzero_run(entry, stages=stages, ranks=1))
    reentrant = dataclasses.replace(entry, build=_seeded(_checkpointed_lora({"use_reentrant": True})))
    with pytest.raises(RuntimeError, match=r"(?s)fzero\.Step: the model runs torch\.utils\.checkpoint with use_reentrant=True, "
                                           r"so these params got no gradient: base_model\.model\.model\.layers\.0\.self_attn\..*"
                                           r"use_reentrant.: False.*remat=True"):
        fzero_run(reentrant, stages=stages, ranks=1)
