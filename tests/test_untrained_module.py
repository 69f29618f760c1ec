"""A module called directly after a step trained it: refused while it still holds its values from ``step.init``.

A step trains its state, never the module (``docs/migrating.md``, "The module after step.init"), so ``model(x)``, an
evaluation or ``model.generate()`` after training ran the untrained model, silently (measured below: the output of
the initial weights). A forward pre-hook on each module a train step ran with its params refuses such a call, naming
the fix, for as long as the module's trainable parameters are the tensors they were when the step returned,
unchanged. Loading the trained values into the module lifts it; ``fzero.apply`` with the state's values,
``torch.func.functional_call`` and the steps themselves (which run a copy of the module) are not refused.
"""

from __future__ import annotations

import pytest
import torch

import fzero
from zoo import gpt2

MESSAGE = r"Sequential was called directly after a fzero\.Step trained it.*model\.load_state_dict\(step\.state_dict\(state, model\)\)"


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _step(model, stages, ranks):
    return fzero.compile(lambda p, b: fzero.apply(model, p, b["x"]).pow(2).mean(), optimizer=fzero.optim.adamw(1e-1),
                         stages=stages, mesh=fzero.local_mesh(ranks))


@pytest.mark.parametrize("stages, ranks", [(0, 1), (0, 2), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)])
def test_a_module_called_directly_after_a_step_is_refused_until_the_trained_values_are_loaded(stages, ranks):
    model = _mlp()
    step = _step(model, stages, ranks)
    state = step.init(fzero.params_of(model))
    x = torch.randn(8, 4)
    before = model(x)  # no step has trained it yet: the module's values are the state's
    state, _ = step(state, {"x": x})
    with pytest.raises(RuntimeError, match=MESSAGE):
        model(x)  # before: the output of the initial weights, equal to `before`, silently
    trained = fzero.apply(model, step.state_dict(state, model), x)  # the fix the message gives
    assert not torch.equal(trained, before)
    assert torch.equal(torch.func.functional_call(model, step.state_dict(state, model), (x,)), trained)
    model.load_state_dict(step.state_dict(state, model))  # the other fix: in place, so every version moves
    assert torch.equal(model(x), trained)
    state, _ = step(state, {"x": x})  # a step on: the module is behind the state again
    with pytest.raises(RuntimeError, match=MESSAGE):
        model(x)
    model.load_state_dict(step.state_dict(state, model), assign=True)  # new tensors: lifted too
    assert torch.equal(model(x), fzero.apply(model, step.state_dict(state, model), x))


@pytest.mark.parametrize("stages, ranks", [(0, 1), (1, 2), (3, 1), (3, 2)])
def test_a_module_whose_params_were_donated_is_refused_by_name_when_called_after_a_step(stages, ranks):
    """``step.init(params_of(model, copy=False), donate=True)`` leaves the module's parameters meta tensors. A direct
    call after training (an evaluation cell in a notebook) got torch's "Tensor on device meta is not on the expected
    device cpu!" from the first layer, naming neither fzero nor the fix; now the pre-hook names the params and the fix
    (``assign=True``: torch's load into a meta tensor is a no-op), which runs the trained model."""
    model = _mlp()
    step = _step(model, stages, ranks)
    state = step.init(fzero.params_of(model, copy=False), donate=True)
    x = torch.randn(8, 4)
    state, _ = step(state, {"x": x})
    with pytest.raises(RuntimeError, match=r"^fzero: Sequential was called directly after a fzero\.Step trained it, but "
                                           r"its parameters '0\.weight', '0\.bias', '2\.weight', '2\.bias' are meta tensors.*"
                                           r"donate=True.*model\.load_state_dict\(step\.state_dict\(state, model\), "
                                           r"assign=True\)"):
        model(x)
    trained = fzero.apply(model, step.state_dict(state, model), x)  # with the state's values swapped in: not refused
    model.load_state_dict(step.state_dict(state, model), assign=True)
    assert torch.equal(model(x), trained)
    state, _ = step(state, {"x": x})  # the module's values are real now: behind the state, refused as any trained module
    with pytest.raises(RuntimeError, match=MESSAGE):
        model(x)


def test_a_module_evaluated_or_never_trained_is_not_refused():
    model, other = _mlp(), _mlp(seed=1)
    step = _step(model, 0, 1)
    state = step.init(fzero.params_of(model))
    x = torch.randn(8, 4)
    step.evaluate(state, {"x": x})  # an evaluation trains nothing
    model(x)
    state, _ = step(state, {"x": x})
    other(x)  # a module the step never ran


