"""A zoo of tiny random-init models that nobody here wrote, and the plain-PyTorch reference they must match.

Each entry builds its model from its library's default config with only the sizes made tiny (2 layers,
hidden 16-32, vocab 64-128, sequence 8), in train mode as a trainer would run it, and gives a loss
``loss(call, batch)`` where ``call(*args, **kwargs)`` runs the model: the module itself in the reference,
``fzero.apply(model, params, ...)`` under fzero. Nothing is downloaded (weights are random).

The reference follows what ``torchrun`` + DDP would do with the same seeded program:

- one rank: the plain loop (forward, backward, ``torch.optim.AdamW.step``);
- n ranks: n replicas of the model, each on its 1/n of the global batch (split on dim 0, as
  ``local_mesh(n)`` splits it); gradients averaged over ranks (a param no rank used keeps ``grad=None``,
  one that some rank used counts as zero on the others, as DDP with ``find_unused_parameters``); one
  AdamW step. Buffers as ``broadcast_buffers=True``: each step every rank starts from rank 0's buffers (all of
  them, as DDP's ``named_buffers()``: the non-persistent ones too).
  RNG: at every step each rank's stream restarts as a copy of the process generator's state (rank 0's end
  state of the step before), and the process generator goes on from rank 0's end state; NumPy's global stream
  likewise (Wav2Vec2's SpecAugment masks, BigBird's random blocks draw from it). That is not what
  torchrun does: each process goes on from its own end state, as fzero's per-rank streams on a ``local_mesh``
  do (``fzero.mesh._rank.Carry``). The two agree here because every rank of every entry draws as many values
  in a step (equal per-rank batch shapes: dropout masks, LayerDrop and drop-path draws), so the ranks end each
  step in one state (checked for every entry on two ranks); an entry whose ranks draw different amounts (a
  mixture of experts dropping overflow tokens before a dropout, data-dependent sampling: RReLU draws a slope for
  each negative input only) sets ``own_streams``, and its reference keeps each rank's own stream, as torchrun does.

``python tests/zoo.py`` prints the pass/fail matrix (model x stage x mesh, with the max param
difference or the exception) without pytest's xfail marks.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree

import fzero

LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 0.01  # torch.optim.AdamW's defaults, weight decay set explicitly
STEPS = 4
GLOBAL_BATCH = 4  # 2 per rank on local_mesh(2)
SEQ = 8
SEED = 1234  # the process generator (and NumPy's global one) is seeded with this before the first step (dropout, LayerDrop)
NOISE = 1e-6  # reference gradients below this in every step are rounding noise
RTOL = ATOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Entry:
    build: Callable[[], nn.Module]  # seeded, in train mode
    batches: Callable[[], list[Any]]  # global batches, one per step
    loss: Callable[[Callable[..., Any], Any], torch.Tensor]
    buffers: bool = False  # has state_dict buffers (BatchNorm stats, spectral-norm vectors) that training writes
    check: Callable[["Reference"], None] | None = None  # asserts the reference exercises what the entry is for
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # fzero.compile details, e.g. autodiff
    hf: bool = False  # built with transformers
    # the reference's rank streams go on from their own end states, as torchrun's processes and fzero's local-mesh ranks
    # do, rather than from rank 0's (see the module docstring): for a model whose ranks draw different amounts
    own_streams: bool = False


def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make().train()

    return build


def _tokens(vocab: int, *, seed: int, labels: str = "shift") -> Callable[[], list[dict[str, torch.Tensor]]]:
    def batches():
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(STEPS):
            x = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen)
            if labels == "shift":  # causal LM: the model shifts labels itself
                out.append({"input_ids": x, "labels": x.clone()})
            elif labels == "seq2seq":
                out.append({"input_ids": x, "labels": torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen)})
            else:  # masked LM: ~30% of positions predicted, position 0 always (no row without a label)
                masked = torch.rand(GLOBAL_BATCH, SEQ, generator=gen) < 0.3
                masked[:, 0] = True
                y = torch.where(masked, x, torch.full_like(x, -100))
                out.append({"input_ids": torch.where(masked, torch.full_like(x, 3), x), "labels": y})
        return out

    return batches


def _hf_loss(call, b):
    return call(input_ids=b["input_ids"], labels=b["labels"]).loss


# ------------------------------------------------------------------------------------ Hugging Face


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # bos/eos: the default 50256 lies outside the tiny vocab (transformers logs it); they play no part in the loss
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=127,
                                      eos_token_id=127))


def _checkpointed(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """The model with Hugging Face's activation (gradient) checkpointing on: torch.utils.checkpoint, non-reentrant,
    around each decoder layer (gradient_checkpointing_enable() is its deprecated alias in transformers 5)."""

    def checkpointed():
        model = build()
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        return model

    return checkpointed


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=32))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    # decoder_start_token_id: T5Config has no default for it in transformers 5.x and T5 cannot shift labels without
    # it; the released T5 configs set it to the pad token, 0
    return T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                               decoder_start_token_id=0))


def bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32))


def opt():
    from transformers import OPTConfig, OPTForCausalLM

    # layerdrop=0.3 (default 0): OPTDecoder skips each layer with this probability in training (modeling_opt.py)
    return OPTForCausalLM(OPTConfig(vocab_size=128, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2,
                                    ffn_dim=64, num_attention_heads=4, max_position_embeddings=32, layerdrop=0.3))


def _layers_dropped(ref: "Reference") -> None:
    """LayerDrop must drop a layer in some step and run it in another, or the entry tests nothing."""
    layer0 = [n for n in ref.params[0] if ".layers.0." in n]
    assert layer0, "no OPT layer 0 params"
    used = [n in ref.used[k] for k in range(STEPS) for n in layer0[:1]]
    assert any(used) and not all(used), f"LayerDrop made no difference over {STEPS} steps (layer 0 used: {used}); change SEED"


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM

    return GemmaForCausalLM(GemmaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=32))


def _hidden_states_loss(call, b):
    """The LM loss plus a penalty on every hidden state: what ``output_hidden_states=True`` captures (with forward
    hooks that transformers 5 installs lazily, from inside the forward) feeds the loss and its gradient."""
    out = call(input_ids=b["input_ids"], labels=b["labels"], output_hidden_states=True)
    if len(out.hidden_states) != 3:  # the embeddings and one per layer (2 layers); the last is after the final norm
        raise ValueError(f"output_hidden_states=True gave {len(out.hidden_states)} hidden states, not 3")
    return out.loss + 0.1 * sum(h.pow(2).mean() for h in out.hidden_states)


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # output_router_logits=True: the router logits (captured by hooks on each layer's gate) give the load-balancing
    # auxiliary loss, which the model adds to its loss (router_aux_loss_coef, default 0.001)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=32, output_router_logits=True))


def _moe_loss(call, b):
    out = call(input_ids=b["input_ids"], labels=b["labels"])
    if out.aux_loss is None:
        raise ValueError("output_router_logits=True gave no auxiliary loss: the router logits were not captured")
    return out.loss  # includes router_aux_loss_coef * aux_loss


def mamba():
    from transformers import MambaConfig, MambaForCausalLM

    # a state-space model; without the mamba_ssm kernels transformers runs its PyTorch reference (a log record)
    return MambaForCausalLM(MambaConfig(vocab_size=128, hidden_size=16, state_size=4, num_hidden_layers=2, expand=2,
                                        conv_kernel=4))


def vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=32, num_labels=10))


def _pixels_loss(call, b):
    return call(pixel_values=b["x"], labels=b["y"]).loss


def regnet():
    from transformers import RegNetConfig, RegNetForImageClassification

    # a convnet (torchvision-like, no torchvision here): BatchNorm statistics, grouped convs, squeeze-and-excitation
    # (the default layer_type "y"); its stages sit in encoder.stages, the default stage-3 units
    return RegNetForImageClassification(RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2],
                                                     groups_width=8, num_labels=10))


def convnextv2():
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

    # LayerNorm, depthwise convs and global response norm; drop_path_rate=0.5 (default 0): stochastic depth draws one
    # torch.rand per sample in each layer, so each rank's drops come from its own RNG stream, as under DDP. (ConvNext v1
    # trains as PyTorch too, but its layer scale, 1e-6 by default, puts a quarter of its gradients under NOISE.)
    return ConvNextV2ForImageClassification(ConvNextV2Config(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[8, 16],
                                                             depths=[1, 2], image_size=32, num_labels=10, drop_path_rate=0.5))


def _images_of(size: int, seed: int) -> Callable[[], list[dict[str, torch.Tensor]]]:
    def batches():
        gen = torch.Generator().manual_seed(seed)
        return [{"x": torch.randn(GLOBAL_BATCH, 3, size, size, generator=gen),
                 "y": torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen)} for _ in range(STEPS)]

    return batches


def whisper():
    from transformers import WhisperConfig, WhisperForAudioClassification

    # a speech encoder (log-mel frames in, a class out); the token ids only matter to the decoder, which this model
    # does not have: set inside the tiny vocabulary so that transformers has nothing to log
    return WhisperForAudioClassification(WhisperConfig(
        vocab_size=64, d_model=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=32, decoder_layers=1,
        decoder_attention_heads=4, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8, max_target_positions=8,
        num_labels=10, pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=3))


def llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    # a CLIP vision tower, a projector and a Llama LM; at its default vision_feature_layer=-2 the image features are the
    # hidden state after the vision tower's first layer, which transformers' output hooks capture on that layer: the
    # tower's own output (its last layer's return value) reaches nothing in the loss, and its last layer no gradient
    vision = CLIPVisionConfig(image_size=8, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4)
    text = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       max_position_embeddings=32)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=127))


def _image_text():
    gen = torch.Generator().manual_seed(36)
    out = []
    for _ in range(STEPS):
        x = torch.randint(1, 120, (GLOBAL_BATCH, 12), generator=gen)
        x[:, 1:5] = 127  # one image token per patch: (8 / 4) ** 2, the CLS token left out ("default" strategy)
        labels = torch.where(x == 127, torch.full_like(x, -100), x)
        out.append({"input_ids": x, "labels": labels, "pixel_values": torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=gen)})
    return out


def _image_text_loss(call, b):
    return call(input_ids=b["input_ids"], pixel_values=b["pixel_values"], labels=b["labels"]).loss


def _audio():
    gen = torch.Generator().manual_seed(16)  # 2 * max_source_positions frames of num_mel_bins, as Whisper requires
    return [{"x": torch.randn(GLOBAL_BATCH, 8, 16, generator=gen), "y": torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen)}
            for _ in range(STEPS)]


def _audio_loss(call, b):
    return call(input_features=b["x"], labels=b["y"]).loss


# --------------------------------------------------------------------------------------- torch.nn


def albert():
    from transformers import AlbertConfig, AlbertForMaskedLM

    # ALBERT shares one layer group across its depth: one module (and its params) called at every layer
    return AlbertForMaskedLM(AlbertConfig(vocab_size=128, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=32))


def _one_shared_layer(ref: "Reference") -> None:
    assert not any("albert_layer_groups.1" in n for n in ref.params[0]), "ALBERT should hold one shared layer group"


def bloom():
    from transformers import BloomConfig, BloomForCausalLM

    # ALiBi position biases instead of position embeddings
    return BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))


def funnel():
    from transformers import FunnelConfig, FunnelForMaskedLM

    # its layers sit in a ModuleList of ModuleLists: units must be fzero.units_of(model) (test_zoo.py)
    return FunnelForMaskedLM(FunnelConfig(vocab_size=128, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64,
                                          num_decoder_layers=1, max_position_embeddings=32))


def clip():
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    # two towers and a contrastive loss over the rank's batch, scaled by logit_scale, a parameter of the root module
    # itself (no submodule holds it: at stages 2-3 it lies in the root unit)
    text = CLIPTextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=32, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vision = CLIPVisionConfig(image_size=8, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4)
    return CLIPModel(CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16))


def _text_image():
    gen = torch.Generator().manual_seed(40)
    return [{"input_ids": torch.randint(3, 128, (GLOBAL_BATCH, SEQ), generator=gen),
             "pixel_values": torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=gen)} for _ in range(STEPS)]


def _contrastive_loss(call, b):
    return call(input_ids=b["input_ids"], pixel_values=b["pixel_values"], return_loss=True).loss


def wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    # a conv feature extractor, a positional conv under a weight_norm parametrization (original0/original1 are the
    # params), SpecAugment's time masks drawn from NumPy's global stream (mask_time_prob 0.05 by default; spans of 2
    # frames for the 39 frames of 400 samples) over a trained masked_spec_embed, and LayerDrop (0.1 by default)
    return Wav2Vec2ForCTC(Wav2Vec2Config(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                                         num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, mask_time_length=2,
                                         pad_token_id=0))


def _speech():
    gen = torch.Generator().manual_seed(41)
    return [{"x": torch.randn(GLOBAL_BATCH, 400, generator=gen), "labels": torch.randint(1, 32, (GLOBAL_BATCH, 5), generator=gen)}
            for _ in range(STEPS)]


def _ctc_loss(call, b):
    return call(input_values=b["x"], labels=b["labels"]).loss


def _time_masked(ref: "Reference") -> None:
    """SpecAugment must mask some frame in some step (masked_spec_embed then gets a gradient), or the entry tests less."""
    assert any("wav2vec2.masked_spec_embed" in used for used in ref.used), "SpecAugment masked no frame; change SEED"


def bn_cnn():
    """Conv2d-BatchNorm2d-ReLU blocks in a Sequential, as torchvision's ResNet builds them (no torchvision here)."""

    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    return nn.Sequential(block(3, 8), block(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def _images():
    gen = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=gen), "y": torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen)}
            for _ in range(STEPS)]


