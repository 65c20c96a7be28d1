"""``scaleopt data prepare``: text, JSONL, Parquet and Arrow inputs -> token shards.

Inputs (a file or a folder, walked in sorted order of relative paths):

  *.jsonl, *.ndjson (.gz, .zst)   one JSON object per line; the document is its ``text_field``
  *.parquet                       the document is the ``text_field`` column of each row
  *.arrow                         Arrow IPC files (stream or file format), the same column;
                                  a Hugging Face ``datasets.save_to_disk`` folder is such files
                                  plus ``state.json`` / ``dataset_info.json`` (left out; a
                                  ``DatasetDict``'s splits are all read, its
                                  ``dataset_dict.json`` left out)
  anything else (.gz, .zst)       text: the whole file is one document

Everything streams: a text file is read in pieces of about ``PIECE_BYTES`` cut after a line
break with no other white space on either side (the GPT-2, Qwen2 and Llama 3 pre-tokenizers
split there anyway, so a byte-level BPE gives the ids of the whole file), JSONL
line by line, Parquet and Arrow one record batch at a time. Memory is bounded by the pieces of
one encoding batch plus one shard, whatever the size of a file.

Held-out split, by document: a document is held out (``val``) iff the first 8 bytes of
``blake2b(key)`` as a big-endian integer are below ``val_fraction * 2**64``. The key of a record
(JSONL, Parquet, Arrow) is its text, so duplicated records fall on one side; the key of a text
file is its relative path, so its pieces stay together. A lone text file is one document; its
last ``val_fraction`` of lines are held out instead.

Restart: after each training shard the position in the inputs is saved under ``OUT/.prepare/``
(with the few tokens past the shard's end, and the validation tokens so far written as a
validation shard); running the same command again continues from there and writes the same
shards as an uninterrupted run. A finished run writes ``OUT/manifest.json``: the input files
and bytes, tokens per split, each shard's sha256 and a content hash over shards and tokenizer.

Modules: ``options`` (the flags), ``readers`` (files and formats -> units), ``split`` (the
held-out rule), ``tokenize`` (the tokenizer and encoding batches), ``writer`` (shards and the
manifest), ``restart`` (the restart point), ``progress`` (the progress line) and ``run``
(``prepare`` and the command's ``main``).
"""

from scaleopt.train.prepare.options import Options
from scaleopt.train.prepare.run import main, prepare

__all__ = ["Options", "main", "prepare"]