@pytest.mark.parametrize("stages", [0, 3])
def test_a_teacher_run_with_its_own_params_in_a_step_is_not_taken_for_trained(stages):
    """A teacher given its own values through ``fzero.apply`` (its params left trainable, as a teacher built from the
    student's code is): the step did not train it, so calling it directly afterwards is not refused."""
    student, teacher = _mlp(), _mlp(seed=1)
    tparams = fzero.params_of(teacher)

    def loss_fn(p, b):
        with torch.no_grad():
            t = fzero.apply(teacher, tparams, b["x"])
        return (fzero.apply(student, p, b["x"]) - t).pow(2).mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-1), stages=stages)
    state = step.init(fzero.params_of(student))
    x = torch.randn(8, 4)
    state, _ = step(state, {"x": x})
    assert torch.equal(teacher(x), fzero.apply(teacher, tparams, x))
    with pytest.raises(RuntimeError, match=MESSAGE):
        student(x)


def test_generate_of_a_hugging_face_model_after_training_is_refused_and_runs_once_the_values_are_loaded():
    torch.manual_seed(0)
    model = gpt2()
    step = fzero.compile(lambda p, b: fzero.apply(model, p, input_ids=b, labels=b).loss,
                         optimizer=fzero.optim.adamw(1e-2), stages=3)
    state = step.init(fzero.params_of(model))
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        state, _ = step(state, ids)
    prompt = ids[:1, :4]
    with pytest.raises(RuntimeError, match=r"GPT2LMHeadModel was called directly after a fzero\.Step trained it"):
        model.generate(prompt, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt))
    model.load_state_dict(step.state_dict(state, model))
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert out.shape == (1, 8)


def _load(model, trained, how):
    if how == "data.copy_":  # a loop that loads through .data: same tensors, same versions, other values
        for name, p in model.named_parameters():
            p.data.copy_(trained[name])
    elif how == "data =":
        for name, p in model.named_parameters():
            p.data = trained[name].clone()
    elif how == "vector_to_parameters":  # torch's own, through .data
        flat = torch.cat([trained[name].reshape(-1) for name, _ in model.named_parameters()])
        torch.nn.utils.vector_to_parameters(flat, model.parameters())
    else:  # load_state_dict swapping the tensors (torch.utils.swap_tensors): same objects
        swap = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.load_state_dict(trained)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swap)


@pytest.mark.parametrize("how", ["data.copy_", "data =", "vector_to_parameters", "swap_tensors"])
def test_trained_values_written_through_data_or_swapped_in_lift_it(how):
    """Loads that keep each parameter's tensor and version counter: refused after them, as the untrained model (a
    write through ``.data``), or the load itself failed, torch's "Cannot swap t1 because it has weakref associated
    with it" (the record held a weak reference to each parameter). A step after a write through ``.data`` of the
    state's values takes them into the record (``watch_module_writes``), so a call after it is refused again."""
    model = _mlp()
    with torch.no_grad():  # a model whose own init writes again (as Hugging Face's _init_weights): versions of 2
        for p in model.parameters():
            p.mul_(1.0)
    step = _step(model, 0, 1)
    state = step.init(fzero.params_of(model))
    x = torch.randn(8, 4)
    state, _ = step(state, {"x": x})
    trained = step.state_dict(state, model)
    fzero.apply(model, trained, x)  # a call with other tensors swapped in lifts nothing
    with pytest.raises(RuntimeError, match=MESSAGE):
        model.half()(x.half())  # nor a conversion of the untrained values
    model.float()
    _load(model, trained, how)
    assert torch.equal(model(x), fzero.apply(model, trained, x))
    state, _ = step(state, {"x": x})  # the state's own values: not a change; the module is behind it again
    with pytest.raises(RuntimeError, match=MESSAGE):
        model(x)


SAVE_MESSAGE = (r"Sequential\.state_dict\(\) was called{where} after a fzero\.Step trained it.*untrained model.*"
                r"model\.load_state_dict\(step\.state_dict\(state, model\)\)")


