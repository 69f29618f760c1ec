"""How a batch reaches loss_fn on the ranks of a local mesh and in micro-batches: split on its rows whatever holds
them, and each rank's tensors its own.

Found by a sweep of batch and data cases: a dataclass batch, and Hugging Face's ``BatchEncoding`` (what a tokenizer
returns, a ``UserDict``), were taken whole by every rank and micro-batch, silently (optree takes them as leaves);
and the ranks' shares were views of one tensor, so one rank's in-place write to its labels broke another's
backward (intermittently) or, for a 0-d leaf, changed what the other read.
"""

import copy
import dataclasses
import math

import pytest
import torch

import fzero
from fzero.testing import assert_trees_equal


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "a field that is not a tensor"


def _run(batch_of, *, ranks, accum, write=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    seen = []

    def loss_fn(params, b):
        x, y = (b["x"], b["y"]) if not isinstance(b, _Batch) else (b.x, b.y)
        seen.append(x.shape[0])
        out = fzero.apply(model, params, x)
        if write:
            y.mul_(2.0)  # in place, after the forward used nothing of it
            return (out - y / 2.0).square().sum()
        return (out - y).square().sum()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    state = step.init(fzero.params_of(model))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        state, _ = step(state, batch_of(x, y))
    return step.gather(state), seen


@pytest.mark.parametrize("ranks, accum", [(1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("container", ["dataclass", "BatchEncoding"])
def test_a_dataclass_or_batchencoding_batch_is_split_as_a_dict_is(container, ranks, accum):
    if container == "BatchEncoding":
        BatchEncoding = pytest.importorskip("transformers").BatchEncoding
        batch_of = lambda x, y: BatchEncoding({"x": x, "y": y})  # noqa: E731
    else:
        batch_of = _Batch
    want, rows = _run(lambda x, y: {"x": x, "y": y}, ranks=ranks, accum=accum)
    got, seen = _run(batch_of, ranks=ranks, accum=accum)
    assert seen == rows == [8 // (ranks * accum)] * (3 * ranks * accum)
    assert_trees_equal(got, want)


def test_rows_inside_a_batchencoding_are_checked():
    BatchEncoding = pytest.importorskip("transformers").BatchEncoding
    model = torch.nn.Linear(4, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b["x"]).sum(), stages=0, mesh=fzero.local_mesh(2))
    with pytest.raises(ValueError, match=r"batch leaf 'x' has dim 0 of size 7, which does not divide by 2"):
        step(step.init(fzero.params_of(model)), BatchEncoding({"x": torch.randn(7, 4)}))


def test_a_rank_that_writes_its_batch_in_place_changes_no_other_rank():
    """On two ranks, a loss_fn that writes its labels in place trains as one that does not, every time (the race was
    intermittent: 9 of 20 runs failed at stage 0)."""
    want, _ = _run(lambda x, y: {"x": x, "y": y}, ranks=2, accum=1)
    for _ in range(5):
        got, _ = _run(lambda x, y: {"x": x, "y": y}, ranks=2, accum=1, write=True)
        assert_trees_equal(got, want)


def test_a_0d_leaf_is_each_ranks_own():
    model = torch.nn.Linear(4, 1)
    read = []

    def loss_fn(params, b):
        read.append(float(b["t"]))
        b["t"].add_(1.0)  # a rank changes its own temperature only
        return fzero.apply(model, params, b["x"]).sum() * b["t"]

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(2))
    t = torch.tensor(2.0)
    step(step.init(fzero.params_of(model)), {"x": torch.randn(4, 4), "t": t})
    assert read == [2.0, 2.0] and float(t) == 2.0


def test_a_meta_batch_at_stage_3_is_named_as_the_batch():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).sum(), stages=3, mesh=fzero.local_mesh(1))
    with pytest.raises(RuntimeError, match=r"(?s)share of the batch: \{<root>: float32 \(4, 4\) on meta\}.*The batch holds meta "
                                           r"tensors") as info:
        step(step.init(fzero.params_of(model)), torch.empty(4, 4, device="meta"))
    assert "a unit's params are meta tensors" not in str(info.value)


@pytest.mark.parametrize("stages", [0, 1, 2])
def test_a_meta_batch_is_named_as_the_batch_at_every_stage(stages):
    """Stages 0-1 ran into torch's bare "Tensor on device cpu is not on the expected device meta!" (stages 2-3 named it)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).sum(), stages=stages, mesh=fzero.local_mesh(1))
    with pytest.raises(RuntimeError, match=r"(?s)on meta\}.*The batch holds meta tensors"):
        step(step.init(fzero.params_of(model)), torch.empty(4, 4, device="meta"))


def test_two_devices_in_loss_fn_are_named_with_the_state_s_device_and_the_fix():
    """torch's "Expected all tensors to be on the same device" from inside the model (a state made from params on the
    host, batches on the GPU; seen on an H200 after a checkpoint load) says where the step computes and how to put
    the model, the state and the batch on one device. The message itself is checked here (on the CPU every device is
    the host); ``test_devices.py`` runs the case on a GPU."""
    from fzero.step._hints import loss_fn_failure

    error = RuntimeError("Expected all tensors to be on the same device, but got mat1 is on cuda:0, different from other "
                         "tensors on cpu (when checking argument in method wrapper_CUDA_addmm)")
    message = loss_fn_failure(error, {"x": torch.zeros(2, 3)}, params={"w": torch.zeros(2)})
    assert "The step computes where the state's params are (cpu)" in message
    assert "model.to(device), then fzero.params_of(model) and step.init" in message and "fzero.checkpoint.load" in message
    assert "The batch (on cpu)" in message
    other = loss_fn_failure(RuntimeError("Tensor on device cpu is not on the expected device cuda:0!"), None,
                            params={"w": torch.empty(2, device="meta")})  # stages 2-3: stand-ins, not named
    assert "The step computes where the state's params are:" in other
    # a meta tensor's device message at stages 2-3 keeps its own cause (a unit's param used outside the unit's call)
    unit = loss_fn_failure(RuntimeError("Tensor on device meta is not on the expected device cpu!"), None, units=True)
    assert "A meta tensor (a shape without a value) was used" in unit and "Two devices met" not in unit


def test_an_integer_loss_is_told_to_be_floating_point():
    model = torch.nn.Linear(4, 1)
    step = fzero.compile(lambda p, b: (fzero.apply(model, p, b).sum() > 0).long(), stages=0)
    with pytest.raises(ValueError, match=r"a torch.int64 tensor of shape \(\)\. Compute it in floating point"):
        step(step.init(fzero.params_of(model)), torch.randn(4, 4))


def test_the_loss_metric_of_bf16_micro_batches_is_their_mean_in_fp32():
    model = torch.nn.Linear(4, 1)
    losses = []

    def loss_fn(p, b):
        loss = fzero.apply(model, p, b).square().mean().to(torch.bfloat16)
        losses.append(float(loss.detach()))
        return loss

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, grad_accum=2)
    gen = torch.Generator().manual_seed(3)
    _, metrics = step(step.init(fzero.params_of(model)), torch.randn(8, 4, generator=gen) * 3)
    assert metrics["loss"] == pytest.approx(sum(losses) / 2, rel=1e-6)


@pytest.mark.parametrize("ranks, accum", [(1, 2), (2, 1), (2, 2)])
def test_the_rows_strings_go_with_their_rows(ranks, accum):
    """default_collate makes a string field a list of one string per row: each rank and micro-batch reads its own
    rows' (as a torchrun process reads its own loader's), not every row's beside its share of the tensors. A list
    of another length, or one that holds tensors, is not the rows' and is given whole / looked into as before."""
    model = torch.nn.Linear(2, 1)
    seen = []

    def loss_fn(params, b):
        seen.append((list(b["id"]), b["x"][:, 0].long().tolist(), b["names"], b["pair"][0].shape[0], b["tags"]))
        return fzero.apply(model, params, b["x"]).sum()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    x = torch.stack([torch.arange(8.0), torch.zeros(8)], 1)  # row i holds i
    batch = {"x": x, "id": [str(i) for i in range(8)], "names": ["cat", "dog", "eel"],
             "pair": [torch.ones(8), torch.ones(8)], "tags": ("a",) * 8}
    step(step.init(fzero.params_of(model)), batch)
    per = 8 // (ranks * accum)
    assert sorted(r for ids, rows, *_ in seen for r in rows) == list(range(8))
    for ids, rows, names, pair, tags in seen:
        assert ids == [str(r) for r in rows] and len(ids) == per
        assert names == ["cat", "dog", "eel"] and pair == per and tags == ("a",) * per
    assert batch["id"] == [str(i) for i in range(8)]  # the caller's list is left whole


