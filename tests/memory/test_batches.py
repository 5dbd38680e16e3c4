"""Batches cut into pieces: the pytree walk, sample lists, mappings of other kinds, and
each piece's weight."""

from __future__ import annotations

from collections import OrderedDict, UserDict, namedtuple

import pytest
import torch

from hf_triaccel.memory.batches import batch_size, piece_weight, slice_batch

Pair = namedtuple("Pair", "x y")


def test_slice_batch_shapes():
    batch = {
        "x": torch.arange(12).view(6, 2),
        "mask": torch.ones(1, 3),  # not per sample: passed whole
        "texts": list("abcdef"),
        "pair": Pair(torch.arange(6), torch.arange(6) * 2),
        "scale": 0.5,
    }
    assert batch_size(batch) == 6
    piece = slice_batch(batch, 2, 5)
    assert piece["x"].tolist() == [[4, 5], [6, 7], [8, 9]]
    assert piece["mask"].shape == (1, 3)
    assert piece["texts"] == ["c", "d", "e"]
    assert isinstance(piece["pair"], Pair) and piece["pair"].y.tolist() == [4, 6, 8]
    assert piece["scale"] == 0.5
    x, y = slice_batch((torch.arange(6), torch.arange(6)), 4, 6)
    assert x.tolist() == [4, 5] and y.tolist() == [4, 5]
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        batch_size({"scale": 1.0})


def test_containers_keep_their_type():
    ordered = OrderedDict(b=torch.arange(4), a=torch.arange(4) + 10)
    piece = slice_batch(ordered, 1, 3)
    assert type(piece) is OrderedDict and list(piece) == ["b", "a"]
    assert piece["a"].tolist() == [11, 12]
    # the first tensor in insertion order gives the size: a scalar tensor is skipped
    assert batch_size({"t": torch.tensor(2.0), "ids": torch.zeros(5, 2)}) == 5


def test_a_mapping_of_another_kind_is_read_as_a_dict():
    """transformers' BatchEncoding is a UserDict, which the pytree walk does not know."""

    class Encoding(UserDict):
        pass

    batch = Encoding(input_ids=torch.arange(8).view(4, 2), labels=torch.arange(4))
    assert batch_size(batch) == 4
    piece = slice_batch(batch, 0, 2)
    assert piece["input_ids"].tolist() == [[0, 1], [2, 3]] and piece["labels"].tolist() == [0, 1]


def test_lists_of_samples_are_sliced_only_at_the_batch_size():
    batch = {"x": torch.zeros(3, 1), "ids": [[1, 2], [3], [4, 5]], "names": ["a", "b"]}
    piece = slice_batch(batch, 1, 3)
    assert piece["ids"] == [[3], [4, 5]]  # a list of per-sample lists: one value
    assert piece["names"] == ["a", "b"]  # two items in a batch of three: passed whole


def test_piece_weights_add_up_to_one():
    labels = torch.tensor([[1, -100, 2], [3, 4, 5], [-100, -100, 6]])
    total = (labels != -100).sum()

    def count(batch):
        return (batch != -100).sum()

    pieces = [(labels[:2], 2), (labels[2:], 1)]
    weights = [piece_weight(p, size, 3, count, total) for p, size in pieces]
    assert all(w.dtype == torch.float64 for w in weights)
    assert [w.item() for w in weights] == [5 / 6, 1 / 6]
    assert piece_weight(labels[:2], 2, 3) == 2 / 3  # samples when nothing is counted