@pytest.mark.parametrize("stages, ranks", [(0, 1), (2, 2), (3, 1)])
def test_saving_a_module_a_step_trained_is_refused_until_the_trained_values_are_loaded(tmp_path, stages, ranks):
    """``torch.save(model.state_dict())`` (and what reads it to save or copy the weights: ``save_pretrained``,
    Accelerate's ``save_model``, an EMA's ``load_state_dict(model.state_dict())``) after training wrote the values
    from ``step.init``, silently: hours of training lost at the save. Refused like a call, naming the fix; a parent's
    ``state_dict()`` reads it too. ``keep_vars=True`` (the tensors by reference, how fzero's own exports read names)
    passes, and so does a module whose trained values were loaded."""
    model = _mlp()
    step = _step(model, stages, ranks)
    state = step.init(fzero.params_of(model))
    x = torch.randn(8, 4)
    initial = {k: v.clone() for k, v in model.state_dict().items()}  # before any step: the module's values are the state's
    state, _ = step(state, {"x": x})
    with pytest.raises(RuntimeError, match=SAVE_MESSAGE.format(where="")):
        torch.save(model.state_dict(), tmp_path / "model.pt")  # before: the initial weights, silently
    assert not (tmp_path / "model.pt").exists()
    parent = torch.nn.ModuleDict({"net": model})
    with pytest.raises(RuntimeError, match=SAVE_MESSAGE.format(where=r" \(read as 'net' of a module holding it\)")):
        parent.state_dict()
    assert set(model.state_dict(keep_vars=True)) == set(initial)  # names by reference: fzero's exports read them so
    trained = step.state_dict(state, model)  # the fix the message gives: from the state
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    model.load_state_dict(trained)  # or into the module, then save as before
    torch.save(model.state_dict(), tmp_path / "model.pt")
    saved = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(saved[k], trained[k]) for k in trained)


def test_a_hugging_face_save_pretrained_after_training_is_refused_and_saves_the_trained_model_once_loaded(tmp_path):
    """transformers' ``save_pretrained`` reads ``model.state_dict()``: the refusal names the model's class."""
    model = gpt2()
    step = fzero.compile(lambda p, b: fzero.apply(model, p, input_ids=b["ids"], labels=b["ids"]).loss,
                         optimizer=fzero.optim.adamw(1e-2), stages=3)
    state = step.init(fzero.params_of(model))
    ids = torch.randint(0, 100, (2, 8))
    state, _ = step(state, {"ids": ids})
    with pytest.raises(RuntimeError, match=r"GPT2LMHeadModel\.state_dict\(\) was called after a fzero\.Step trained it"):
        model.save_pretrained(tmp_path / "hf")
    model.load_state_dict(step.state_dict(state, model))
    model.save_pretrained(tmp_path / "hf")
    reloaded = type(model).from_pretrained(tmp_path / "hf")
    trained = step.state_dict(state, model)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in trained.items() if k in reloaded.state_dict())


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_loaders_that_read_state_dict_for_its_names_load_into_a_trained_module(tmp_path):
    """safetensors' load_model, Accelerate's load_state / load_checkpoint_in_model and peft's set_peft_model_state_dict
    (load_adapter, PeftModel.from_pretrained) read ``model.state_dict()`` for its names before they load: a load into
    a trained module (the trained values from a file: the fix) was refused as a save of the untrained weights."""
    import safetensors.torch

    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = gpt2()
    step = fzero.compile(lambda p, b: fzero.apply(model, p, input_ids=b, labels=b).loss, optimizer=fzero.optim.adamw(1e-2), stages=2)
    state = step.init(fzero.params_of(model))
    state, _ = step(state, torch.randint(0, 128, (2, 16)))
    fzero.checkpoint.save_weights(step, state, tmp_path / "w", model=model, format="safetensors", dtype="fp32")
    with pytest.raises(RuntimeError, match=r"GPT2LMHeadModel\.state_dict\(\) was called after a fzero\.Step trained it"):
        model.state_dict()
    safetensors.torch.load_model(model, next((tmp_path / "w").glob("*.safetensors")), strict=False)
    want = step.state_dict(state, model)
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())  # loaded: passes, the trained values

    lora = peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True))
    lora.save_pretrained(tmp_path / "second")
    step = fzero.compile(lambda p, b: fzero.apply(lora, p, input_ids=b, labels=b).loss, optimizer=fzero.optim.adamw(1e-2), stages=2)
    state = step.init(fzero.params_of(lora))
    state, _ = step(state, torch.randint(0, 128, (2, 16)))
    lora.load_adapter(tmp_path / "second", adapter_name="second")  # another adapter beside the trained one
    with pytest.raises(RuntimeError, match=r"PeftModel\.state_dict\(\) was called after a fzero\.Step trained it"):
        lora.state_dict()  # the trained adapter is still its step.init values
    adapter = peft.get_peft_model_state_dict(lora, state_dict=step.state_dict(state, lora))
    peft.set_peft_model_state_dict(lora, adapter)
    assert lora.state_dict()