def test_rows_strings_that_do_not_divide_are_named():
    model = torch.nn.Linear(2, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b["x"]).sum(), stages=0, mesh=fzero.local_mesh(2), grad_accum=2)
    with pytest.raises(ValueError, match=r"under local_mesh\(2\) the global batch is split on dim 0 across 2 ranks, and "
                                         r"each rank's share into grad_accum=2 micro-batches, but batch leaf 'id' has 6 items, "
                                         r"which does not divide by 4\. Pass a batch whose dim 0 is a multiple of 4"):
        step(step.init(fzero.params_of(model)), {"x": torch.randn(6, 2), "id": list("abcdef")})


@pytest.mark.parametrize("ranks, accum", [(2, 1), (1, 2)])
def test_a_list_of_numbers_as_long_as_the_rows_is_given_whole(ranks, accum):
    """default_collate makes a number field a tensor, so a list of numbers in a batch is the caller's constant (an
    image size, per-class weights): it is given whole to every rank and micro-batch, as before the rows' strings were
    split, even where it happens to hold one item per row (it was split: each rank read half of the constant, and the
    loss changed with the mesh, silently)."""
    model = torch.nn.Linear(2, 1)
    seen = []

    def loss_fn(params, b):
        seen.append((b["size"], b["weights"], b["id"]))
        return fzero.apply(model, params, b["x"]).sum() * sum(b["weights"])

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    step(step.init(fzero.params_of(model)), {"x": torch.randn(2, 2), "size": (224, 224), "weights": [0.5, 2.0],
                                              "id": ["a", "b"]})
    assert [s[:2] for s in seen] == [((224, 224), [0.5, 2.0])] * 2
    assert sorted(s[2][0] for s in seen) == ["a", "b"]  # the rows' strings still go with their rows


