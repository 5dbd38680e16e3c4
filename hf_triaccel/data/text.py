"""Text for causal language modelling: line splits read with ``datasets``, a word-level
vocabulary built with ``tokenizers``, and the token stream cut into blocks of one length.

The layout is the one of word-level corpora such as WikiText (the Hub's
``Salesforce/wikitext``): one ``text`` column, one row per line of the original file, in
order, words separated by whitespace. Every line, empty ones included, ends with one
``<eos>`` token (the count the WikiText paper reports); words outside the vocabulary
become ``<unk>``.

Example:
    >>> lines = [" the cat sat \\n", "", " the dog sat \\n"]
    >>> tokenizer = word_level_tokenizer(lines)
    >>> ids = token_ids(lines, tokenizer)
    >>> [tokenizer.id_to_token(i) for i in ids]
    ['the', 'cat', 'sat', '<eos>', '<eos>', 'the', 'dog', 'sat', '<eos>']
    >>> pack_blocks(ids, 4).tolist()  # <unk> 0, <eos> 1, then sat, the, cat, dog
    [[3, 4, 2, 1], [1, 3, 5, 2]]
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.trainers import WordLevelTrainer

from hf_triaccel.data.loading import is_hub_dataset_id, path_in_message, split_files

TEXT_COLUMN = "text"
UNK = "<unk>"
EOS = "<eos>"
SPECIAL_TOKENS = (UNK, EOS)


def check_text_source(source: str, splits: Sequence[str]) -> None:
    """Refuses a source that cannot give every split, before anything is read: a local
    folder must hold each split's files; any other name must have the form of a Hub data
    set id (``owner/name``), which only loading can check further.

    Raises:
        FileNotFoundError: a missing folder or split, or a name that is neither a folder
            nor a Hub id.

    Example:
        >>> check_text_source("Salesforce/wikitext", ["train", "validation"])
        >>> check_text_source("no_such_folder", ["train"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        FileNotFoundError: no such folder: 'no_such_folder' (relative to ...), and not a Hub ...
    """
    local = Path(source).expanduser()
    if local.is_dir():
        for split in splits:
            split_files(local, split)
    elif not is_hub_dataset_id(source):
        raise FileNotFoundError(
            f"no such folder: {path_in_message(source)}, and not a Hub data set id (owner/name)"
        )


def load_text_split(
    source: str,
    split: str,
    *,
    config_name: str | None = None,
    text_column: str = TEXT_COLUMN,
) -> list[str]:
    """The lines of one split, in order.

    Args:
        source: a local folder of parquet files (see :func:`split_files`) or a Hub data
            set id such as ``"Salesforce/wikitext"`` (needs the network).
        split: the split to read.
        config_name: the Hub data set's configuration (``"wikitext-2-v1"``); unused for
            a local folder.
        text_column: the column holding the lines.

    Raises:
        FileNotFoundError: see :func:`check_text_source`.
        ValueError: no ``text_column`` in the data.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> datasets.Dataset.from_dict({"text": [" a b \\n", ""]}).to_parquet(
        ...     folder / "train.parquet")  # doctest: +ELLIPSIS
        1...
        >>> load_text_split(str(folder), "train")
        [' a b \\n', '']
    """
    check_text_source(source, [split])
    local = Path(source).expanduser()
    if local.is_dir():
        # in memory: no Arrow copy of the files in the datasets cache folder
        dataset = datasets.load_dataset(
            "parquet",
            data_files=[str(f) for f in split_files(local, split)],
            split="train",
            keep_in_memory=True,
        )
    else:
        dataset = datasets.load_dataset(source, config_name, split=split)
    if text_column not in dataset.column_names:
        raise ValueError(
            f"{source!r} (split {split!r}) has no column {text_column!r}; columns: "
            f"{dataset.column_names}"
        )
    return list(dataset[text_column])


def word_level_tokenizer(lines: Sequence[str], max_words: int | None = None) -> Tokenizer:
    """A word-level tokenizer whose vocabulary is every whitespace-separated word of
    ``lines`` (or its ``max_words`` most frequent): ``<unk>`` (id 0) and ``<eos>`` (id 1),
    then the words from the most to the least frequent (ties in code-point order).
    Unknown words encode to ``<unk>``; decoding joins words with spaces.

    Example:
        >>> tokenizer = word_level_tokenizer([" b a a \\n", " <unk> a \\n"])
        >>> sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
        [('<unk>', 0), ('<eos>', 1), ('a', 2), ('b', 3)]
        >>> tokenizer.encode(" a c b").ids
        [2, 0, 3]
        >>> word_level_tokenizer([" b a a \\n"], max_words=1).encode(" a b").ids
        [2, 0]
    """
    # the trainer counts the words (its ranking: count, then code points); the vocabulary
    # is rebuilt around it because the trainer's special tokens leave a hole in the ids
    # when the corpus itself holds one of them (WikiText holds <unk>)
    counter = Tokenizer(WordLevel(unk_token=UNK))
    counter.pre_tokenizer = WhitespaceSplit()
    counter.train_from_iterator(lines, WordLevelTrainer(vocab_size=2**31 - 1, min_frequency=0))
    counted = counter.get_vocab()
    words = [w for w in sorted(counted, key=counted.__getitem__) if w not in SPECIAL_TOKENS]
    words = words[:max_words]
    vocab = {word: i for i, word in enumerate([*SPECIAL_TOKENS, *words])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


def token_ids(lines: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """The token stream of ``lines``: each line's word ids, then ``<eos>``.

    Example:
        >>> tokenizer = word_level_tokenizer([" a b \\n"])
        >>> token_ids([" a b \\n", "", " b x \\n"], tokenizer).tolist()
        [2, 3, 1, 1, 3, 0, 1]
    """
    eos = tokenizer.token_to_id(EOS)
    encoded = tokenizer.encode_batch(list(lines), add_special_tokens=False)
    stream = (i for e in encoded for i in (*e.ids, eos))
    return np.fromiter(stream, dtype=np.int64, count=sum(len(e.ids) + 1 for e in encoded))


def pack_blocks(ids: np.ndarray, block_size: int) -> torch.Tensor:
    """The stream cut into consecutive blocks of ``block_size`` tokens, ``(N, block_size)``
    int64; the last, incomplete block is dropped.

    Raises:
        ValueError: fewer than ``block_size`` tokens.

    Example:
        >>> pack_blocks(np.arange(7), 3).tolist()
        [[0, 1, 2], [3, 4, 5]]
    """
    blocks = len(ids) // block_size
    if blocks == 0:
        raise ValueError(f"{len(ids)} tokens do not fill one block of {block_size}")
    return torch.from_numpy(np.ascontiguousarray(ids[: blocks * block_size])).view(blocks, -1)


def causal_lm_dataset(blocks: torch.Tensor) -> datasets.Dataset:
    """Blocks as a data set the Trainer takes: ``input_ids`` and ``labels`` (the same
    tokens: the model shifts them), as torch tensors.

    Example:
        >>> data = causal_lm_dataset(torch.arange(6).view(2, 3))
        >>> data[1]["labels"].tolist(), data.column_names
        ([3, 4, 5], ['input_ids', 'labels'])
    """
    rows = blocks.numpy()
    data = datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
    return data.with_format("torch")