def _classify(call, b):
    return F.cross_entropy(call(b["x"]), b["y"])


class TokenModel(nn.Module):
    """Embedding, a body, a head: the frame of the small torch.nn entries below."""

    def __init__(self, body: nn.Module, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.body = body
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def _lm_loss(call, b):
    logits = call(b["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten())


def transformer_encoder():
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)  # dropout 0.1 by default
    return TokenModel(nn.TransformerEncoder(layer, num_layers=2))


class Recurrent(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.rnns = nn.ModuleList([nn.LSTM(d, d, batch_first=True), nn.GRU(d, d, batch_first=True)])

    def forward(self, h):
        for rnn in self.rnns:
            h, _ = rnn(h)  # LSTM: (out, (h, c)); GRU: (out, h)
        return h


def lstm_gru():
    return TokenModel(Recurrent())


class Blocks(nn.Module):
    """Linear-GELU blocks in a ModuleList (the default stage-3 units), each one's output added to its input."""

    def __init__(self, d: int = 16, n: int = 2, block: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([(block or _linear_gelu)(d) for _ in range(n)])

    def forward(self, h):
        for b in self.blocks:
            h = h + b(h)
        return h


def _linear_gelu(d: int) -> nn.Module:
    return nn.Sequential(nn.Linear(d, d), nn.GELU())


# a forward hook on a unit feeding an auxiliary loss. The hook writes into a thread-local store: each rank
# thread of local_mesh(n) is a process of its own under torchrun, with its own copy of a global like this
_CAPTURED = threading.local()


def _capture(module, inputs, output):
    _CAPTURED.h = output


def hooked():
    model = TokenModel(Blocks())
    model.body.blocks[0].register_forward_hook(_capture)
    return model


def _hooked_loss(call, b):
    main = _lm_loss(call, b)
    return main + 0.1 * _CAPTURED.h.pow(2).mean()  # what the hook saw, with its gradient


# user-written hooks, as a user would add them for logging or an auxiliary loss: a forward pre-hook on the root, a
# forward hook on a Linear *inside* a unit capturing what it computed (used in the loss), and a full backward hook on
# a unit. Each records into a thread-local store (each rank thread of local_mesh(n) is a process under torchrun).
_SEEN = threading.local()


def _seen() -> dict:
    if not hasattr(_SEEN, "calls"):
        _SEEN.calls = {"pre": 0, "forward": 0, "backward": 0}
    return _SEEN.calls


def _count_pre(module, args):
    _seen()["pre"] += 1


def _capture_inner(module, args, output):
    _seen()["forward"] += 1
    _SEEN.h = output


def _count_backward(module, grad_input, grad_output):
    _seen()["backward"] += 1


def user_hooks():
    model = TokenModel(Blocks())
    model.register_forward_pre_hook(_count_pre)
    model.body.blocks[1][0].register_forward_hook(_capture_inner)
    model.body.blocks[0].register_full_backward_hook(_count_backward)
    return model


def _user_hooks_loss(call, b):
    main = _lm_loss(call, b)
    return main + 0.1 * _SEEN.h.pow(2).mean()


class SideBlock(nn.Module):
    """A block that keeps a second result on itself (``self.side``) besides returning its output, as a model that
    stores an auxiliary tensor on a submodule does: at stage 3 that gradient reaches the unit without passing
    through its return value."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.main, self.aux = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h):
        self.side = self.aux(h)
        return torch.tanh(self.main(h))


class SideBody(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SideBlock(d) for _ in range(3)])

    def forward(self, h):
        for b in self.blocks:
            h = h + b(h)
        return h + 0.1 * sum(b.side.pow(2).mean() for b in self.blocks)


def side_channel():
    return TokenModel(SideBody())


@dataclasses.dataclass
class BlockOut:
    h: torch.Tensor
    gate: torch.Tensor


class DataclassBlock(nn.Module):
    """A unit that returns a @dataclass (not a registered pytree)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gate = nn.Linear(d, 1)

    def forward(self, x):
        return BlockOut(h=F.gelu(self.lin(x)), gate=torch.sigmoid(self.gate(x)))


class DataclassBody(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([DataclassBlock(d) for _ in range(2)])

    def forward(self, h):
        for b in self.blocks:
            out = b(h)
            h = h + out.gate * out.h
        return h


def dataclass_out():
    return TokenModel(DataclassBody())


class InplaceBody(Blocks):
    def forward(self, h):
        for b in self.blocks:
            h = b(h).add_(h)  # the unit's output, added into in place (GELU's backward needs its input, not its output)
        return h


def inplace_add():
    return TokenModel(InplaceBody())


class ShiftBlock(nn.Module):
    """A unit that adds into its own input in place before using it (add's backward saves nothing, so
    eager autograd allows it); what the previous unit returned is changed."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.randn(d) * 0.1)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        x.add_(self.shift)
        return F.gelu(self.lin(x))


def inplace_input():
    return TokenModel(Blocks(block=ShiftBlock))


class TwoHeads(nn.Module):
    """A trunk and a ModuleDict of heads; the loss uses one, so the other's params get grad=None every step."""

    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.trunk = Blocks(d)
        self.heads = nn.ModuleDict({"lm": nn.Linear(d, vocab), "unused": nn.Linear(d, vocab)})

    def forward(self, x, *, head: str = "lm"):
        return self.heads[head](self.trunk(self.emb(x)))


def unused_head():
    return TwoHeads()


def _unused_never_gets_grad(ref: "Reference") -> None:
    assert not any(n.startswith("heads.unused.") for k in range(STEPS) for n in ref.used[k])
    assert {"heads.unused.weight", "heads.unused.bias"} <= set(ref.params[0])


def rrelu_cnn():
    """A convnet with RReLU, whose random negative slopes are drawn in training for the negative inputs only (torch's CPU
    kernel): each rank draws as many values as its share of the batch has negative activations, so the ranks' streams
    part (``own_streams``)."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.RReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.RReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def spectral():
    sn = torch.nn.utils.parametrizations.spectral_norm
    return TokenModel(Blocks(block=lambda d: nn.Sequential(sn(nn.Linear(d, d)), nn.Tanh())))


class CheckpointedConvs(nn.Module):
    """Conv-BatchNorm-ReLU blocks that the model checkpoints itself, ``x = checkpoint(fn, x, use_reentrant=False)``
    around each block's call (timm's and many models' own activation checkpointing), with a dropout after the block
    inside the checkpointed function: the recompute in backward runs each block (a stage-3 unit) again, inside the
    backward, BatchNorm's running statistics updated a second time as in PyTorch."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.blocks = nn.ModuleList([block(3, 8), block(8, 8)])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = checkpoint(lambda h, b=b: self.drop(b(h)), x, use_reentrant=False)
        return self.head(x.mean((2, 3)))


ZOO: dict[str, Entry] = {
    "gpt2": Entry(_seeded(gpt2), _tokens(128, seed=1), _hf_loss, hf=True),
    "llama": Entry(_seeded(llama), _tokens(128, seed=2), _hf_loss, hf=True),
    "mistral": Entry(_seeded(mistral), _tokens(128, seed=3), _hf_loss, hf=True),
    "qwen2": Entry(_seeded(qwen2), _tokens(128, seed=4), _hf_loss, hf=True),
    "t5": Entry(_seeded(t5), _tokens(128, seed=5, labels="seq2seq"), _hf_loss, hf=True),
    "bert": Entry(_seeded(bert), _tokens(128, seed=6, labels="mlm"), _hf_loss, hf=True),
    "opt_layerdrop": Entry(_seeded(opt), _tokens(128, seed=7), _hf_loss, check=_layers_dropped, hf=True),
    # HF activation checkpointing recomputes each layer in backward: needs autodiff="autograd" (under "func" fzero
    # raises an error naming it, test_zoo.py); the recompute must read fzero's params, not the module's own
    "gpt2_checkpointing": Entry(_seeded(_checkpointed(gpt2)), _tokens(128, seed=1), _hf_loss, hf=True,
                                settings={"autodiff": "autograd"}),
    "llama_checkpointing": Entry(_seeded(_checkpointed(llama)), _tokens(128, seed=2), _hf_loss, hf=True,
                                 settings={"autodiff": "autograd"}),
    # issue 26: what transformers captures with its lazily installed hooks feeds the loss; four more families
    "gemma_hidden_states": Entry(_seeded(gemma), _tokens(128, seed=17), _hidden_states_loss, hf=True),
    "qwen2_moe_router": Entry(_seeded(qwen2_moe), _tokens(128, seed=18), _moe_loss, hf=True),
    # the router logits leave each layer through transformers' capture hooks: Hugging Face's own (non-reentrant)
    # checkpointing keeps their graph (fzero's remat=True refuses them, test_hooks.py)
    "qwen2_moe_router_checkpointing": Entry(_seeded(_checkpointed(qwen2_moe)), _tokens(128, seed=18), _moe_loss, hf=True,
                                            settings={"autodiff": "autograd"}),
    "mamba": Entry(_seeded(mamba), _tokens(128, seed=19), _hf_loss, hf=True),
    "vit": Entry(_seeded(vit), _images, _pixels_loss, hf=True),
    "whisper_encoder": Entry(_seeded(whisper), _audio, _audio_loss, hf=True),
    # from a sweep of Hugging Face vision models (ResNet, RegNet, MobileNetV2, EfficientNet, ConvNext(V2), Swin, DINOv2,
    # MobileViT, SegFormer, BEiT): BatchNorm with grouped convs and SE, and stochastic depth
    "regnet": Entry(_seeded(regnet), _images_of(16, seed=25), _pixels_loss, buffers=True, hf=True),
    # 32x32 images: the second stage's 7x7 depthwise kernels see a 4x4 map (a 2x2 one leaves most taps without gradient)
    "convnextv2_drop_path": Entry(_seeded(convnextv2), _images_of(32, seed=26), _pixels_loss, hf=True),
    # from a sweep of 43 models nobody here wrote (2026-11-26): layers shared across depth, ALiBi
    "albert": Entry(_seeded(albert), _tokens(128, seed=22, labels="mlm"), _hf_loss, check=_one_shared_layer, hf=True),
    "bloom": Entry(_seeded(bloom), _tokens(128, seed=23), _hf_loss, hf=True),
    # from a sweep of Hugging Face architectures not in the zoo: the loss reaches a unit only through what a forward hook
    # captured (stage 3 read that unit's freed params in backward)
    "llava": Entry(_seeded(llava), _image_text, _image_text_loss, hf=True),
    # from a sweep of Hugging Face families not in the zoo (DeBERTa-v2 to Reformer, 2026-12): a parameter of the root
    # module (CLIP's logit_scale); a weight_norm parametrization, NumPy's RNG and LayerDrop together (Wav2Vec2)
    "clip": Entry(_seeded(clip), _text_image, _contrastive_loss, hf=True),
    "wav2vec2": Entry(_seeded(wav2vec2), _speech, _ctc_loss, check=_time_masked, hf=True),
    "bn_cnn": Entry(_seeded(bn_cnn), _images, _classify, buffers=True),
    # from a sweep of torch.nn features: a random draw whose count depends on the data (each rank's stream its own)
    "rrelu_cnn": Entry(_seeded(rrelu_cnn), _images, _classify, own_streams=True),
    # under torch.func.grad (autodiff="func"), and the same under the default plain autograd: tells fzero's causes
    # from torch.func's (test_zoo.py)
    "transformer_encoder": Entry(_seeded(transformer_encoder), _tokens(64, seed=8), _lm_loss,
                                 settings={"autodiff": "func"}),
    "transformer_encoder_autograd": Entry(_seeded(transformer_encoder), _tokens(64, seed=8), _lm_loss,
                                          settings={"autodiff": "autograd"}),
    "lstm_gru": Entry(_seeded(lstm_gru), _tokens(64, seed=9), _lm_loss),
    "hook_aux": Entry(_seeded(hooked), _tokens(64, seed=10), _hooked_loss),
    "user_hooks": Entry(_seeded(user_hooks), _tokens(64, seed=20), _user_hooks_loss),
    "side_channel": Entry(_seeded(side_channel), _tokens(64, seed=21), _lm_loss),
    "dataclass_out": Entry(_seeded(dataclass_out), _tokens(64, seed=11), _lm_loss),
    "inplace_add": Entry(_seeded(inplace_add), _tokens(64, seed=12), _lm_loss),
    "inplace_input": Entry(_seeded(inplace_input), _tokens(64, seed=15), _lm_loss),
    "unused_head": Entry(_seeded(unused_head), _tokens(64, seed=13), _lm_loss, check=_unused_never_gets_grad),
    "spectral_norm": Entry(_seeded(spectral), _tokens(64, seed=14), _lm_loss, buffers=True),
    # from a sweep of models nobody here wrote (reversible, sparse-attention, MoE, vision families and torch.nn patterns):
    # the model's own torch.utils.checkpoint around its blocks' calls (stage 3 freed the recompute's gathered params)
    "user_checkpoint": Entry(_seeded(CheckpointedConvs), _images, _classify, buffers=True),
}


# ------------------------------------------------------------------------------------ the reference


@dataclasses.dataclass
class Reference:
    params: list[dict[str, torch.Tensor]]  # after each step, keyed as named_parameters (= fzero.params_of)
    losses: list[float]  # mean over ranks
    used: list[set[str]]  # per step: params some rank gave a gradient (grad is not None)
    grad_max: dict[str, torch.Tensor]  # elementwise max |averaged grad| over the steps (0 where None)
    state_dict: dict[str, torch.Tensor]  # rank 0's model.state_dict() after the last step
    aliases: dict[str, str]  # state_dict key of a param -> its named_parameters name (tied weights)


def split(batch: Any, n: int) -> list[Any]:
    """The global batch's tensors split on dim 0 into n per-rank batches, as ``local_mesh(n)`` splits it."""
    leaves, spec = _pytree.tree_flatten(batch)
    parts = [leaf.chunk(n) if isinstance(leaf, torch.Tensor) else [leaf] * n for leaf in leaves]
    return [_pytree.tree_unflatten([p[r] for p in parts], spec) for r in range(n)]


def _same_streams(a: tuple[torch.Tensor, Any], b: tuple[torch.Tensor, Any]) -> bool:
    """Whether two (torch, NumPy) stream states are one."""
    return torch.equal(a[0], b[0]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))


def reference_run(entry: Entry, ranks: int) -> Reference:
    model = entry.build()
    replicas = [model] + [copy.deepcopy(model) for _ in range(ranks - 1)]
    # trainable params only, as fzero.params_of gives them (Whisper's sinusoidal position table is frozen)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    by_id = {id(p): n for n, p in named.items()}
    aliases = {k: by_id[id(t)] for k, t in model.state_dict(keep_vars=True).items() if id(t) in by_id}
    opt = torch.optim.AdamW(list(named.values()), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    grad_max = {n: torch.zeros_like(p) for n, p in named.items()}
    params, losses, used = [], [], []
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    streams = None  # each rank's (torch, NumPy) stream state at the end of the last step
    for batch in entry.batches():
        state = model.state_dict()
        for rep in replicas[1:]:  # DDP: the same params, and rank 0's buffers (broadcast_buffers=True)
            rep.load_state_dict(state)
            with torch.no_grad():  # every buffer, as DDP broadcasts them: the non-persistent ones too
                for b, b0 in zip(rep.buffers(), model.buffers()):
                    b.copy_(b0)
        start, end = (torch.get_rng_state(), np.random.get_state()), None
        if streams is None:  # the first step: every rank starts from the process's streams, as torchrun's seeded alike
            streams = [start] * ranks
        grads, rank_losses = [], []
        for r, (rep, half) in enumerate(zip(replicas, split(batch, ranks))):
            if r:  # each rank's stream restarts where rank 0's did (torchrun's own streams, while ranks draw alike)
                torch.set_rng_state(streams[r][0] if entry.own_streams else start[0])
                np.random.set_state(streams[r][1] if entry.own_streams else start[1])
            rep.zero_grad(set_to_none=True)
            loss = entry.loss(rep, half)
            loss.backward()
            rank_losses.append(loss.item())
            grads.append([p.grad for p in rep.parameters() if p.requires_grad])
            streams[r] = (torch.get_rng_state(), np.random.get_state())
            if r == 0:
                end = streams[0]
        if not entry.own_streams and not all(_same_streams(st, end) for st in streams):
            raise AssertionError(f"the ranks ended step {len(params) + 1} in different random states (they drew different "
                                 f"amounts): this reference would differ from torchrun's; give the entry own_streams=True")
        torch.set_rng_state(end[0])  # the process goes on as rank 0 did
        np.random.set_state(end[1])
        model.zero_grad(set_to_none=True)
        for (n, p), gs in zip(named.items(), zip(*grads)):
            present = [g for g in gs if g is not None]
            if present:
                p.grad = sum(present[1:], present[0].clone()) / ranks if ranks > 1 else present[0]
                grad_max[n] = torch.maximum(grad_max[n], p.grad.abs())
        used.append({n for n, p in named.items() if p.grad is not None})
        opt.step()
        params.append({n: p.detach().clone() for n, p in named.items()})
        losses.append(sum(rank_losses) / ranks)
    ref = Reference(params, losses, used, grad_max, {k: v.clone() for k, v in model.state_dict().items()}, aliases)
    if entry.check is not None:
        entry.check(ref)
    return ref


# ------------------------------------------------------------------------------------------ fzero


@dataclasses.dataclass
class Run:
    params: list[dict[str, torch.Tensor]]  # step.gather after each step
    losses: list[float]
    state_dict: dict[str, torch.Tensor]  # step.state_dict(state, model)
    model: nn.Module  # the user's module fzero was given
    before: dict[str, torch.Tensor]  # its state_dict before training


def fzero_state_dict(step: Any, state: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``step.state_dict(state, model)``: params and buffers, keyed as ``model.state_dict()`` (tied aliases too)."""
    return step.state_dict(state, model)


def fzero_run(entry: Entry, *, stages: int, ranks: int) -> Run:
    model = entry.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def loss_fn(params, batch):
        return entry.loss(lambda *a, **k: fzero.apply(model, params, *a, **k), batch)

    optimizer = fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)
    step = fzero.compile(loss_fn, optimizer=optimizer, stages=stages, mesh=fzero.local_mesh(ranks), **entry.settings)
    state = step.init(fzero.params_of(model))
    params, losses = [], []
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    for batch in entry.batches():
        state, metrics = step(state, batch)
        params.append(step.gather(state))
        losses.append(float(metrics["loss"]))
    return Run(params, losses, fzero_state_dict(step, state, model), model, before)


# ------------------------------------------------------------------------------------ comparisons


def compared(name: str, ref: Reference) -> torch.Tensor | None:
    """Which elements of param ``name`` are compared: those whose reference gradient reached NOISE in some
    step. Elements below it in every step are rounding noise (e.g. attention key biases, also the key third
    of GPT-2's fused c_attn bias), which Adam turns into O(lr) steps, or exact zeros (rows of
    an embedding never looked up): skipped. None for a param that never got a gradient (grad is None in
    every step): it must be bitwise what torch.optim left, its initial value."""
    if not any(name in used for used in ref.used):
        return None
    return ref.grad_max[name] >= NOISE


def _param_error(name: str, got: torch.Tensor, ref: Reference, k: int) -> str | None:
    expected, keep = ref.params[k][name], compared(name, ref)
    if keep is None:
        if torch.equal(got, expected):
            return None
        return (f"step {k + 1}: {name} never gets a gradient in torch, so AdamW leaves it as it is; fzero moved it by "
                f"{(got - expected).abs().max().item():.3g}")
    try:
        torch.testing.assert_close(got[keep], expected[keep], rtol=RTOL, atol=ATOL)
    except AssertionError as err:
        return f"step {k + 1}: param {name}: {err}"
    return None


def assert_params_match(got: dict[str, torch.Tensor], ref: Reference, k: int) -> None:
    """Params after step k within RTOL/ATOL of the reference, on the elements ``compared`` says."""
    if set(got) != set(ref.params[k]):
        raise AssertionError(f"step {k + 1}: param names differ: {sorted(set(got) ^ set(ref.params[k]))}")
    for name in ref.params[k]:
        error = _param_error(name, got[name], ref, k)
        if error:
            raise AssertionError(error)


def param_difference(got: dict[str, torch.Tensor], ref: Reference, k: int) -> tuple[float, str]:
    """Max abs difference of step k's params from the reference over the compared elements, and where."""
    worst, where = 0.0, ""
    for name, expected in ref.params[k].items():
        keep = compared(name, ref)
        keep = torch.ones_like(expected, dtype=torch.bool) if keep is None else keep
        if keep.any():
            d = (got[name].double() - expected.double())[keep].abs().max().item()
            if d > worst or d != d:
                worst, where = d, name
    return worst, where


def assert_state_dict_match(run: Run, ref: Reference, entry: Entry) -> None:
    """``step.state_dict(state)`` against rank 0's ``model.state_dict()``: the same keys, params (tied
    aliases included) as ``assert_params_match``, buffers within RTOL/ATOL (integer ones equal), and
    ``load_state_dict(strict=True)`` accepts it."""
    sd, expected = run.state_dict, ref.state_dict
    if set(sd) != set(expected):
        raise AssertionError(f"step.state_dict keys differ from model.state_dict(): {sorted(set(sd) ^ set(expected))}")
    for key, e in expected.items():
        g = sd[key]
        if key in ref.aliases:
            error = _param_error(ref.aliases[key], g, ref, len(ref.params) - 1)
            if error:
                raise AssertionError(f"step.state_dict()[{key!r}]: {error}")
        elif e.is_floating_point():
            torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL, msg=lambda m, key=key: f"buffer {key}: {m}")
        elif not torch.equal(g, e):
            raise AssertionError(f"buffer {key}: {g} != {e}")
    copy.deepcopy(run.model).load_state_dict(sd, strict=True)


def assert_module_untouched(run: Run) -> None:
    after = run.model.state_dict(keep_vars=True)  # by reference: a trained module refuses a plain state_dict()
    for key, e in run.before.items():
        g = after[key]
        if g.dtype != e.dtype or g.shape != e.shape or not torch.equal(g, e):
            raise AssertionError(f"fzero wrote into the user's module: {key} changed")


def check(entry: Entry, ref: Reference, run: Run) -> None:
    """Everything the zoo asserts, in order: params each step, loss each step, module untouched, state_dict."""
    for k in range(len(ref.params)):
        assert_params_match(run.params[k], ref, k)
        if abs(run.losses[k] - ref.losses[k]) > RTOL * abs(ref.losses[k]) + ATOL:
            raise AssertionError(f"step {k + 1}: loss {run.losses[k]} != reference {ref.losses[k]}")
    assert_module_untouched(run)
    assert_state_dict_match(run, ref, entry)


def matrix() -> None:
    """Print model x stage x mesh: pass, or why not (max param difference over the steps, or the exception)."""
    torch.set_num_threads(1)
    for name, entry in ZOO.items():
        for ranks in (1, 2):
            ref = reference_run(entry, ranks)
            for stages in (0, 1, 2, 3):
                try:
                    run = fzero_run(entry, stages=stages, ranks=ranks)
                except Exception as e:  # noqa: BLE001 - reported
                    print(f"{name:20s} stage {stages} mesh {ranks}: ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
                    continue
                diff = max(param_difference(run.params[k], ref, k) for k in range(STEPS))
                try:
                    check(entry, ref, run)
                    verdict = "pass"
                except AssertionError as e:
                    verdict = "FAIL " + str(e).splitlines()[0][:150]
                print(f"{name:20s} stage {stages} mesh {ranks}: {verdict} (max param diff {diff[0]:.2e} at {diff[1]})", flush=True)


if __name__ == "__main__":
    matrix()