@pytest.mark.parametrize("ranks,accum", [(2, 1), (1, 2)])
def test_a_list_of_one_list_per_row_goes_with_its_rows(ranks, accum):
    """A custom collate's variable-length field (one list of ints per row) is a record per row: each rank and
    micro-batch reads its own rows' (given whole, each read every row's: a loss over the tags of 11.5 for torch's 22.5)."""
    model = torch.nn.Linear(2, 1)
    seen = []

    def loss_fn(params, b):
        seen.append((b["x"][:, 0].long().tolist(), b["tags"]))
        return fzero.apply(model, params, b["x"]).sum()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    x = torch.stack([torch.arange(4.0), torch.zeros(4)], 1)  # row i holds i
    tags = [[0], [1, 1], [2], [3, 3, 3]]
    step(step.init(fzero.params_of(model)), {"x": x, "tags": tags})
    assert len(seen) == 2
    for rows, got in seen:
        assert got == [tags[r] for r in rows]


def _detection_batch(n=4):
    """torchvision's detection batch, as ``collate_fn=lambda s: tuple(zip(*s))`` makes it: images of their own sizes,
    targets of their own box counts (image 1 has none, a negative image). Image i is filled with i, its labels too."""
    sizes, boxes = [(5, 7), (6, 4), (3, 3), (4, 6)], [3, 0, 1, 2]
    images = tuple(torch.full((3, *sizes[i % 4]), float(i)) for i in range(n))
    targets = tuple({"boxes": torch.rand(boxes[i % 4], 4) * 3, "labels": torch.full((boxes[i % 4],), i)} for i in range(n))
    return images, targets


