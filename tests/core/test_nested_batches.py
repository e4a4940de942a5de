"""Nested batches (issue 57): inputs and target nest lists, tuples and dicts of tensors, as a
detector's step does (a list of images of different sizes, a list of target dicts), and the
ranks each get their share along the batch: a tensor's first dimension, a list's items."""

from __future__ import annotations

import collections
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookbench import Workload, gate
from hookbench.core.workload import batch_axes, cut
from hookbench.gate import workload_checks
from hookbench.measure.zero2_runs import local_batch


class Detector(nn.Module):
    """A detector's shape of step: images of different sizes in a list, per image a class and
    a box, with dropout on the pooled features."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 4, 3, padding=1)
        self.meta = nn.Linear(2, 4)
        self.classes = nn.Linear(4, 3)
        self.boxes = nn.Linear(4, 4)

    def forward(self, images: list[torch.Tensor], meta: tuple[torch.Tensor]) -> dict:
        pooled = torch.stack([self.backbone(im[None]).mean((2, 3))[0] for im in images])
        features = F.dropout(torch.tanh(pooled + self.meta(meta[0])), 0.1, self.training)
        return {"logits": self.classes(features), "boxes": self.boxes(features)}


def images_and_targets(g: torch.Generator) -> tuple[dict, list[dict]]:
    sizes = [(6, 8), (8, 6), (7, 7), (5, 9)]
    images = [torch.randn(3, h, w, generator=g) for h, w in sizes]
    targets = [{"boxes": torch.rand(2, 4, generator=g),
                "labels": torch.randint(0, 3, (2,), generator=g)} for _ in sizes]
    return {"images": images, "meta": (torch.randn(4, 2, generator=g),)}, targets


def detection_loss(output: dict, targets: list[dict]) -> torch.Tensor:
    labels = torch.stack([t["labels"][0] for t in targets])
    boxes = torch.stack([t["boxes"][0] for t in targets])
    return F.cross_entropy(output["logits"], labels) + F.smooth_l1_loss(output["boxes"], boxes)


DETECTOR = Workload("detector", model=Detector, batch=images_and_targets, loss=detection_loss,
                    optimizer=(torch.optim.AdamW, {"lr": 1e-2}))


def test_every_batch_axis_is_found_and_cut():
    inputs, targets = DETECTOR.data(0)
    assert batch_axes((targets, inputs)) == [("batch[0]", 4), ("batch[1]['images']", 4),
                                             ("batch[1]['meta'][0]", 4)]
    x, y = local_batch(DETECTOR, 0, 1, 2, "cpu")  # rank 1 of 2: the second half
    assert [im.shape for im in x["images"]] == [im.shape for im in inputs["images"][2:]]
    assert all(torch.equal(a, b) for a, b in zip(x["images"], inputs["images"][2:]))
    assert torch.equal(x["meta"][0], inputs["meta"][0][2:]) and isinstance(x["meta"], tuple)
    assert [t["labels"].tolist() for t in y] == [t["labels"].tolist() for t in targets[2:]]
    assert DETECTOR.batch_size == 4
    # the structure is kept, a named tuple's too
    pair = collections.namedtuple("Pair", "ids mask")(torch.arange(4), torch.ones(4))
    assert type(cut(pair, slice(0, 2))) is type(pair)


def test_axes_that_disagree_are_refused_naming_both():
    def six_rows(g):
        inputs, targets = images_and_targets(g)
        return {**inputs, "meta": (torch.randn(6, 2, generator=g),)}, targets

    with pytest.raises(ValueError, match=r"batch\(generator\)'s inputs\['meta'\]\[0\] has 6 "
                                         r"rows, target 4"):
        DETECTOR.replace(batch=six_rows).check(shares=2)
    with pytest.raises(ValueError, match=r"gives a batch of 4 rows \(target\), which does not "
                                         r"split over 3"):
        DETECTOR.check(shares=3)


def test_a_leaf_that_is_not_a_tensor_is_refused_naming_it():
    def named(g):
        inputs, targets = images_and_targets(g)
        targets[1]["name"] = "cat"
        return inputs, targets

    with pytest.raises(TypeError, match=r"or lists, tuples and dicts of them \(nested\), got "
                                        r"target\[1\]\['name'\]: str"):
        DETECTOR.replace(batch=named).data(0)


@pytest.mark.distributed
def test_a_detectors_step_holds_in_every_row_on_its_shares():
    DETECTOR.check(shares=2, batches=3)
    got = workload_checks.measure_all([DETECTOR])
    assert not gate.failures({"workloads": got})
    assert got["detector/engines/ddp"]["parity"], got["detector/engines/ddp"]
    assert got["detector/memory/foreach"]["backend"] == "fake" and got["detector/capture"]["records"]