class _PerImage(torch.nn.Module):
    """A detector's shape of forward: a list of images in, one loss per image, summed over its boxes."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 1)

    def forward(self, images, targets):
        losses = [self.conv(img).mean() * (1.0 + t["boxes"].sum()) for img, t in zip(images, targets)]
        return {"loss_a": torch.stack(losses).mean(), "loss_b": self.conv.weight.square().sum()}


@pytest.mark.parametrize("ranks, accum", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_a_detection_batch_of_lists_goes_image_by_image_with_its_targets(ranks, accum):
    """Each rank and micro-batch gets its own images with their own targets, as torchrun's per-rank loaders give them,
    and the update is plain PyTorch's on the mean of the parts' losses (DDP). Before, every such batch was refused,
    even on local_mesh(1): the tensors' dim 0 (an image's 3 channels, a target's box counts) were taken as rows."""
    torch.manual_seed(0)
    model = _PerImage()
    reference = copy.deepcopy(model)  # (the model itself is behind the state after the step: a direct call refuses)
    seen = []

    def loss_fn(params, batch):
        images, targets = batch
        seen.append([(int(img[0, 0, 0]), t["labels"].tolist()) for img, t in zip(images, targets)])
        return sum(fzero.apply(model, params, images, targets).values())

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    batch = _detection_batch()
    state, metrics = step(step.init(fzero.params_of(model)), batch)
    per = 4 // (ranks * accum)
    assert sorted(i for part in seen for i, _ in part) == [0, 1, 2, 3] and {len(part) for part in seen} == {per}
    assert all(labels == [i] * len(labels) for part in seen for i, labels in part)  # each image with its own targets
    images, targets = batch
    parts = [sum(reference(images[j:j + per], targets[j:j + per]).values()) for j in range(0, 4, per)]
    loss = torch.stack(parts).mean()
    loss.backward()
    torch.testing.assert_close(float(metrics["loss"]), loss.item(), rtol=1e-6, atol=1e-6)
    got = step.gather(state)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach() - 0.1 * p.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ranks, accum", [(2, 1), (1, 2)])
def test_a_detr_batch_splits_its_labels_list_with_its_pixel_values(ranks, accum):
    """Hugging Face's DETR/YOLOS/Mask2Former batches: ``pixel_values`` of B rows beside ``labels``, a list of one
    dict per image (``class_labels``, ``boxes`` of the image's own count). Each part reads its own images' labels."""
    model = torch.nn.Linear(2, 1)
    seen = []

    def loss_fn(params, b):
        seen.append((b["pixel_values"][:, 0].long().tolist(), [int(t["class_labels"][0]) for t in b["labels"]],
                     [t["boxes"].shape[0] for t in b["labels"]]))
        return fzero.apply(model, params, b["pixel_values"]).sum()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    x = torch.stack([torch.arange(4.0), torch.zeros(4)], 1)  # row i holds i
    labels = [{"class_labels": torch.full((n,), i), "boxes": torch.rand(n, 4)} for i, n in enumerate([2, 1, 3, 2])]
    step(step.init(fzero.params_of(model)), {"pixel_values": x, "labels": labels})
    assert len(seen) == 2
    for rows, own, counts in seen:
        assert own == rows and counts == [[2, 1, 3, 2][r] for r in rows]


@pytest.mark.parametrize("ranks, accum", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked_images", "detr_labels"])
def test_a_detection_batch_whose_box_counts_equal_its_rows_still_goes_image_by_image(ranks, accum, stacked):
    """Images stacked in one [B, 3, H, W] tensor (or DETR's pixel_values) beside B target dicts that each hold B boxes:
    every tensor's dim 0 is B, one row count, so the batch was split on the tensors' dim 0 and every part got all B
    target dicts, cut to its own rows' boxes (rank 1 of 2: images 2-3 with targets 0-1's boxes 2-3). A detector pairs
    image i with targets[i], so it trained on other images' boxes, silently (torchvision FCOS: loss 2.7564 where DDP
    has 2.7797), or failed deep in DETR's matcher (IndexError). The list of dicts is read as the rows there too."""
    seen = []
    model = torch.nn.Linear(2, 1)

    def loss_fn(params, b):
        images, targets = (b["pixel_values"], b["labels"]) if not stacked else b
        seen.append((images[:, 0, 0, 0].long().tolist(), [t["labels"].tolist() for t in targets]))
        return fzero.apply(model, params, images[:, 0, 0, :2]).sum()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    images = torch.arange(4.0)[:, None, None, None].expand(4, 3, 5, 5).clone()  # image i is filled with i
    targets = [{"boxes": torch.rand(4, 4), "labels": torch.full((4,), i)} for i in range(4)]  # 4 boxes each, of image i
    batch = (images, targets) if stacked else {"pixel_values": images, "labels": targets}
    step(step.init(fzero.params_of(model)), batch)
    per = 4 // (ranks * accum)
    assert len(seen) == ranks * accum
    for rows, labels in seen:
        assert len(rows) == per and labels == [[r] * 4 for r in rows]  # each image with its own 4 boxes


def test_lists_of_per_row_records_that_disagree_with_the_rows_are_refused_by_name():
    model = torch.nn.Linear(2, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b["x"]).sum(), stages=0, mesh=fzero.local_mesh(2))
    labels = [{"boxes": torch.rand(n, 4)} for n in (1, 2, 3)]  # 3 dicts for 4 rows
    with pytest.raises(ValueError, match=r"row counts differ \(a list of one tensor or one dict of tensors per row, as a "
                                         r"detection batch's images and targets, counted by its length\): 'labels' has 3, "
                                         r"'x' has 4\. Pass leaves of one row count"):
        step(step.init(fzero.params_of(model)), {"x": torch.randn(4, 2), "labels": labels})


@pytest.mark.parametrize("ranks, accum", [(2, 1), (1, 2)])
@pytest.mark.parametrize("batch", [
    (torch.randn(8, 4), torch.randint(0, 3, (32,))),  # per-token labels flattened beside [B, T] inputs
    [torch.randn(8, 4), torch.randn(4, 4)],  # a contrastive pair of two row counts
    {"inputs": (torch.randn(8, 4), torch.randint(0, 3, (32,)))},
], ids=["tuple", "list", "nested"])
def test_batched_tensors_of_two_row_counts_are_refused_not_split_as_records(ranks, accum, batch):
    """``(x, y)`` of batched tensors whose row counts differ is refused by name, as before per-image records were
    split: read as two records, rank 0 (or micro-batch 0) got ``x`` alone and the other ``y`` alone."""
    model = torch.nn.Linear(4, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, torch.utils._pytree.tree_leaves(b)[0]).sum(), stages=0,
                         mesh=fzero.local_mesh(ranks), grad_accum=accum)
    with pytest.raises(ValueError, match=r"row counts differ: .* has 8"):
        step(step.init(fzero.params_of(model)), batch)


def test_a_ragged_embedding_bag_batch_is_refused_with_the_padded_layout_as_the_fix():
    """``nn.EmbeddingBag``'s flat 1-D input with offsets (torch's documented layout) has no rows to split: refused
    for its row counts, which named no layout that trains. The error names the padded 2-D input with
    ``per_sample_weights``, which trains at every stage (a model sweep's case)."""

    class Bag(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.head = torch.nn.EmbeddingBag(20, 8, mode="sum"), torch.nn.Linear(8, 2)

        def forward(self, ids, w, offsets=None):
            return self.head(self.bag(ids, offsets, per_sample_weights=w))

    torch.manual_seed(0)
    model = Bag()
    step = fzero.compile(lambda p, b: torch.nn.functional.mse_loss(fzero.apply(model, p, *b["x"]), b["y"]), stages=0,
                         mesh=fzero.local_mesh(1))
    state = step.init(fzero.params_of(model))
    flat = {"x": (torch.randint(0, 20, (12,)), torch.rand(12), torch.tensor([0, 3, 6, 9])), "y": torch.randn(4, 2)}
    with pytest.raises(ValueError, match=r"row counts differ(.|\n)*ragged batch, flat values with offsets(.|\n)*"
                                         r"nn.EmbeddingBag takes 2-D input with per_sample_weights"):
        step(state, flat)
    padded = {"x": (flat["x"][0].view(4, 3), flat["x"][1].view(4, 3)), "y": flat["y"]}
    state, metrics = step(state, padded)
    assert math.isfinite(metrics["loss"])


@pytest.mark.parametrize("ranks, accum", [(2, 1), (1, 2)])
def test_a_list_of_same_size_images_read_as_channel_rows_names_the_cause_and_the_fix(ranks, accum):
    """An eval batch of same-size images, a list of [3, H, W] tensors and no tensor of another dim 0: every tensor's
    dim 0 is 3, so the step reads 3 rows (the channels), as it reads default_collate's [x, y], and refuses them as
    not dividing by 2, naming dim 0 of size 3 without saying why. The error says so and names the fixes, each of which
    then splits the images (what splits is unchanged)."""
    model = torch.nn.Conv2d(3, 2, 1)
    seen = []

    def loss_fn(params, batch):
        images = batch["images"]
        seen.append([int(img[0, 0, 0]) for img in images])
        return torch.stack([fzero.apply(model, params, img).mean() for img in images]).mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(ranks), grad_accum=accum)
    state = step.init(fzero.params_of(model))
    images = [torch.full((3, 5, 5), float(i)) for i in range(4)]
    with pytest.raises(ValueError, match=r"batch leaf 'images.0' has dim 0 of size 3, which does not divide by 2\. .* "
                                         r"Leaf 'images.0' is an item of 'images', a list of 4 tensors, and every tensor "
                                         r"of the batch has one dim 0, so it was read as the rows\. .*stack them into "
                                         r"one \[4, C, H, W\] tensor, or pass a per-row tensor beside the list \(e\.g\. "
                                         r"image ids, torch\.arange\(4\)\)"):
        step(state, {"images": images})
    step(state, {"images": images, "ids": torch.arange(4)})  # the fix: the list's items are the rows
    assert sorted(seen) == [[0, 1], [2, 3]]  # (the ranks run at once: in either order)


@pytest.mark.parametrize("stages", [0, 3])
@pytest.mark.parametrize("container", ["dict", "dataclass"])
def test_a_generator_in_the_batch_is_each_ranks_own_on_a_local_mesh_of_two_ranks(stages, container):
    """Found by a sweep of habits: a ``torch.Generator`` passed in the batch (noise drawn in loss_fn with
    ``generator=batch["gen"]``) was given whole to both rank threads of a local_mesh(2), which drew from one stream in
    the order the threads ran: the loss after 3 AdamW steps was 1.796, 1.772, 1.624 in three runs of one program.
    Each torchrun process (DDP) draws from its own generator, seeded alike. Now each rank draws from its own copy, as
    from a generator a module holds, and the batch's generator ends in rank 0's state."""
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(3, 8, 4, generator=g), torch.randn(3, 8, 1, generator=g)

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    ref = build()  # DDP: each rank's process holds a generator of its own, seeded alike
    gens = [torch.Generator().manual_seed(5) for _ in range(2)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        for r, (xr, yr) in enumerate(zip(x.chunk(2), y.chunk(2))):
            noisy = xr + torch.randn(xr.shape, generator=gens[r])
            ((ref(noisy) - yr).square().mean() / 2).backward()
        opt.step()

    model = build()

    def loss_fn(params, b):
        x, y, gen = (b["x"], b["y"], b["gen"]) if container == "dict" else (b.x, b.y, b.gen)
        return (fzero.apply(model, params, x + torch.randn(x.shape, generator=gen)) - y).square().mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.adamw(1e-2, weight_decay=0.01), stages=stages,
                         mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    gen = torch.Generator().manual_seed(5)
    for x, y in zip(xs, ys):
        state, _ = step(state, {"x": x, "y": y, "gen": gen} if container == "dict" else _NoisyBatch(x, y, gen))
    full = step.gather(state)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(gen.get_state(), gens[0].get_state())  # rank 0's, as a torchrun job's rank 0 holds it
    step.evaluate(state, {"x": xs[0], "y": ys[0], "gen": gen} if container == "dict" else _NoisyBatch(xs[0], ys[0], gen))
    torch.randn((4, 4), generator=gens[0])
    assert torch.equal(gen.get_state(), gens[0].get_state())


def test_a_generator_in_the_batch_goes_on_from_each_ranks_own_state_when_the_ranks_draw_other_amounts():
    """A ``torch.Generator`` in the batch drawn from once per kept row (a number that depends on the rank's rows, as
    one draw per non-padding token): each rank of local_mesh(2) drew from its own copy, but every step (and
    ``evaluate``) started both copies from the caller's generator, which holds rank 0's state, where each torchrun
    process goes on from its own: rank 1 drew rank 0's numbers from the second step on. Each rank's copy now goes on
    from its own end state, as a stream a module holds does; the caller's generator still ends in rank 0's state."""
    x = torch.randn(4, 4, 4, generator=torch.Generator().manual_seed(1)).abs()
    signs = [[1, 1, -1, -1], [-1, -1, 1, -1], [1, 1, -1, -1], [-1, -1, 1, -1]]  # kept rows per rank: 2-0, 0-1, ...
    x[..., 0] *= torch.tensor(signs, dtype=x.dtype)

    def noisy(model, rows, gen):
        scale = [1.0 + torch.rand((), generator=gen).item() if float(r[0]) > 0 else 1.0 for r in rows]
        return model(rows * torch.tensor(scale)[:, None]).pow(2).mean()

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    ref, gens = build(), [torch.Generator().manual_seed(5) for _ in range(2)]  # two processes, a generator each
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for i, b in enumerate(x):
        if i == 2:  # an evaluate between steps draws too
            with torch.no_grad():
                for r, rows in enumerate(x[1].chunk(2)):
                    noisy(ref, rows, gens[r])
        opt.zero_grad()
        for r, rows in enumerate(b.chunk(2)):
            (noisy(ref, rows, gens[r]) / 2).backward()
        opt.step()
        want.append({k: p.detach().clone() for k, p in ref.named_parameters()})

    model = build()
    step = fzero.compile(lambda p, b: noisy(lambda h: fzero.apply(model, p, h), b["x"], b["gen"]),
                         optimizer=fzero.optim.sgd(0.1), stages=0, mesh=fzero.local_mesh(2))
    state, gen = step.init(fzero.params_of(model)), torch.Generator().manual_seed(5)
    for i, b in enumerate(x):
        if i == 2:
            step.evaluate(state, {"x": x[1], "gen": gen})
        state, _ = step(state, {"x": b, "gen": gen})
        full = step.gather(state)
        for name, p in want[i].items():
            torch.testing.assert_close(full[name], p, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {i + 1}, {name}: {m}")
    assert torch.equal(gen.get_state(), gens[0].get_state())  # rank 0's, as a torchrun job's rank 0 holds it


@dataclasses.dataclass
class _NoisyBatch:
    x: torch.Tensor
    y: torch.Tensor
    gen: torch.Generator


def test_a_generator_the_batch_names_twice_is_one_stream_on_each_rank():
    """Found in review: each place a generator appeared in the batch got copies of its own, so the two names of one
    generator drew the same numbers on a rank (where a torchrun process draws them in turn from its one generator),
    and the caller's generator ended the step in the state of one of them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    seen = []

    def loss_fn(params, b):
        seen.append((torch.randn(2, generator=b["gen"]), torch.randn(2, generator=b["aug"]["gen"])))
        return fzero.apply(model, params, b["x"]).square().mean()

    step = fzero.compile(loss_fn, optimizer=fzero.optim.sgd(1e-2), mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    gen = torch.Generator().manual_seed(5)
    step(state, {"x": torch.randn(4, 4), "gen": gen, "aug": {"gen": gen}})
    ref = torch.Generator().manual_seed(5)  # one torchrun process: one stream, drawn in turn
    first, second = torch.randn(2, generator=ref), torch.randn(2, generator=ref)
    assert len(seen) == 2
    for a, b in seen:
        assert torch.equal(a, first) and torch.equal(b, second)
    assert torch.equal(gen.get_state(), ref.get_state())


def test_a_dataclass_batch_without_a_generator_is_not_rebuilt_for_the_generator_copies():
    """Found in review: looking for generators, a local_mesh step rebuilt every dataclass (and Mapping) batch
    whole each step, generator or not: one more __post_init__ on all the rows before the split's per-rank ones."""
    calls = []

    @dataclasses.dataclass
    class Rows:
        x: torch.Tensor

        def __post_init__(self):
            calls.append(self.x.shape[0])

    model = torch.nn.Linear(4, 1)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b.x).square().mean(), optimizer=fzero.optim.sgd(1e-2),
                         mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    batch = Rows(torch.randn(4, 4))
    calls.clear()
    step(state, batch)
    assert calls == [2, 2]  # each rank's part, as before generators were copied
